"""What each algorithm is, in one table: its family, the models it runs, the function that
trains it, the advantage estimator its 'auto' means and what sets it apart from its family.
The spec validates against it, the planner and the launcher size roles from it, the trainers
ask it, ``trainers.run_job`` dispatches on it: no code outside this table branches on an
algorithm's name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Algorithm:
    family: str                      # sft, reward, preference, rounds or rl
    trainer: str                     # "module:function" that runs a job of it
    head: str = "lm"                 # what the trained model outputs: 'lm' (tokens) or 'value' (a scalar)
    reference: bool = False          # a frozen copy of the starting model inside each trainer rank
    rollout: bool = False            # vLLM engines generate for it
    critic: bool = False             # a trained value model (PPO)
    advantage: Optional[str] = None  # rl: the estimator rl.advantage 'auto' means
    sequences: int = 1               # sequences a training example puts through the model (a pair: 2)
    data: str = ""                   # what its training rows hold: 'sft' (a conversation or prompt and
    #                                  response), 'prompts' (with reference answers); '' checked by its trainer
    pairs: bool = False              # learns from a chosen and a rejected answer (a round's best and worst)
    unpaired: bool = False           # learns from single answers labelled desirable or not (KTO; pairs split)
    lora: bool = True                # trains LoRA adapters (model.lora)
    precomputed_reference: bool = False  # preference.reference 'precomputed' (the reference's log-probs once)

    @property
    def min_samples(self) -> int:
        """rl.samples_per_prompt it needs: pairs from its own rollouts take a best and a worst."""
        return 2 if self.pairs and self.rollout else 1


_RL = "elasticrl.trainers.rl:run_rl"
_PREFERENCE = "elasticrl.trainers.preference:run_preference"
_ROUNDS = "elasticrl.trainers.rounds:run_rounds"

ALGORITHMS = {
    "sft": Algorithm("sft", "elasticrl.trainers.sft:run_sft", data="sft"),
    "conditional_sft": Algorithm("sft", "elasticrl.trainers.conditional:run_conditional", lora=False),
    "rm": Algorithm("reward", "elasticrl.trainers.rm:run_rm", head="value"),
    "prm": Algorithm("reward", "elasticrl.trainers.prm:run_prm", head="value"),
    "dpo": Algorithm("preference", _PREFERENCE, reference=True, sequences=2, pairs=True, precomputed_reference=True),
    # KTO scores each example and a mismatched one (its reference point)
    "kto": Algorithm("preference", _PREFERENCE, reference=True, sequences=2, unpaired=True),
    "rejection_sampling": Algorithm("rounds", _ROUNDS, rollout=True, data="prompts", lora=False),
    "iterative_dpo": Algorithm("rounds", _ROUNDS, reference=True, rollout=True, sequences=2, data="prompts",
                               pairs=True, lora=False),
    "grpo": Algorithm("rl", _RL, rollout=True, advantage="grpo", data="prompts"),
    "ppo": Algorithm("rl", _RL, rollout=True, critic=True, advantage="gae", data="prompts"),
    "reinforce++": Algorithm("rl", _RL, rollout=True, advantage="reinforce++_baseline", data="prompts"),
    "rloo": Algorithm("rl", _RL, rollout=True, advantage="rloo", data="prompts"),
}


def reward_model_first(spec) -> bool:
    """Whether ``init.rm_steps`` trains a reward model before the job: an algorithm with a critic
    (which starts from that model) and no reward models given."""
    return ALGORITHMS[spec.algorithm].critic and spec.init.rm_steps > 0 and not spec.rewards.models


@dataclass(frozen=True)
class Estimator:
    group: bool             # compares the samples of a prompt: needs rl.samples_per_prompt >= 2
    whiten: bool            # rl.whiten_advantages 'auto' whitens its advantages over the batch
    critic: bool = False    # needs the critic's values (algorithm: ppo)


ADVANTAGE_ESTIMATORS = {
    "gae": Estimator(group=False, whiten=True, critic=True),
    "grpo": Estimator(group=True, whiten=False),
    "dr_grpo": Estimator(group=True, whiten=False),
    "rloo": Estimator(group=True, whiten=False),
    "reinforce++": Estimator(group=False, whiten=True),
    "reinforce++_baseline": Estimator(group=True, whiten=True),
}


def advantage_of(algorithm: str, advantage: str) -> str:
    """The estimator a job uses: ``rl.advantage``, or its algorithm's when 'auto'."""
    return ALGORITHMS[algorithm].advantage if advantage == "auto" else advantage


def longest_sequence(spec) -> int:
    """Tokens of the longest sequence a job's models see: a prompt or example (data.max_length),
    and for a job that generates, rl.max_new_tokens a turn (rl.max_turns with an environment)."""
    alg, rl = ALGORITHMS[spec.algorithm], spec.rl
    turns = rl.max_turns if spec.rollout.environment else 1
    return spec.data.max_length + (rl.max_new_tokens * turns if alg.rollout else 0)

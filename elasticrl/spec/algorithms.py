"""What each algorithm is, in one table: its family, the models it runs, the function that
trains it and the advantage estimator its 'auto' means. The spec validates against it, the
planner and the launcher size roles from it, ``trainers.run_job`` dispatches on it.
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


_RL = "elasticrl.trainers.rl:run_rl"
_PREFERENCE = "elasticrl.trainers.preference:run_preference"
_ROUNDS = "elasticrl.trainers.rounds:run_rounds"

ALGORITHMS = {
    "sft": Algorithm("sft", "elasticrl.trainers.sft:run_sft"),
    "conditional_sft": Algorithm("sft", "elasticrl.trainers.conditional:run_conditional"),
    "rm": Algorithm("reward", "elasticrl.trainers.rm:run_rm", head="value"),
    "prm": Algorithm("reward", "elasticrl.trainers.prm:run_prm", head="value"),
    "dpo": Algorithm("preference", _PREFERENCE, reference=True, sequences=2),
    # KTO scores each example and a mismatched one (its reference point)
    "kto": Algorithm("preference", _PREFERENCE, reference=True, sequences=2),
    "rejection_sampling": Algorithm("rounds", _ROUNDS, rollout=True),
    "iterative_dpo": Algorithm("rounds", _ROUNDS, reference=True, rollout=True, sequences=2),
    "grpo": Algorithm("rl", _RL, rollout=True, advantage="grpo"),
    "ppo": Algorithm("rl", _RL, rollout=True, critic=True, advantage="gae"),
    "reinforce++": Algorithm("rl", _RL, rollout=True, advantage="reinforce++_baseline"),
    "rloo": Algorithm("rl", _RL, rollout=True, advantage="rloo"),
}


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

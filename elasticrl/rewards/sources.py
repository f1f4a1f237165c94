"""The rewards of a batch: the spec's functions, remote endpoints and reward models, each
times its weight, summed. Reward models are whatever scores the batch for the caller (the RL
driver passes callables that ask its reward-model roles).

Every source is user code or a service, so each call can fail: raise, hang past
``rewards.timeout_s``, or give a non-number or a non-finite value. Each failure is counted
(``reward/errors``, and by source) and handled by ``rewards.on_error``; with 'zero' and
'drop_sample', ``rewards.max_consecutive_errors`` failures in a row from one source end the
run, naming the source, the sample and the cause."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from elasticrl.rewards.isolated import FunctionPool
from elasticrl.rewards.remote import RemoteReward
from elasticrl.rewards.verifiers import function_path, verifier_path
from elasticrl.spec import JobSpec

ModelScores = Callable[[], torch.Tensor]  # one reward model's scores of the batch, in batch order


class RewardError(RuntimeError):
    """A reward source failed and the policy says stop; ``str()`` is one line."""


@dataclass
class Scores:
    total: torch.Tensor                        # the weighted sum per sample (0 where dropped)
    keep: torch.Tensor                         # False: the sample is dropped (rewards.on_error: drop_sample)
    info: dict = field(default_factory=dict)   # reward/errors, reward/errors/<source>
    verified: list = field(default_factory=list)  # the verifier's score (or error text) per sample


class RewardSources:
    def __init__(self, spec: JobSpec):
        r = spec.rewards
        self.policy, self.limit = r.on_error, r.max_consecutive_errors
        # the functions' processes also run the job's verifier, which every accuracy figure uses
        paths = [function_path(f.path, spec) for f in r.functions]
        self.verifier = verifier_path(spec)
        self.verifier_index = paths.index(self.verifier) if self.verifier in paths else len(paths)
        paths += [self.verifier] if self.verifier_index == len(paths) else []
        self.process = FunctionPool(paths, r.timeout_s, r.workers)
        # (metric name, what the console calls it, weight)
        self.function_names = [(f.path.rpartition(":")[2], f"reward function {f.path}", f.weight) for f in r.functions]
        self.remote = [(RemoteReward(e.url, e.timeout_s, e.retries), f"remote{i}", f"reward endpoint {e.url}", e.weight)
                       for i, e in enumerate(r.remote)]
        self.in_a_row: dict[str, int] = {}

    def start(self) -> None:
        """Start the functions' process: a function that does not import fails here, in one line."""
        if not self.process.started:
            self.process.start()

    def close(self) -> None:
        self.process.close()

    def __enter__(self) -> "RewardSources":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, prompts: list[str], completions: list[str], answers: list,
                 models: list[tuple[ModelScores, float]] = (), where: str = "") -> Scores:
        n = len(completions)
        total, keep, info = torch.zeros(n), torch.ones(n, dtype=torch.bool), {"reward/errors": 0}
        # (metric name, console name, weight, a value or an error per sample, or one error for the batch)
        outcomes: list[tuple[str, str, float, list | str]] = []
        items = [list(x) for x in zip(prompts, completions, answers)]
        for i, (short, name, w) in enumerate(self.function_names):
            outcomes.append((short, name, w, self.process(i, items)))
        verified = outcomes[self.verifier_index][3] if self.verifier_index < len(outcomes) else \
            self.verify(prompts, completions, answers)
        for endpoint, short, name, w in self.remote:
            outcomes.append((short, name, w, _batch_call(lambda: endpoint(prompts, completions, answers), n)))
        for i, (score, w) in enumerate(models):
            outcomes.append((f"model{i}", f"reward model {i}", w,
                             _batch_call(lambda: [float(x) for x in score().float().tolist()], n)))
        for short, name, w, values in outcomes:
            if isinstance(values, str):  # the batch's one call failed: an error for each of its samples
                values = [values] * n
                self._count(name, values, prompts, where, whole=True)
            else:
                values = [v if isinstance(v, str) or math.isfinite(v) else f"gave {v}" for v in values]
                self._count(name, values, prompts, where)
            bad = [isinstance(v, str) for v in values]
            info["reward/errors"] += sum(bad)
            info[f"reward/errors/{short}"] = sum(bad)
            total += w * torch.tensor([0.0 if b else float(v) for v, b in zip(values, bad)])
            if self.policy == "drop_sample":
                keep &= ~torch.tensor(bad, dtype=torch.bool)
        total[~keep] = 0.0
        if self.policy == "drop_sample":
            info["reward/dropped"] = int((~keep).sum())
        return Scores(total, keep, info, verified)

    def verify(self, prompts: list[str], completions: list[str], answers: list) -> list[float | str]:
        """The job's verifier on each sample: its score, or the error it ended in (a sample
        without a reference answer scores 0 unasked)."""
        if all(a is None for a in answers):
            return [0.0] * len(completions)
        self.start()
        return self.process(self.verifier_index, [list(x) for x in zip(prompts, completions, answers)])

    def _count(self, name: str, calls: list, prompts: list[str], where: str, whole: bool = False) -> None:
        """Errors in a row for ``name``, one per sample without a score from it (``whole``: the
        batch's one call failed, so every sample did); raise when the policy says stop."""
        for j, v in enumerate(calls):
            if not isinstance(v, str):
                self.in_a_row[name] = 0
                continue
            self.in_a_row[name] = self.in_a_row.get(name, 0) + 1
            last = j == len(calls) - 1 or (self.limit and self.in_a_row[name] >= self.limit)
            if whole and not last:
                continue
            sample = f"the batch{where and ' of ' + where}" if whole else \
                f"sample {j}{where and ' of ' + where} (prompt {prompts[j][:40]!r})"
            if self.policy == "fail":
                raise RewardError(f"{name} failed on {sample}: {v} (rewards.on_error is fail; 'zero' or "
                                  "'drop_sample' would count it and go on)")
            if self.limit and self.in_a_row[name] >= self.limit:
                raise RewardError(f"{name} failed on {sample}: {v}; {self.in_a_row[name]} errors in a row "
                                  f"(rewards.max_consecutive_errors: {self.limit}): fix it, or raise the limit")


def _batch_call(call: Callable[[], list], n: int) -> list | str:
    """A source scored in one call (an endpoint, a reward model): its values, or its error text."""
    try:
        values = call()
    except Exception as exc:  # noqa: BLE001 - a service or a role: any failure is that call's error ...
        if getattr(exc, "lost", False):  # ... but a reward model's rank lost (cluster.RoleError): the
            raise  # driver builds that role again and scores the batch anew
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    if len(values) != n:
        return f"gave {len(values)} values for {n} samples"
    return values

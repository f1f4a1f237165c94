"""Process reward model: a score for every step of a solution, not only for its end.

Each line holds a prompt, its solution as a list of steps and one label per step (1 = still
on track, 0 = wrong, soft labels in between), as in Math-Shepherd. The step marker token
(``data.step_marker``) is written after every step; the scalar head's logit at each marker
is trained with binary cross-entropy against that step's label. A step's score is the
sigmoid of that logit, a solution's is its weakest step's (min over steps), so a solution
that reaches the right answer through a wrong step still scores low. Variant: a scalar head
like the reward model's, where OpenRLHF reads the LM's logits of two reward tokens; the
export is the same Hugging Face sequence-classification model as ``algorithm: rm``.

Run it:
  CPU:          elasticrl run examples/tiny_prm.yaml --output runs/prm
  workstation:  elasticrl run my_prm.yaml --output runs/prm --set train.num_ranks=4
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from elasticrl.algorithms.preference import process_reward_loss
from elasticrl.data.records import format_prompt, pad_batch, read_records
from elasticrl.models.load import token_values
from elasticrl.spec import JobSpec
from elasticrl.trainers.rm import RMWorker, run_head_trainer
from elasticrl.trainers.worker import RankWorker


def step_keys(spec: JobSpec) -> tuple[str, ...]:
    return spec.data.prompt_key, spec.data.steps_key, spec.data.step_labels_key


def read_step_records(path: str, spec: JobSpec, check: bool = False) -> list[dict]:
    """The lines of ``path``, checked: a non-empty list of steps and as many labels in [0, 1]."""
    _, steps_key, labels_key = keys = step_keys(spec)
    records = read_records(path, keys, check)
    for lineno, rec in enumerate(records, 1):
        steps, labels = rec[steps_key], rec[labels_key]
        if not (isinstance(steps, list) and steps and all(isinstance(x, str) for x in steps)):
            raise ValueError(f"{path}: record {lineno}: '{steps_key}' must be a non-empty list of strings")
        if not (isinstance(labels, list) and len(labels) == len(steps)
                and all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in labels)):
            raise ValueError(f"{path}: record {lineno}: '{labels_key}' must hold one number in [0, 1] per step "
                             f"({len(steps)} steps)")
    return records


def marker_id(tokenizer, marker: str) -> int:
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"data.step_marker: {marker!r} is {len(ids)} tokens in this tokenizer; pick a string that "
                         f"is exactly one token (e.g. a newline or one of its reserved special tokens)")
    return ids[0]


def encode_steps(tokenizer, prompt: str, steps: list[str], marker: int, apply_chat_template: bool,
                 max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt, then each step followed by the marker; and the markers' positions
    (steps cut off by ``max_length`` lose their marker and are not scored)."""
    ids = tokenizer(format_prompt(tokenizer, prompt, apply_chat_template), add_special_tokens=False)["input_ids"]
    positions = []
    for step in steps:
        ids = ids + tokenizer(step, add_special_tokens=False)["input_ids"] + [marker]
        positions.append(len(ids) - 1)
    ids = ids[:max_length]
    return ids, [p for p in positions if p < len(ids)]


def step_metrics(solutions: list[tuple[str, list[float], list[float]]]) -> dict:
    """Held-out figures from (prompt, step labels, step scores) of each solution, scores being
    probabilities:
    step_accuracy: steps whose score is on the label's side of 0.5;
    first_error_accuracy: solutions whose first step scored below 0.5 is the first labelled
      wrong one (or none of either);
    best_of_n_accuracy: over prompts with several solutions, one of them right throughout, how
      often the solution with the highest weakest-step score is a right one (ties: the first)."""
    right, steps, first_ok = 0, 0, 0
    groups: dict[str, list[tuple[float, bool]]] = defaultdict(list)
    for prompt, labels, scores in solutions:
        labels = [x > 0.5 for x in labels[: len(scores)]]
        guess = [x > 0.5 for x in scores]
        right += sum(g == lab for g, lab in zip(guess, labels))
        steps += len(scores)
        first_ok += (guess + [False]).index(False) == (labels + [False]).index(False)
        groups[prompt].append((min(scores, default=0.0), all(labels)))
    contests = [g for g in groups.values() if len(g) > 1 and any(ok for _, ok in g)]
    out = {"eval/step_accuracy": right / max(1, steps),
           "eval/first_error_accuracy": first_ok / max(1, len(solutions))}
    if contests:
        out["eval/best_of_n_accuracy"] = sum(max(g, key=lambda c: c[0])[1] for g in contests) / len(contests)
    return out


class PRMWorker(RMWorker):
    def setup(self, rank, world_size, addr, port, total_steps, resume: str | None = None) -> dict:
        out = RankWorker.setup(self, rank, world_size, addr, port, total_steps, resume)
        s = self.spec
        self.marker = marker_id(self.core.tokenizer, s.data.step_marker)
        self.examples = read_step_records(self.paths["train"], s)
        self.eval_examples = read_step_records(self.paths["eval"], s)
        return out

    def _logits(self, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's values [B, T], the marker mask and the labels laid on it."""
        d, tok = self.spec.data, self.core.tokenizer
        seqs, positions = zip(*(encode_steps(tok, r[d.prompt_key], r[d.steps_key], self.marker,
                                             d.apply_chat_template, d.max_length) for r in records))
        b = {k: v.to(self.core.device) for k, v in pad_batch(list(seqs), tok.pad_token_id).items()}
        markers = torch.zeros_like(b["input_ids"], dtype=torch.bool)
        labels = torch.zeros(markers.shape, device=markers.device)
        for i, (pos, rec) in enumerate(zip(positions, records)):
            markers[i, pos] = True
            labels[i, pos] = torch.tensor(rec[d.step_labels_key][: len(pos)], dtype=torch.float, device=labels.device)
        return token_values(self.model(), b["input_ids"], b["attention_mask"], d.packing), markers, labels

    def train_step(self, step: int) -> dict:
        B = self.spec.train.global_batch_size
        loss_sum, right, steps = 0.0, 0, 0
        lr = self.core.engine.get_lr()[0]
        d = self.spec.data
        for keys in self.core.micro_batches(len(self.examples), step, lambda i: len(encode_steps(
                self.core.tokenizer, self.examples[i][d.prompt_key], self.examples[i][d.steps_key], self.marker,
                d.apply_chat_template, d.max_length)[0])):
            if keys is None:  # a token budget's empty micro-batch: the collectives' turn, with no weight
                self.core.backward(self._logits(self.examples[:1])[0].sum() * 0)
                continue
            part = [self.examples[i] for i in keys]
            values, markers, labels = self._logits(part)
            # mean over this micro-batch's steps, weighted by its share of the global batch
            loss_sum += self.core.backward(process_reward_loss(values, markers, labels) * len(part) / B)
            right += int(((values[markers] > 0) == (labels[markers] > 0.5)).sum())
            steps += int(markers.sum())
        return {"loss_sum": loss_sum, "right": right, "steps": steps, "lr": lr, "leader": self.core.is_dp_leader}

    @torch.no_grad()
    def evaluate(self, num_records: int) -> dict:
        """(index, prompt, labels, step scores) of this rank's share of the eval records."""
        self.core.engine.eval()
        n = min(num_records or len(self.eval_examples), len(self.eval_examples))
        mine = list(range(self.core.dp_rank, n, self.core.dp_size))
        d, out = self.spec.data, []
        for m in range(0, len(mine), 64):
            part = mine[m:m + 64]
            values, markers, _ = self._logits([self.eval_examples[i] for i in part])
            probs = torch.sigmoid(values)
            for row, i in enumerate(part):
                rec = self.eval_examples[i]
                out.append((i, rec[d.prompt_key], rec[d.step_labels_key], probs[row][markers[row]].tolist()))
        return {"solutions": out, "leader": self.core.is_dp_leader}


def run_prm(spec: JobSpec, output: Path) -> dict:
    return run_head_trainer(spec, output, PRMWorker, ("prm", "prm_eval"),
                            lambda path: read_step_records(path, spec, check=True),
                            _step_row, _evaluate, "step_accuracy")


def _evaluate(group, spec: JobSpec) -> dict:
    rows = sorted(row for r in group.call("evaluate", spec.eval.num_prompts) if r["leader"] for row in r["solutions"])
    return step_metrics([row[1:] for row in rows])


def _step_row(res: list[dict], *_) -> dict:
    return {"loss": sum(r["loss_sum"] for r in res),
            "step_accuracy": sum(r["right"] for r in res) / max(1, sum(r["steps"] for r in res)),
            "lr": res[0]["lr"]}

"""What every trainer's driver does the same way: output folder, metrics, progress, resume."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from elasticrl import run_folder as rf
from elasticrl.backend import environment
from elasticrl.data.records import read_records
from elasticrl.engine import checkpoint as ckpt
from elasticrl.engine.checkpoint import list_checkpoints
from elasticrl.files import atomic_folder, disk_problem, write_text
from elasticrl.spec import JobSpec, SpecError, dump_spec, load_spec, read_raw, spec_to_dict
from elasticrl.world import world_paths


class MetricsLog:
    """The metrics of a run: ``OUTPUT/metrics.jsonl`` (one JSON object per logged step, flushed
    as written), TensorBoard event files in ``OUTPUT/tensorboard`` (``log.tensorboard``) and a
    Weights & Biases run (``log.wandb``); the last two also get the resolved spec and the
    environment once at the start. A resumed run (``resume_step``) drops what was logged past
    its checkpoint and logs those steps again."""

    def __init__(self, output: Path, spec: JobSpec, resume_step: int | None):
        self.path = path = output / rf.METRICS
        if resume_step is None:
            path.unlink(missing_ok=True)
        elif path.exists():  # drop lines past the checkpoint: the resumed run rewrites them
            kept = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            write_text(path, "".join(ln + "\n" for ln in kept))
        self.fh = open(path, "a")
        self.tensorboard = self.wandb = None
        about = {"spec": spec_to_dict(spec), "environment": environment()}
        if spec.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if resume_step is None:  # a fresh run's events only
                shutil.rmtree(output / rf.TENSORBOARD, ignore_errors=True)
            self.tensorboard = SummaryWriter(str(output / rf.TENSORBOARD), purge_step=(resume_step or 0) + 1)
            for key, value in about.items():
                self.tensorboard.add_text(key, "```\n" + yaml.safe_dump(value, sort_keys=False) + "```",
                                          resume_step or 0)
        if spec.log.wandb:
            self.wandb = _wandb_run(output, spec, about)

    def write(self, row: dict) -> None:
        self.fh.write(json.dumps(row, sort_keys=False) + "\n")
        self.fh.flush()
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k != "step"}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, row["step"])
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=row["step"])

    def episodes(self, step: int, samples: list) -> None:
        """Evaluation episodes, whole (multi-turn rollouts): appended to ``OUTPUT/episodes.jsonl``
        and, with TensorBoard, shown in its text tab."""
        rows = [{"step": step, "reward": s.episode["reward"], "error": s.episode["error"],
                 "messages": s.episode["messages"]} for s in samples]
        with open(self.path.with_name(rf.EPISODES), "a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        if self.tensorboard is not None:
            text = "\n\n---\n\n".join("\n\n".join(f"**{m['role']}**: `{m['content']}`" for m in r["messages"])
                                          for r in rows)
            self.tensorboard.add_text("episodes", text, step)

    def close(self) -> None:
        self.fh.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_key() -> bool:
    """Whether a W&B API key is at hand: the environment's, or the one `wandb login` stored."""
    import netrc

    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(os.environ.get("WANDB_BASE_URL", "api.wandb.ai").split("//")[-1]) \
            is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb_run(output: Path, spec: JobSpec, about: dict):
    """The run's W&B run: one per output folder (its id kept there), continued on resume."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    id_file = output / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    write_text(id_file, run_id)
    return wandb.init(project=spec.log.wandb, id=run_id, resume="allow", dir=str(output), mode=spec.log.wandb_mode,
                      name=output.name, config=about)


def finish_run(group, spec: JobSpec, output: Path, summary: dict, row: dict, progress, metrics,
               checkpoints: Checkpoints) -> dict:
    """Commit the last checkpoint, close the console and the metrics, export the final model,
    complete the summary."""
    checkpoints.commit()
    if checkpoints.done:
        summary["checkpoints"] = {"count": len(checkpoints.done), **{
            f"{k}_mean": round(sum(c[k] for c in checkpoints.done) / len(checkpoints.done), 3)
            for k in ("seconds_blocking", "seconds_total")}, "gbytes": checkpoints.done[-1]["gbytes"]}
    progress.close()
    metrics.close()
    if spec.export.enabled:
        with atomic_folder(output / rf.FINAL) as tmp:  # every rank writes its files into it
            group.call("export", str(tmp))
        summary["export"] = str(output / rf.FINAL)
    summary["final"] = row
    return summary


def prepare_output(spec: JobSpec, output: Path) -> Path:
    """The output folder with the resolved spec in it, after the checks that need no worker."""
    if spec.log.wandb and spec.log.wandb_mode == "online" and not _wandb_key():
        raise ValueError("log.wandb: logging to W&B online needs a key (WANDB_API_KEY, or `wandb login`); or set "
                         "log.wandb_mode: offline and `wandb sync` later")
    output.mkdir(parents=True, exist_ok=True)
    dump_spec(spec, output / rf.SPEC)
    return output


def ask_engines(output: Path, engines: int) -> Path:
    """Ask the job running into ``output`` for ``engines`` rollout engines (it reads the
    request at its next step boundary)."""
    if engines < 1:
        raise ValueError(f"--engines: a job needs at least 1 rollout engine, got {engines}")
    job_spec(output)
    if (output / rf.FINISHED).is_file():
        raise ValueError(f"{output}: that job has finished; scaling applies to a running job")
    return write_text(output / rf.SCALE, json.dumps({"engines": engines, "asked_at": time.time()}))


def job_spec(output: Path) -> JobSpec:
    """The spec of the job writing into ``output`` (its spec.yaml); ValueError when none is."""
    if not (output / rf.SPEC).is_file():
        raise ValueError(f"{output}: no job runs there (no spec.yaml); give the --output of a running job")
    return load_spec(read_raw(output / rf.SPEC), check_paths=False)


def engines_now(output: Path) -> int:
    """The rollout engines of the job in ``output``: its last metrics row's, else its spec's."""
    spec = job_spec(output)
    path = output / rf.METRICS
    for line in reversed(path.read_text().splitlines() if path.is_file() else []):
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if "rollout/engines" in row:
                return int(row["rollout/engines"])
    return spec.rollout.num_engines


def asked_engines(output: Path, seen: float) -> tuple[int | None, float]:
    """(engines asked since ``seen``, the request's time) or (None, seen)."""
    try:
        asked = json.loads((output / rf.SCALE).read_text())
    except (OSError, ValueError):
        return None, seen
    if asked.get("asked_at", 0) <= seen:
        return None, seen
    return int(asked["engines"]), asked["asked_at"]


def mark_finished(spec: JobSpec, output: Path, summary: dict) -> None:
    """``OUTPUT/finished.json``: the run ended; its spec and summary."""
    write_text(output / rf.FINISHED,
               json.dumps({"spec": spec_to_dict(spec), "summary": summary}, default=str, indent=1))


def finished_run(spec: JobSpec, output: Path) -> dict | None:
    """The summary of the run that finished in ``output`` with this spec (rerunning it does
    nothing), or None: no finished run there, ``checkpoint.resume`` is not 'auto', or the spec
    asks for more steps and a checkpoint lets the run continue."""
    path = output / rf.FINISHED
    if spec.checkpoint.resume != "auto" or not path.is_file():
        return None
    done = json.loads(path.read_text())
    changed = ckpt.changed_fields(done["spec"], spec_to_dict(spec))
    if not changed or all(k.startswith(("eval.", "log.", "export.", "ray.")) for k in changed):
        print(f"{output}: this job finished there already; nothing to do (use another --output, or "
              "checkpoint.resume: null to run it again from the start)", file=sys.stderr, flush=True)
        return {**done["summary"], "already_finished": True}
    if not list_checkpoints(output / "checkpoints"):
        raise ValueError(f"checkpoint.resume: {output} holds a finished run of another spec ({', '.join(changed)} "
                         "changed) and no checkpoint to continue from; use another --output, or checkpoint.resume: "
                         "null to start over there")
    return None  # more steps: find_resume continues from the newest checkpoint (and checks the spec)


def data_paths(spec: JobSpec, train: str, eval: str) -> dict[str, str]:
    """Where a job's data is: ``data.train`` and ``data.eval``, or where one is null the
    embedded world's file named ``train`` / ``eval`` (``world.world_paths``: sft, rl_prompts,
    eval, preference, preference_eval)."""
    world = world_paths(spec.world) if spec.data.train is None or spec.data.eval is None else {}
    return {"train": spec.data.train or str(world[train]), "eval": spec.data.eval or str(world[eval])}


def check_user_files(spec: JobSpec, train, eval=()) -> None:
    """The user's data files read before Ray starts, so that a bad one fails in seconds, naming
    the spec field, the file, the line and the row's field, not after the models have loaded.
    ``train`` / ``eval``: the fields (``data.records.Fields``) a row of that file needs, or a
    function that reads and checks the file itself."""
    for name, want in (("train", train), ("eval", eval)):
        path = getattr(spec.data, name)
        if path is None:
            continue
        try:
            want(path) if callable(want) else read_records(path, want, check=True, data=spec.data)
        except ValueError as exc:
            raise SpecError(f"data.{name}", str(exc)) from None


def find_resume(spec: JobSpec, output: Path) -> ckpt.Resume:
    """The checkpoint to resume from, per ``checkpoint.resume`` (an empty ``Resume``: the
    start), checked before anything runs (``engine.checkpoint.check_resumable``). Call it
    before ``prepare_output``."""
    choice = spec.checkpoint.resume
    if choice is None:
        return ckpt.Resume()
    if choice == "auto":
        found = list_checkpoints(output / rf.CHECKPOINTS)
        if not found:
            return ckpt.Resume()
        path = found[-1][1]
    else:
        path = Path(choice)
        if not (path / ckpt.STATE_FILE).is_file():
            raise ValueError(f"checkpoint.resume: {path} is not a checkpoint folder (no {ckpt.STATE_FILE})")
    state = ckpt.check_resumable(path, spec)
    print(f"{rf.RESUMING} {path.name} (step {state['step']})", file=sys.stderr, flush=True)
    return ckpt.Resume(path, state)


@dataclass(frozen=True)
class Cadence:
    """When a trainer evaluates, writes a metrics row and checkpoints: every trainer asks this
    one object (a component owns its "when"; the loop only asks). ``done`` counts the steps
    finished (1 after the first), of ``total``; ``since``: the ``done`` of the previous call
    when a trainer advances by more than one step at a time (a round of several)."""

    spec: JobSpec
    total: int

    def evaluate_start(self) -> bool:
        """The starting model is evaluated (step 0) whenever evaluation is on."""
        return self.spec.eval.enabled

    def evaluate(self, done: int, since: int | None = None) -> bool:
        """Every ``eval.every_steps`` and at the end, unless ``eval.enabled`` is false; a round
        (``since`` given: ``trainers.rounds``) at its end, its samples being the round's point."""
        return self.spec.eval.enabled and (since is not None or self._crosses(self.spec.eval.every_steps, done, since)
                                           or done == self.total)

    def log(self, done: int, evaluated: bool, since: int | None = None) -> bool:
        """A metrics row every ``log.every_steps``, at the first and the last step, with an
        evaluation, and at a round's end (``since`` given)."""
        return since is not None or done % self.spec.log.every_steps == 0 or evaluated or done in (1, self.total)

    def checkpoint(self, done: int, since: int | None = None) -> bool:
        """Every ``checkpoint.every_steps`` and at the end; never when it is 0."""
        every = self.spec.checkpoint.every_steps
        return bool(every) and (self._crosses(every, done, since) or done == self.total)

    def memory_copy(self, done: int) -> bool:
        """Every ``fault.memory_copy_steps``, where no checkpoint is written anyway."""
        every = self.spec.fault.memory_copy_steps
        return bool(every) and done % every == 0 and not self.checkpoint(done)

    @staticmethod
    def _crosses(every: int, done: int, since: int | None) -> bool:
        since = done - 1 if since is None else since
        return bool(every) and done // every > since // every


def num_steps(max_steps: int, num_epochs: float, num_records: int, global_batch: int) -> int:
    return max_steps or max(1, math.ceil(num_epochs * num_records / global_batch))


class Progress:
    """A tqdm bar with the latest figures, or plain lines when the console is not a terminal."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)
        self.start = time.time()

    def update(self, **figures) -> None:
        self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in figures.items()},
                             refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class Checkpoints:
    """A run's checkpoints. ``save`` returns once every rank has staged its pieces in host memory
    (``checkpoint/seconds_blocking``); with ``checkpoint.background`` the ranks write them while
    training goes on, and the checkpoint is committed (its temp folder renamed into place, older
    ones pruned: ``checkpoint/seconds_total``) once all are done: at a ``poll`` that finds them
    done, before the next save, and at the end. A crash before the commit leaves the previous
    checkpoint as it was, and a full disk is one line naming the fix."""

    def __init__(self, spec: JobSpec, output: Path, asked: JobSpec | None = None):
        self.spec, self.asked, self.root = spec, asked or spec, output / rf.CHECKPOINTS
        self.pending: tuple | None = None  # (step, temp folder, {role: group}, t0, seconds blocking)
        self.done: list[dict] = []        # each committed checkpoint's figures
        self.reported = 0

    def save(self, groups: dict, step: int, state: dict | None = None) -> None:
        """A checkpoint of step ``step``: each trained role's group (role -> RoleGroup) saves
        into its folder, and ``state`` (what the trainer carries between steps, its data
        position: the global index of the next sample; for the trainers on a fixed dataset
        step x batch) joins the step in trainer_state.json."""
        self.commit()  # the previous one first
        state = state or {"samples_seen": step * self.spec.train.global_batch_size}
        background = self.spec.checkpoint.background
        t0, tmp = time.time(), None
        with self._disk(step):
            tmp = ckpt.begin_checkpoint(self.root, step)
            try:
                for role, group in groups.items():
                    (tmp / role).mkdir()
                    group.call("save", str(tmp / role), background)
                ckpt.write_trainer_state(tmp, self.asked, {"step": step, **state})
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self.pending = (step, tmp, groups, t0, time.time() - t0)
        if not background:
            self.commit()

    def poll(self) -> None:
        """Commit the pending checkpoint if every rank has written its part."""
        if self.pending is None:
            return
        try:
            with self._disk(self.pending[0]):
                done = all(n is not None for g in self.pending[2].values() for n in g.call("saved", False))
        except BaseException:
            self.abandon()
            raise
        if done:
            self.commit()

    def commit(self) -> None:
        """Wait for the pending checkpoint's writes, then put it in place."""
        if self.pending is None:
            return
        step, tmp, groups, t0, blocking = self.pending
        self.pending = None
        try:
            with self._disk(step):
                written = sum(sum(g.call("saved", True)) for g in groups.values())
                ckpt.commit_checkpoint(tmp, self.root, step, self.spec.checkpoint.keep)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._record(step, t0, blocking, written)

    def salvage(self) -> None:
        """After a rank was lost: commit the pending checkpoint if every rank's files are there
        (each appears whole, so their presence says the writes are done), else drop it. The
        ranks are not asked: the lost one cannot answer and its peers may wait on it."""
        if self.pending is None:
            return
        from elasticrl.engine.state import Pieces

        step, tmp, groups, t0, blocking = self.pending
        try:
            for role in groups:
                Pieces(tmp / role)
        except (ValueError, OSError):
            return self.abandon()
        self.pending = None
        written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        ckpt.commit_checkpoint(tmp, self.root, step, self.spec.checkpoint.keep)
        self._record(step, t0, blocking, written)

    def _record(self, step: int, t0: float, blocking: float, written: int) -> None:
        self.done.append({"step": step, "seconds_blocking": round(blocking, 3),
                          "seconds_total": round(time.time() - t0, 3), "gbytes": round(written / 1e9, 4)})

    def adopt(self, step: int, state: dict, fill) -> bool:
        """A checkpoint of step ``step`` whose role folders ``fill(temp folder)`` writes (the
        in-memory copy), with ``state`` as ``save``'s; when ``fill`` finds it incomplete
        (returns False) nothing is left and False is returned."""
        tmp = ckpt.begin_checkpoint(self.root, step)
        try:
            if not fill(tmp):
                return False
            ckpt.write_trainer_state(tmp, self.asked, {"step": step, **state})
            ckpt.commit_checkpoint(tmp, self.root, step, self.spec.checkpoint.keep)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def abandon(self) -> None:
        """Drop the pending checkpoint (a rank that was writing it is gone)."""
        if self.pending is not None:
            shutil.rmtree(self.pending[1], ignore_errors=True)
            self.pending = None

    def figures(self) -> dict:
        """The newest committed checkpoint's figures, once, for the next metrics row."""
        if len(self.done) == self.reported:
            return {}
        self.reported = len(self.done)
        return {f"checkpoint/{k}": v for k, v in self.done[-1].items() if k != "step"}

    @contextlib.contextmanager
    def _disk(self, step: int):
        try:
            yield
        except Exception as exc:
            problem = disk_problem(exc)
            if problem is None:
                raise
            found = list_checkpoints(self.root)
            kept = f"; the newest checkpoint, {found[-1][1]}, is intact" if found else ""
            fewer = " or keep fewer checkpoints (checkpoint.keep)" if "space" in problem[1] else ""
            raise RuntimeError(f"checkpoint: cannot write step {step} into {self.root}: {problem[0]}; "
                               f"{problem[1]}{fewer}{kept}") from exc


def offline_loop(spec: JobSpec, group, output: Path, total: int, step_row, evaluate, show: str,
                 start: int = 0) -> dict:
    """The driver of the trainers on a fixed dataset (rm, prm, dpo, kto): evaluate the start,
    then step, log, evaluate every ``eval.every_steps`` and at the end, checkpoint, export.
    ``step_row(results of the data-parallel leaders, steps done, the step's seconds)`` makes a
    step's metrics; ``show`` names the eval figure on the progress bar; ``start``: the step a
    resumed run continues after."""
    metrics = MetricsLog(output, spec, resume_step=start or None)
    progress = Progress(total, start, spec.log.progress_bar, desc=spec.algorithm)
    when = Cadence(spec, total)
    checkpoints = Checkpoints(spec, output)
    summary: dict = {}
    if not start and when.evaluate_start():
        summary["initial"] = evaluate()
        metrics.write({"step": 0, **summary["initial"]})
    row: dict = {}
    for step in range(start, total):
        t0 = time.time()
        res = [r for r in group.call("train_step", step) if r["leader"]]
        done = step + 1
        seconds = time.time() - t0
        row = {"step": done, **step_row(res, done, seconds), "step_seconds": seconds}
        evaluated = when.evaluate(done)
        if evaluated:
            row.update(evaluate())
        checkpoints.poll()
        row.update(checkpoints.figures())
        if when.log(done, evaluated):
            metrics.write(row)
        if when.checkpoint(done):
            checkpoints.save({"actor": group}, done)
        progress.update(loss=row["loss"], **({show: row[f"eval/{show}"]} if evaluated and show else {}))
    return finish_run(group, spec, output, summary, row, progress, metrics, checkpoints)

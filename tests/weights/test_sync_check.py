"""The bare mode of scripts/gpu_check.sh as far as a CPU takes it: scripts/sync_check.py moves
AutoTP slices between plain processes into receivers laid out as vLLM's tensor-parallel workers
(fused q/k/v and gate/up), over gloo point to point, through the senders' shared buffers (the
ipc protocol, on /dev/shm) and into the receivers' shared-memory arenas, checked bit-exact by
the receivers against slices cut here from the full tensors; and the sent ones (point to point,
ipc) as a delta sync."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_together

ROOT = Path(__file__).resolve().parents[2]
SIZE = ["--hidden", "64", "--layers", "2", "--vocab", "256", "--heads", "4", "--kv-heads", "2"]


def _runs(*layouts: list[str]) -> list[list[dict]]:
    """The script's JSON rows for each set of arguments; the runs go side by side (each mostly
    waits on its own processes, one core at a time)."""
    done = run_together(*([sys.executable, "scripts/sync_check.py", "--device", "cpu", *SIZE, *args]
                          for args in layouts), timeout=300)
    for out in done:
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return [[json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")] for out in done]


@pytest.mark.slow
def test_two_senders_into_one_and_two_receivers_and_one_sender_into_two():
    sys.path.insert(0, str(ROOT / "scripts"))
    from sync_check import model_shapes

    # embedding 256x64, per layer q 64x64, k and v 32x64, o 64x64, gate/up 256x64, down 64x256,
    # two norms of 64; the final norm; the head 256x64: all fp32
    full = 4 * (2 * 256 * 64 + 2 * (64 * 64 * 2 + 2 * 32 * 64 + 3 * 256 * 64 + 2 * 64) + 64)
    assert full == 4 * sum(torch_numel(s) for s in model_shapes(64, 2, 256, 4, 2).values())
    rows, one_to_two_rows, delta_rows = _runs(["--senders", "2", "--receivers", "1,2"],
                                              ["--senders", "1", "--receivers", "2", "--transports", "p2p"],
                                              ["--senders", "2", "--receivers", "2", "--delta"])
    assert [(r["transport"], r["receivers"]) for r in rows[1:]] == [
        ("p2p", 1), ("p2p", 2), ("ipc", 1), ("ipc", 2), ("arena", 1), ("arena", 2)]
    for r in rows[1:]:
        assert r["bit_exact"], r
        # every byte of the model reaches the receivers once, but the five norms (whole in every
        # worker, like vLLM's) once per worker
        whole = 4 * 5 * 64
        assert sum(r["bytes_by_sender"]) == full + (r["receivers"] - 1) * whole, r
        assert max(r["bytes_by_sender"]) < 0.6 * sum(r["bytes_by_sender"]), r  # no sender sends it all
    [one_to_two] = one_to_two_rows[1:]
    assert one_to_two["bit_exact"] and one_to_two["bytes_by_sender"] == [full + 4 * 5 * 64]
    # rollout.delta_sync: a second sync after every 97th element moved sends its change alone
    # (an index and a value, 8 bytes, for ~1/97 of the elements, and 8 bytes of count a piece)
    assert [r["transport"] for r in delta_rows[1:]] == ["p2p", "ipc"]
    for r in delta_rows[1:]:
        assert r["bit_exact"] and sum(r["bytes_by_sender"]) < full / 20, r


def torch_numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

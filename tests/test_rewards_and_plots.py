"""Reward sources and `elasticrl plot`, without Ray: a real local HTTP server, real PNGs."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from elasticrl.rewards.functions import exact_answer, load_function
from elasticrl.rewards.remote import RemoteReward
from elasticrl.trainers.plot import plot_run, series
from tests.conftest import run_cli


def _serve(replies: list[tuple[int, bytes]]):
    """A server answering POSTs with the given (status, body) in turn, recording requests."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = replies[min(len(seen), len(replies)) - 1]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/r", seen


def test_remote_reward_retries_server_errors_then_returns_the_rewards():
    server, url, seen = _serve([(500, b"busy"), (503, b"busy"), (200, b'{"rewards": [1, 0.5]}')])
    try:
        out = RemoteReward(url, timeout_s=5, retries=2, backoff_s=0.01)(["1+1="], ["2", "3"], ["2", "2"])
    finally:
        server.shutdown()
    assert out == [1.0, 0.5]
    assert len(seen) == 3 and seen[0] == {"prompts": ["1+1="], "completions": ["2", "3"], "answers": ["2", "2"]}


@pytest.mark.parametrize("reply, message", [
    ((404, b"no"), "answered HTTP 404"),                          # a client error is not retried
    ((200, b"<html>"), "the reply is not JSON"),
    ((200, b'{"rewards": [1]}'), r"expected \{\"rewards\": \[2 numbers\]\}"),
    ((200, b'{"rewards": [true, 1]}'), "expected"),
])
def test_remote_reward_rejects_bad_replies_naming_the_endpoint(reply, message):
    server, url, seen = _serve([reply])
    try:
        with pytest.raises(RuntimeError, match=message) as err:
            RemoteReward(url, timeout_s=5, retries=3, backoff_s=0.01)(["p", "q"], ["a", "b"], [None, None])
    finally:
        server.shutdown()
    assert url in str(err.value) and len(seen) == 1


def test_remote_reward_gives_up_after_its_retries():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match=r"failed 3 times"):
        RemoteReward(f"http://127.0.0.1:{port}/", timeout_s=1, retries=2, backoff_s=0.01)(["p"], ["c"], [None])
    with pytest.raises(ValueError, match="rewards.remote.url"):
        RemoteReward("ftp://example/")


def test_reward_functions_load_by_import_path():
    fn = load_function("elasticrl.rewards.functions:exact_answer")
    assert fn is exact_answer
    assert exact_answer("17+5=", "22", "22") == 1.0 and exact_answer("17+5=", "23", "22") == 0.0
    assert exact_answer("p", "22", None) == 0.0
    with pytest.raises(ValueError, match=r"rewards.functions\[0\].path: .* write package.module:function"):
        load_function("elasticrl.rewards.functions.exact_answer", "rewards.functions[0].path")
    with pytest.raises(ValueError, match="cannot import"):
        load_function("elasticrl.rewards.functions:nope")


def test_plot_writes_one_png_per_metric_group(tmp_path):
    rows = [{"step": s, "loss": 1.0 / (s + 1), "eval/accuracy": s / 10, "sync/transport": "shm",
             "sync/seconds": 0.1, "nan_metric": float("nan")} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = series(rows)
    assert "sync/transport" not in data and "nan_metric" not in data
    assert data["eval/accuracy"] == ([0, 1, 2, 3, 4], [0.0, 0.1, 0.2, 0.3, 0.4])
    files = plot_run(tmp_path)
    assert sorted(f.name for f in files) == ["eval.png", "sync.png", "train.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)
    assert not [p for p in (tmp_path / "plots").iterdir() if p.name.startswith(".")]


def test_plot_cli_errors_name_the_folder(tmp_path):
    proc = run_cli("plot", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and f"{tmp_path}/metrics.jsonl: no metrics here" in proc.stderr
    assert "Traceback" not in proc.stderr

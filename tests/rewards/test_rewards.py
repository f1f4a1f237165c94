"""Reward sources without Ray: functions by import path, a real local HTTP server, the sum."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from elasticrl.rewards.functions import exact_answer, load_function
from elasticrl.rewards.remote import RemoteReward


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


def test_reward_sources_sum_functions_endpoints_and_models_with_their_weights():
    from elasticrl.rewards.sources import RewardSources
    from elasticrl.spec import load_spec

    server, url, seen = _serve([(200, json.dumps({"rewards": [0.5, -1.0]}).encode())])
    try:
        spec = load_spec({"algorithm": "grpo", "rewards": {
            "functions": [{"path": "elasticrl.rewards.functions:exact_answer", "weight": 2.0}],
            "remote": [{"url": url, "weight": 0.5}]}})
        total = RewardSources(spec)(["1+1=", "2+2="], ["2", "5"], ["2", "4"],
                                    models=[(lambda: torch.tensor([0.25, 1.0]), 4.0)])
    finally:
        server.shutdown()
    # 2 x exact (1, 0) + 0.5 x remote (0.5, -1) + 4 x model (0.25, 1) = (2 + .25 + 1, 0 - .5 + 4)
    assert total.tolist() == [3.25, 3.5]
    assert seen == [{"prompts": ["1+1=", "2+2="], "completions": ["2", "5"], "answers": ["2", "4"]}]

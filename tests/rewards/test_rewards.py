"""Reward sources without Ray: functions by import path, a real local HTTP server, the sum."""
from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from elasticrl.rewards.functions import load_function
from elasticrl.rewards.remote import RemoteReward
from elasticrl.rewards.verifiers import integer


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
    fn = load_function("elasticrl.rewards.verifiers:integer")
    assert fn is integer
    assert integer("17+5=", "22", "22") == 1.0 and integer("17+5=", "23", "22") == 0.0
    assert integer("p", "22", None) == 0.0
    with pytest.raises(ValueError, match=r"rewards.functions\[0\].path: .* write package.module:function"):
        load_function("elasticrl.rewards.verifiers.integer", "rewards.functions[0].path")
    with pytest.raises(ValueError, match="cannot import"):
        load_function("elasticrl.rewards.verifiers:nope")


def test_reward_sources_sum_functions_endpoints_and_models_with_their_weights():
    from elasticrl.rewards.sources import RewardSources
    from elasticrl.spec import load_spec

    server, url, seen = _serve([(200, json.dumps({"rewards": [0.5, -1.0]}).encode())])
    try:
        spec = load_spec({"algorithm": "grpo", "rewards": {
            "functions": [{"path": "verifier", "weight": 2.0}],
            "remote": [{"url": url, "weight": 0.5}]}})
        with RewardSources(spec) as rewards:
            scores = rewards(["1+1=", "2+2="], ["2", "5"], ["2", "4"],
                             models=[(lambda: torch.tensor([0.25, 1.0]), 4.0)])
    finally:
        server.shutdown()
    # 2 x exact (1, 0) + 0.5 x remote (0.5, -1) + 4 x model (0.25, 1) = (2 + .25 + 1, 0 - .5 + 4)
    assert scores.total.tolist() == [3.25, 3.5] and scores.keep.all()
    assert scores.info == {"reward/errors": 0, "reward/errors/verifier": 0, "reward/errors/remote0": 0,
                           "reward/errors/model0": 0}
    assert seen == [{"prompts": ["1+1=", "2+2="], "completions": ["2", "5"], "answers": ["2", "4"]}]
    assert scores.verified == [1.0, 0.0]  # the verifier was the reward function: its scores, not a second call


MOODY = "tests.rewards.misbehaving:moody"


def _sources(**rewards):
    from elasticrl.rewards.sources import RewardSources
    from elasticrl.spec import load_spec

    return RewardSources(load_spec({"algorithm": "grpo", "rewards": {"functions": [{"path": MOODY}], **rewards}}))


def test_a_reward_function_that_raises_hangs_crashes_or_gives_no_number_costs_that_call_only():
    """Each misbehaviour is that sample's error (named, counted, scored 0 under 'zero'); the
    calls after it are served, the hang is cut at rewards.timeout_s and the crash costs one call."""
    import time

    prompts = ["ok", "raise", "none", "text", "nan", "sleep", "ok", "crash", "ok"]
    with _sources(timeout_s=1.0, max_consecutive_errors=0) as rewards:
        first = rewards.process.procs[0].proc.pid
        t0 = time.time()
        scores = rewards(prompts, ["abc"] * 9, [None] * 9)
        took = time.time() - t0
        again = rewards(["ok"], ["abcd"], [None])  # after the crash: a new process serves
    assert scores.total.tolist() == [3.0, 0, 0, 0, 0, 0, 3.0, 0, 3.0] and again.total.tolist() == [4.0]
    assert scores.info == {"reward/errors": 6, "reward/errors/moody": 6} and scores.keep.all()
    assert 1.0 <= took < 20.0, took  # the 60 s sleep was cut at 1 s (plus a restart or two, slower beside
    # the other pytest worker)
    assert all(p.proc is None for p in rewards.process.procs) and first  # closed on leaving the block


def test_a_batch_is_scored_by_the_workers_side_by_side_and_the_verifier_by_them_too():
    from elasticrl.rewards.sources import RewardSources
    from elasticrl.spec import load_spec

    spec = load_spec({"algorithm": "grpo", "data": {"train": "tests/rewards/misbehaving.py"},  # 'auto' is then math
                      "rewards": {"functions": [{"path": "tests.rewards.misbehaving:pid"}], "workers": 3}})
    assert spec.rewards.verifier == "math"
    with RewardSources(spec) as rewards:
        pids = {p.proc.pid for p in rewards.process.procs}
        # each leads a session of its own: a terminal's Ctrl-C (SIGINT to the run's process group)
        # does not reach it, the run closes it (no KeyboardInterrupt trace from it on the console)
        assert all(os.getsid(pid) == pid for pid in pids)
        completions = ["so \\boxed{1/2}", "0.5", "$\\frac{2}{4}$", "1/3", "no", "12"]
        scores = rewards(["p"] * 6, completions, ["0.5"] * 5 + [None])
    # rows 0-1, 2-3 and 4-5 went to the three processes, in order; the verifier (math) judged the same rows
    got = [int(v) for v in scores.total.tolist()]
    assert len(pids) == 3 and set(got) == pids and got[0::2] == got[1::2]
    assert scores.verified == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("prompt, cause", [
    ("raise", "ZeroDivisionError: division by zero"),
    ("none", "returned NoneType 'None', not a number"),
    ("text", "returned str 'high', not a number"),
    ("nan", "returned nan"),
    ("sleep", "timed out after 2 s (rewards.timeout_s)"),
    ("crash", "the reward process died (exit 3)"),
])
def test_on_error_fail_names_the_function_the_sample_and_the_cause(prompt, cause):
    from elasticrl.rewards.sources import RewardError

    with _sources(on_error="fail", timeout_s=2.0) as rewards:
        with pytest.raises(RewardError) as err:
            rewards(["ok", prompt], ["a", "b"], [None, None], where="step 3")
    assert str(err.value) == (f"reward function {MOODY} failed on sample 1 of step 3 (prompt {prompt!r}): {cause} "
                              "(rewards.on_error is fail; 'zero' or 'drop_sample' would count it and go on)")


def test_errors_in_a_row_end_the_run_but_scattered_ones_do_not():
    from elasticrl.rewards.sources import RewardError

    with _sources(max_consecutive_errors=3) as rewards:
        scattered = rewards(["raise", "raise", "ok"] * 4, ["a"] * 12, [None] * 12)  # 1 in 3 succeeds
        assert scattered.info["reward/errors"] == 8
        with pytest.raises(RewardError, match=r"failed on sample 2 .*ZeroDivisionError.*; 3 errors in a row "
                                              r"\(rewards.max_consecutive_errors: 3\): fix it, or raise the limit"):
            rewards(["raise"] * 4, ["a"] * 4, [None] * 4)


def test_drop_sample_leaves_the_sample_out_and_other_sources_too():
    with _sources(on_error="drop_sample", remote=[]) as rewards:
        scores = rewards(["ok", "nan", "ok"], ["ab", "ab", "abc"], [None] * 3)
    assert scores.keep.tolist() == [True, False, True] and scores.total.tolist() == [2.0, 0.0, 3.0]
    assert scores.info["reward/dropped"] == 1


def test_an_endpoint_that_is_down_and_a_failing_reward_model_are_errors_of_their_call():
    from elasticrl.rewards.sources import RewardError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"

    def model_down():
        raise RuntimeError("reward_model rank 0 died (ActorDiedError)")

    with _sources(remote=[{"url": url, "timeout_s": 0.5, "retries": 0}], max_consecutive_errors=3) as rewards:
        inf = (lambda: torch.tensor([1.0, float("inf")]), 1.0)
        scores = rewards(["ok", "ok"], ["a", "bb"], [None, None], models=[(model_down, 1.0), inf])
        # the function's values stand; the endpoint and the first model lost the batch, the second one sample
        assert scores.total.tolist() == [2.0, 2.0]
        assert scores.info == {"reward/errors": 5, "reward/errors/moody": 0, "reward/errors/remote0": 2,
                               "reward/errors/model0": 2, "reward/errors/model1": 1}
        # a failed request is an error for each of its samples: 2, then the third in a row ends the run
        with pytest.raises(RewardError, match=rf"reward endpoint {url} failed on the batch of step 2: RuntimeError: "
                                              r"reward endpoint .* failed 1 times: .*; 3 errors in a row"):
            rewards(["ok"], ["a"], [None], where="step 2")
    # down for the whole run, at the default limit (8): the first batch of 8 samples ends it
    with _sources(remote=[{"url": url, "timeout_s": 0.5, "retries": 0}]) as rewards:
        with pytest.raises(RewardError, match=r"failed on the batch of step 1: .*; 8 errors in a row"):
            rewards(["ok"] * 8, ["a"] * 8, [None] * 8, where="step 1")


def test_a_reward_module_that_raises_while_importing_is_named_with_its_own_error():
    from elasticrl.rewards.sources import RewardSources
    from elasticrl.spec import load_spec

    spec = load_spec({"algorithm": "grpo", "rewards": {"functions": [{"path": "tests.rewards.broken:score"}]}})
    with pytest.raises(ValueError) as err:
        with RewardSources(spec):
            pass
    assert str(err.value) == ("rewards.functions[0].path: cannot import 'tests.rewards.broken:score': importing "
                              "tests.rewards.broken raised TypeError: string indices must be integers, not 'str'")


def test_a_reward_function_that_does_not_import_fails_at_start_naming_it():
    from elasticrl.rewards.sources import RewardSources
    from elasticrl.spec import load_spec

    spec = load_spec({"algorithm": "grpo", "rewards": {"functions": [{"path": "no_such_module:score"}]}})
    with pytest.raises(ValueError, match=r"^rewards.functions\[0\].path: cannot import 'no_such_module:score'"):
        with RewardSources(spec):
            pass

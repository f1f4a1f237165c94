"""Environments and tools in their own processes (no Ray): the Hermes parser, schemas from
signatures, each way a tool can fail becoming an error observation, a lost process, and the
observation tokens an episode appends as the chat template renders them."""
from __future__ import annotations

import os
import signal
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from elasticrl.envs import parse_hermes, tool_schemas
from elasticrl.envs.pool import EnvironmentPool
from elasticrl.rollout.episodes import Episode, observation_ids
from elasticrl.world.tokenizer import build_tokenizer
from tests.conftest import JsonHandler
from tests.integration.environments import add

TOOLS = [f"tests.integration.environments:{name}" for name in ("add", "boom", "hang", "weird")]


def test_hermes_tool_calls_are_parsed_and_a_malformed_one_raises():
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    assert parse_hermes(text) == [{"name": "add", "arguments": {"a": 1, "b": 2}},
                                  {"name": "add", "arguments": {"a": 3, "b": 4}}]
    assert parse_hermes("The answer is 3.") == []
    with pytest.raises(ValueError, match="not JSON"):
        parse_hermes('<tool_call>{"name": add}</tool_call>')
    with pytest.raises(ValueError, match="without a name"):
        parse_hermes('<tool_call>{"arguments": {}}</tool_call>')


def test_a_tools_schema_comes_from_its_signature_and_docstring():
    assert tool_schemas([add]) == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first"},
                                                        "b": {"type": "integer", "description": "the second"}},
                       "required": ["a", "b"]}, "return": {"type": "integer"}}}]


def _call(name: str, args: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def test_every_tool_failure_is_an_error_observation_and_a_lost_process_ends_its_episodes_only():
    # a tool's 2 s: the quick tools' calls stay well within it beside the other pytest worker
    envs = EnvironmentPool({"environment": "elasticrl.envs:ToolEnvironment", "tools": TOOLS, "parser": "hermes",
                            "timeout_s": 2, "retries": 0}, timeout_s=10, workers=2)
    try:
        envs.start()
        rows = [{"prompt": f"{k}+1="} for k in range(6)]
        starts = envs.ask([{"op": "start", "id": k, "row": r} for k, r in enumerate(rows)])
        assert starts[0]["messages"] == [{"role": "user", "content": "0+1="}]
        assert [t["function"]["name"] for t in starts[0]["tools"]] == ["add", "boom", "hang", "weird"]
        texts = [_call("add", '{"a": 1, "b": 2}'), _call("boom"), _call("hang"), _call("weird"), _call("nope"),
                 '<tool_call>{"name": </tool_call>']
        got = envs.ask([{"op": "step", "id": k, "text": t} for k, t in enumerate(texts)])
        assert [g["messages"][0]["content"] for g in got] == [
            "3", "error: boom raised RuntimeError: the tool broke", "error: hang timed out after 2 s",
            "error: weird returned object, which is not JSON",
            "error: no tool named 'nope' (tools: add, boom, hang, weird)",
            "error: a tool call that is not JSON (Expecting value)"]
        assert [g["tool_errors"] for g in got] == [0, 1, 1, 1, 1, 1] and all(g["tool_calls"] == 1 for g in got)
        assert not any(g["done"] for g in got)
        # the processes went on: a turn without a call is the answer, which ends the episode
        assert envs.ask([{"op": "step", "id": 2, "text": "3"}])[0] == {
            "messages": [], "reward": None, "done": True, "tool_calls": 0, "tool_errors": 0, "retries": 0}
        # a process killed by its PID: the episodes that lived in it end with why; the other's go on
        lost = envs.procs[1]
        pid = lost.proc.pid
        os.kill(pid, signal.SIGKILL)
        got = envs.ask([{"op": "step", "id": k, "text": "4"} for k in (1, 3, 0)])
        assert got[0] == "the environment process died (signal 9)" and got[1] == "its environment process was lost"
        assert got[2]["done"] is True
        fresh = envs.ask([{"op": "start", "id": 7, "row": rows[0]}])[0]  # a new process takes new episodes
        assert fresh["messages"] and lost.proc.pid != pid
    finally:
        envs.close()


def test_an_environment_that_does_not_import_fails_at_start_in_one_line():
    envs = EnvironmentPool({"environment": "no_such_module:Env", "tools": [], "parser": "hermes", "timeout_s": 1,
                            "retries": 0}, timeout_s=5, workers=1)
    with pytest.raises(ValueError, match=r"^rollout.environment: cannot import 'no_such_module:Env'"):
        envs.start()
    envs.close()


@pytest.mark.parametrize("closing, tail", [("", ""), ("\n", "\n")])
def test_observation_tokens_are_what_the_template_adds_after_the_models_own_tokens(closing, tail):
    """The tiny world's template ends an assistant turn with eos, which the model generated; a
    template that adds a newline after it (as ChatML's does) puts that newline in the
    observation's tokens, since the model did not generate it."""
    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
        + closing + "{% else %}<|user|>{{ m['content'] }}" + closing + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    e = Episode({}, 0, messages=[{"role": "user", "content": "5+7="}], text="12")
    generated = tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = observation_ids(tok, e, generated, [{"role": "tool", "content": "= 3"}])
    assert ids == tok(tail + "<|user|>= 3" + closing + "<|assistant|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == tail + "<|user|>= 3" + closing + "<|assistant|>"


class _Remote(JsonHandler):
    """An environment over HTTP: /start opens an episode; /step answers 503 at its first call
    and hangs past the client's timeout at its second, then ends the episode with a reward of 1;
    /down always answers 503."""

    steps: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.body()
        if self.path.endswith("/start"):
            self.reply({"episode": body["row"]["prompt"],
                        "messages": [{"role": "user", "content": body["row"]["prompt"]}]})
            return
        self.steps.append(body)
        if len(self.steps) == 1 or "/down/" in self.path:
            self.send_error(503)
            return
        if len(self.steps) == 2:
            time.sleep(3.0)
        self.reply({"messages": [], "reward": 1.0, "done": True})


def test_a_remote_environment_retries_a_503_and_a_timeout_and_one_that_stays_down_ends_its_episode_only():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Remote)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    pools = [EnvironmentPool({"environment": u, "tools": [], "parser": "hermes", "timeout_s": 1.0, "retries": r},
                             timeout_s=10, workers=1) for u, r in ((f"{url}/env", 3), (f"{url}/down/env", 1))]
    try:
        for envs in pools:
            envs.start()
        up, down = pools
        assert up.ask([{"op": "start", "id": 0, "row": {"prompt": "6*7="}}])[0]["messages"] == \
            [{"role": "user", "content": "6*7="}]
        got = up.ask([{"op": "step", "id": 0, "text": "42"}])[0]
        assert got == {"messages": [], "reward": 1.0, "done": True, "tool_calls": 0, "tool_errors": 0, "retries": 2}
        assert [s["episode"] for s in _Remote.steps] == ["6*7="] * 3 and _Remote.steps[0]["text"] == "42"
        down.ask([{"op": "start", "id": 0, "row": {"prompt": "1*1="}}])
        failed = down.ask([{"op": "step", "id": 0, "text": "1"}])[0]
        assert failed.startswith(f"RuntimeError: environment {url}/down/env failed 2 times: HTTP Error 503"), failed
        assert up.ask([{"op": "start", "id": 1, "row": {"prompt": "2*3="}}])[0]["messages"]  # the pool goes on
    finally:
        for envs in pools:
            envs.close()
        server.shutdown()

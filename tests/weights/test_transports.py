"""The transports as modules: each one's sender and receiver side by side, found by name, so that a
new transport is one new module (here one written at test time, on the package's path) that the
spec accepts, ``auto`` leaves alone, and a real engine routes its receiver's calls to. The
receivers run in a real transformers engine (``rollout.backend: hf``, in this process), whose
parameters they must change exactly."""
from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from elasticrl.weights import transports
from elasticrl.weights.transports import Payload, ReceiverBase, Transport, shm_staged


def test_every_module_is_a_named_sender_and_receiver():
    assert transports.names() == ("broadcast", "files", "ipc", "shm", "shm_staged")
    for name in transports.names():
        module = transports.module(name)
        assert issubclass(module.Sender, Transport) and module.Sender.name == name, name
        assert issubclass(module.Receiver, ReceiverBase), name
    # the sliced ones write each rank's AutoTP pieces; the others take whole tensors from rank 0
    assert [n for n in transports.names() if transports.module(n).Sender.sliced] == ["broadcast", "ipc", "shm"]
    assert transports.choose("auto", True, False) == "shm" and transports.choose("auto", True, True) == "ipc"
    assert transports.choose("auto", False, False) == "broadcast" == transports.choose("broadcast", True, True)
    with pytest.raises(ValueError, match="on GPUs use ipc"):
        transports.choose("shm", True, True)
    assert transports.unknown("auto") is None and transports.unknown("files") is None
    assert transports.unknown("fils") == ("rollout.weight_sync: unknown transport 'fils' (did you mean 'files'?); "
                                          "choose auto or one of broadcast, files, ipc, shm, shm_staged")
    assert Payload().message() == {"kind": "full", "adapter": None}
    assert Payload("adapter", adapter={"r": 8}).message() == {"kind": "adapter", "adapter": {"r": 8}}


LOOPBACK = '''
"""A transport for the test: each tensor's values in a message (lists of floats)."""
import ray
import torch

from elasticrl.weights.transports import ReceiverBase, Transport


class Sender(Transport):
    name = "loopback"

    def send_gathered(self, params, size, payload):
        tensors = {name: t.float().tolist() for name, t in params}
        ray.get(self.call_all("load", tensors, payload.message()))


class Receiver(ReceiverBase):
    def load(self, tensors, message):
        return self.worker.erl_land([(n, torch.tensor(v)) for n, v in tensors.items()], message)
'''


@pytest.fixture(scope="module")
def engine():
    from elasticrl.rollout.hf_engine import HFRolloutEngine
    from elasticrl.spec import load_spec
    from elasticrl.world.build import world_paths
    from tests.conftest import EXAMPLES

    model = world_paths(load_spec(str(EXAMPLES / "tiny_grpo.yaml")).world)["model"]
    e = HFRolloutEngine(str(model), 1, "fp32", 0, 128, "auto", "keep", 0.9, 1.0, False)
    yield e
    e.shutdown()


def test_a_new_module_is_a_new_transport_that_a_real_engine_receives_through(tmp_path, engine, monkeypatch):
    (tmp_path / "loopback.py").write_text(textwrap.dedent(LOOPBACK))
    monkeypatch.setattr(transports, "__path__", [*transports.__path__, str(tmp_path)])
    transports.module.cache_clear()
    try:
        assert "loopback" in transports.names() and transports.unknown("loopback") is None
        assert transports.choose("loopback", True, False) == "loopback"  # asked for by name
        assert transports.choose("auto", True, False) == "shm"  # never picked for a user
        receiver = transports.module("loopback").Receiver
        name, param = next(iter(engine.params.items()))
        new = torch.full_like(param, 0.25)
        got = engine.weights("loopback", "load", {name: new.tolist()}, Payload().message())
        assert got == [new.numel() * 4] and torch.equal(param.data, new)
        assert isinstance(engine._erl_receivers["loopback"], receiver)
    finally:
        transports.module.cache_clear()
        sys.modules.pop("elasticrl.weights.transports.loopback", None)
        engine.__dict__.get("_erl_receivers", {}).pop("loopback", None)


def test_the_staged_buffers_land_every_tensor_exactly_and_refuse_an_adapter(engine):
    before = {n: p.detach().clone() for n, p in engine.params.items()}
    moved = [(n, t + 0.5) for n, t in before.items()]
    size = max(t.numel() * 4 for _, t in moved) + 64  # a tensor a bucket at the least: several buckets
    paths = [shm_staged.shm.create(size, "test") for _ in range(2)]
    try:
        loaded = 0
        for k, (metas, _) in enumerate(shm_staged.fill_buckets(moved, [b for _, b in paths], size)):
            # each bucket read before its buffer is refilled, as the sender waits on its loads
            loaded += engine.weights("shm_staged", "load", paths[k % 2][0], size, metas, Payload().message())[0]
        assert loaded == sum(t.numel() * 4 for _, t in moved)
        assert all(torch.equal(engine.params[n].data, t) for n, t in moved)
        with pytest.raises(ValueError, match="merged weights, not adapters"):
            engine.weights("shm_staged", "load", paths[0][0], size, metas, Payload("adapter", {"r": 8}).message())
    finally:
        for path, _ in paths:
            shm_staged.shm.release(path)
        for n, t in before.items():
            engine.params[n].data.copy_(t)


def test_the_sender_half_needs_only_what_its_layout_uses():
    """A gathered-only transport need not write slices: the base refuses sliced sends by name."""
    with pytest.raises(NotImplementedError, match="files: no sliced sends"):
        transports.module("files").Sender(None).send_sliced([], [], Payload())

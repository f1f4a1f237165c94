"""One private Ray per pytest worker for the integration tests (starting one costs ~5-8 s on 2
cores; in a temp folder of its own, so nothing else attaches to it): the tests of this package
share it, each shutting down the role groups and pools it started, and it stops when they are
done."""
from __future__ import annotations

import pytest

from elasticrl.cluster.session import ray_session
from elasticrl.spec.schema import RaySpec


@pytest.fixture(scope="package")
def ray_cluster():
    # Logical CPUs for placement; tests oversubscribe the 2 real cores on purpose.
    with ray_session(RaySpec(num_cpus=8)):
        yield


# PPO with all four model roles, at a constant learning rate (so its first steps are those of any
# longer run of it: the Slurm job of test_launch.py runs 16 steps and is compared with it), on one
# actor rank (and so one reference rank): what these runs show is the roles, not the rank count
PPO_ROLES = ["rl.num_steps=3", "checkpoint.every_steps=2", "checkpoint.resume=auto", "train.threads=2",
             "train.warmup_ratio=0", "train.min_lr_ratio=1", "train.num_ranks=1"]


@pytest.fixture(scope="package")
def ppo_in_pairs(ray_cluster, tmp_path_factory):
    """tiny_ppo.yaml's 3 steps with its four model roles colocated in pairs (actor and
    reference, critic and reward model), a frozen model's rank (the reference's or the reward
    model's) SIGKILLed as step 3 begins: test_resume.py's straight run, and the run that the
    Slurm job's steps must repeat. Returns the spec, its output, summary, the fault, and the
    trained and engine processes seen once step 1 and once step 3 were logged."""
    import threading
    import time
    from types import SimpleNamespace

    from elasticrl.spec import load_spec
    from elasticrl.trainers import run_job
    from tests.conftest import EXAMPLES
    from tests.integration.faults import Fault, actor_pids, logged_step
    from tests.integration.test_rl import BASE, PPO

    spec = load_spec(EXAMPLES / "tiny_ppo.yaml",
                     BASE + PPO + PPO_ROLES + ["placement.colocate=actor_ref+critic_reward"])
    out = tmp_path_factory.mktemp("ppo") / "straight"
    kill = Fault(out, "FrozenWorker", after=2)
    kill.start()
    seen: list[dict] = []

    def watch():
        for step in (1, 3):
            while logged_step(out) < step:
                time.sleep(0.02)
            seen.append({c: actor_pids(c) for c in ("ActorWorker", "CriticWorker", "RolloutEngine")})
    threading.Thread(target=watch, daemon=True).start()
    summary = run_job(spec, out)
    return SimpleNamespace(spec=spec, out=out, summary=summary, kill=kill, seen=seen)

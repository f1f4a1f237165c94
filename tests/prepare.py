"""Builds, before the tests, the starting points they share (``make test`` runs it): the
tiny worlds, the warm starts and the reward model that the integration tests would otherwise
train inside the first test to ask for each, in the cache every test reads
(``.venv/elasticrl-test-cache``). Each is built once per settings; a later run finds them and
returns in seconds. ``python -m tests.prepare``."""
from __future__ import annotations

import sys
import time

from tests.conftest import EXAMPLES, LEARNING  # sets the tests' cache folder first


def main() -> None:
    from elasticrl.cluster.session import ray_session
    from elasticrl.spec import load_spec
    from elasticrl.spec.schema import RaySpec
    from elasticrl.trainers.warm_start import initial_model, trained_reward_model
    from elasticrl.world.wordmath import wordmath_dir
    from tests.integration.test_preference import BASE as PREFERENCE_BASE
    from tests.integration.test_preference import PREFERENCE, ROUNDS
    from tests.integration.test_rl import BASE, PPO

    t0 = time.time()
    wordmath_dir()
    with ray_session(RaySpec(num_cpus=8)):
        # the RL, launch and fault tests' (default world, fp32) and PPO's reward model on it
        trained_reward_model(load_spec(EXAMPLES / "tiny_ppo.yaml", BASE + PPO))
        # the single-digit world's: the preference, rounds and learning tests' (auto may differ from fp32)
        for example, sets in (("tiny_dpo.yaml", PREFERENCE_BASE + PREFERENCE + LEARNING),
                              ("tiny_rejection_sampling.yaml", ROUNDS)):
            initial_model(load_spec(EXAMPLES / example, sets))
    print(f"[tests.prepare] the tests' worlds and warm starts are ready ({time.time() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

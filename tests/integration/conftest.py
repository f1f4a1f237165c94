"""One private Ray for the integration tests of a module (starting one costs ~5 s)."""
from __future__ import annotations

import pytest

from elasticrl.cluster.session import ray_session
from elasticrl.spec.schema import RaySpec


@pytest.fixture(scope="module")
def ray_cluster():
    # Logical CPUs for placement; tests oversubscribe the 2 real cores on purpose.
    with ray_session(RaySpec(num_cpus=8)):
        yield

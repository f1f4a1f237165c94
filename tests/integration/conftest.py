"""One private Ray for the integration tests (starting one costs ~5-8 s on 2 cores): the tests
of this package share it, each shutting down the role groups and pools it started, and it
stops when they are done (a Ray left running would make later tests take it for a launched
job's)."""
from __future__ import annotations

import pytest

from elasticrl.cluster.session import ray_session
from elasticrl.spec.schema import RaySpec


@pytest.fixture(scope="package")
def ray_cluster():
    # Logical CPUs for placement; tests oversubscribe the 2 real cores on purpose.
    with ray_session(RaySpec(num_cpus=8)):
        yield

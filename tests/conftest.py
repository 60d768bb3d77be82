"""Test configuration: 8 simulated CPU devices, shared meshes."""

import os

# The LLVM code generator at -O0: the tests read what XLA's HLO passes and buffer assignment
# make (memory, collectives, cost analysis), which the code generator's level does not change,
# and compare steps compiled alike. It cut tests/kiwi_jax/test_export.py and test_choose.py
# from 197 s to 138 s on 2 cores (their applied steps have 5-6x the plain step's fusions).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()

# One core a solve: the suite runs two workers on two cores (scripts/test.sh), so a worker's solve
# that took a second core for a second program would slow the other; the tests of that path set
# it themselves.
os.environ.setdefault("KIWI_JAX_SOLVER_CORES", "1")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="session")
def mesh24():
    """A (2, 4) mesh of 8 simulated CPU devices with axes ("data", "model")."""
    return _mesh((2, 4))


@pytest.fixture(scope="session")
def mesh_factory():
    """Builds a 2-D mesh of the simulated devices for a given shape."""
    return _mesh

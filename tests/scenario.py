"""Tests of how kiwi-jax handles a situation the compiler creates: a plan XLA compiles over its
budget, a search that settles where it does. Each was measured on the jax of the lock's Python
3.11 pins, the suite's reference; another XLA may not create it (on jax 0.12.0.1 the zoo Llama's
plan at 57% on one device fits value by value). There the test is skipped with what did not
arise; on the reference jax it fails."""

import jax
import pytest

REFERENCE_JAX = "0.10.2"
"""The jax the scenarios were measured on (requirements.lock, Python 3.11)."""


def arises(condition: bool, scenario: str) -> None:
    """Go on when the ``scenario`` the test needs arose; else fail on the reference jax and
    skip, saying so, on any other."""
    if condition:
        return
    if jax.__version__ == REFERENCE_JAX:
        pytest.fail(f"the scenario did not arise on jax {REFERENCE_JAX}: {scenario}")
    pytest.skip(f"jax {jax.__version__} does not create the scenario (measured on jax "
                f"{REFERENCE_JAX}): {scenario}")

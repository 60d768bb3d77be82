"""Lynx's overlap applied in JAX: recomputations a plan hides under a collective are placed
beside it, and the compiled schedule shows them there."""

import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import kiwi_jax
from kiwi_jax.apply import _anchors
from kiwi_jax.interpret import is_unit, unit_of
from kiwi_jax.models import build
from kiwi_jax.verify import max_rel_diff, overlap_placements

# two plans solved and compiled for the module (the setup of its first test, 51-61 s)
pytestmark = pytest.mark.scenario

CONFIG = {"layers": 3, "hidden": 128, "heads": 4, "seq": 32, "batch": 8, "vocab": 64}


def _step(overlap: bool):
    ref = build("gpt", **CONFIG)
    mesh = jax.make_mesh((1, 4), ("data", "model"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # at 95% the fastest plans include one that recomputes nothing; at 85% each recomputes
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh, memory_budget="85%",
                             cluster="a100-pcie@10x", solver="lynx-heu", cache_dir=False,
                             overlap=overlap, fit_compiles=1,   # placements, not the budget search
                             recipes=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # the fit loop may warn on this tiny model
        return ref, step, step.lower(*ref.abstract_init(), ref.abstract_batch())


@pytest.fixture(scope="module")
def overlapped():
    return _step(True)


@pytest.fixture(scope="module")
def on_demand():
    """The same plan's step with its recomputations where their readers need them."""
    return _step(False)


def test_hidden_recomputations_are_scheduled_before_their_collective(overlapped):
    _ref, _step_, prepared = overlapped
    assert prepared.plan.hidden_under, "the plan hides nothing: pick a tighter budget"
    placed = overlap_placements(prepared)
    assert placed, "no recomputation of the overlap scope in the compiled schedule"
    for p in placed:
        assert p.collective is not None and p.collective_index > p.index
        # XLA may schedule planned reshardings between them: measured, the embedding
        # gradient's operand all-to-all before the combined gradient all-reduce (for both
        # recomputations since they run behind one barrier per reader), and for one the
        # all-gather the plan makes of the recomputed mask broadcast
        assert p.between <= 2, f"{p.name}: {p.between} collectives before its own"


def test_a_hidden_value_made_inside_an_inlined_call_is_placed_as_its_call(overlapped):
    """The causal mask's select is made inside ``jnp.where``'s inlined call (path ``49_5``);
    the interpreter reruns the call, so it is placed as the call. Taken by its own path, it
    was never placed beside its collective."""
    _ref, _step_, prepared = overlapped
    traced, hidden = prepared.traced, prepared.plan.hidden_under
    paths = traced.node_paths()
    inlined = {paths[n][0] for n in hidden if n in paths and not is_unit(paths[n][0])}
    assert inlined, "no hidden value inside an inlined call: the model or the plan changed"
    units = {unit_of(path) for path in inlined}
    assert units <= set(_anchors(traced, hidden, units))


def test_without_overlap_nothing_is_placed_beside_a_collective(on_demand):
    _ref, _step_, prepared = on_demand
    assert prepared.plan.hidden_under and not overlap_placements(prepared)


def test_overlap_changes_where_values_are_recomputed_not_what_the_step_computes(overlapped,
                                                                              on_demand):
    ref, step, _prepared = overlapped
    runs = []
    for candidate in (step, on_demand[1], nnx.jit(ref.train_step)):
        model, optimizer = ref.init(0)
        losses = [float(candidate(model, optimizer, ref.batch(seed))) for seed in range(2)]
        runs.append((losses, nnx.state(model)))
    (overlap_losses, overlap_state), (demand_losses, demand_state), (plain_losses, plain_state) \
        = runs
    # the same values, recomputed elsewhere: XLA fuses the recomputations into different
    # kernels, which round differently (5.8e-7 after two steps; bit for bit while each
    # recomputation had a barrier of its own)
    np.testing.assert_allclose(overlap_losses, demand_losses, rtol=1e-6)
    assert max_rel_diff(overlap_state, demand_state) < 1e-5
    np.testing.assert_allclose(overlap_losses, plain_losses, rtol=1e-5)
    # The plan's sharding reorders reductions; after two Adam steps the parameters differ from
    # the plain step's by 2.7e-5 (norm-relative), with or without overlap.
    assert max_rel_diff(overlap_state, plain_state) < 1e-4

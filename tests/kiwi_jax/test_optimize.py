"""The decorator: plan, apply, compile, run; the compiled step checked against the plan and the
plain step."""

import io
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kiwi_jax
import solvers
from experiments import zoo
from experiments.zoo import moe as zoo_moe
from hlo_tools.liveness import fused_values
from kiwi_jax.apply import carried_pairs, in_program_order
from kiwi_jax.fit import FIT_COMPILES, FitStop
from kiwi_jax.models import build
from kiwi_jax.optimize import NotATrainStepError, OptimizedStep
from kiwi_jax.problem import build_problem
from kiwi_jax.plan import Plan
from hlo_tools.compiled import LiveBuffer, device_memory
from hlo_tools.graph import Phase
from kiwi_jax.estimate import compiled_cost
from kiwi_jax.frontend import trace
from kiwi_jax.interpret import program_order, tag_of
from kiwi_jax.verify import TOLERANCE, _memory_disagreements
from solvers.simulator import live_bytes, simulate
from tests.scenario import arises

SMALL = {
    "gpt": dict(layers=1, hidden=32, heads=2, seq=16, batch=8, vocab=64),
    "mlp": dict(layers=3, width=64, in_dim=32, out_dim=32, batch=16),
    "linen_mlp": dict(),
}
# A limit the solves end well inside (the GPT's take ~35 s alone): a solve cut short by a busy
# machine ends at another plan, and the tests would depend on the machine's load.
FAST = dict(cluster="v100-nvlink", time_limit=120.0, mip_gap=1e-2, cache_dir=False,
            fit_compiles=1, recipes=False)
# One compile: the plan solved under the budget runs as compiled. The tests of what the budget
# search does (a compiled step that fits, a budget only the model rules out) ask for it. No
# recipes: these tests are of kiwi's plan (the choice is tests/kiwi_jax/test_choose.py's).
SEARCH = dict(fit_compiles=FIT_COMPILES)


def _step(name, mesh, budget="90%", **options) -> tuple[OptimizedStep, tuple]:
    ref = build(name, **SMALL[name])
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh, memory_budget=budget,
                             **{**FAST, **options})
    return step, (*ref.init(0), ref.batch(0))


# Not the encoder: it is the GPT's layer without the causal mask, and the GPT covers the
# meshes (its 1x8 and 4x2 cases took 55 s of the suite, its 2x4 case 59-83 s, so they are
# scenarios; the MLP's cases are the suite's numerics on every mesh); its problem is
# checked in test_strategies.py, and the zoo study (a benchmark) plans and runs an
# encoder-decoder on every mesh.
@pytest.mark.parametrize("name,shape", [
    pytest.param(name, shape, id=f"{name}-{shape[0]}x{shape[1]}",
                 marks=[pytest.mark.scenario] if name == "gpt" else [])
    for name in SMALL for shape in [(1, 8), (2, 4), (4, 2)]])
def test_optimized_step_matches_plain_step(name, shape, mesh_factory):
    # The budget search runs on the MLP on 2x4; elsewhere the solved plan runs as compiled: its
    # numerics and collectives are what is tested there. On the 1-layer GPT and encoder the
    # search takes 4 compiles and solves (224 s and 180 s here), on the Linen MLP 4 compiles
    # and 5 solves (52 s): their fit is measured by experiments.zoo_study and
    # experiments.remat_baselines.
    search = shape == (2, 4) and name == "mlp"
    step, args = _step(name, mesh_factory(shape), **(SEARCH if search else {}))
    report = step.verify(*args, steps=3)
    assert report.steps == 3
    assert report.max_loss_rel_diff <= 1e-5
    assert report.max_param_rel_diff <= 1e-5
    if search:
        assert report.fits, report.table()     # the compiled step fits the budget it was given
    if name != "linen_mlp" or shape == (4, 2):
        # Predicted vs compiled collective bytes, within 1.4% on the GPT and encoder, 4.3% on
        # the MLP. The Linen MLP (10-13 KB of collectives in all) is partitioned by XLA with
        # all-reduces and all-gathers where the plan all-to-alls: -20% on 1x8, and -38% on 2x4
        # for the plan the budget search kept there; listed in docs/apply.md.
        assert abs(report.collective_error) <= TOLERANCE, report.table()


class _RoutedRegressor(nnx.Module):
    """The zoo's top-2 mixture-of-experts layer under a linear head, without attention."""

    def __init__(self, rngs):
        self.moe = zoo_moe.MoE(16, 16, 4, rngs=rngs)
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        y, aux = self.moe(x)
        return self.head(y), aux


def _routed_step(model, optimizer, x, y):
    def loss_fn(model):
        prediction, aux = model(x)
        return jnp.mean((prediction - y) ** 2) + 0.01 * aux

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _top_two_moe():
    model = _RoutedRegressor(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x, y = jax.random.normal(jax.random.key(1), (8, 4, 16)), jnp.ones((8, 4, 8))
    return _routed_step, (model, optimizer, x, y)


def _classifier_with_accuracy():
    model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def train_step(model, optimizer, x, labels):
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}

    x = jax.random.normal(jax.random.key(2), (16, 16))
    return train_step, (model, optimizer, x, jax.random.randint(jax.random.key(3), (16,), 0, 8))


# Small steps whose every parameter has a gradient: a parameter whose gradient is exactly zero
# (an attention layer's key bias, the MLP-Mixer's token-mixing output bias before a LayerNorm)
# gets rounding noise that Adam scales up to a visible update, so two shardings of the same
# step differ there by the leaf's norm.
@pytest.mark.parametrize("make,opcode", [
    pytest.param(_classifier_with_accuracy, "reduce", id="argmax-accuracy"),
    pytest.param(_top_two_moe, "topk", id="top2-moe"),
])
def test_argmax_accuracy_and_top_k_routing_match_the_plain_step(make, opcode, mesh24):
    """Multi-result operators in user steps: argmax's variadic reduce and top-2 routing."""
    train_step, args = make()
    step = kiwi_jax.optimize(train_step, mesh=mesh24, memory_budget="100%", cache_dir=False,
                             time_limit=60, fit_compiles=1,       # numerics, not the search
                             recipes=False)
    report = step.verify(*args, steps=3)
    assert report.steps == 3
    assert report.max_loss_rel_diff <= 1e-5
    assert report.max_param_rel_diff <= 1e-5
    assert any(n.opcode == opcode and "#" in n.name for n in step.prepared.traced.graph.nodes)


class _DropoutBlock(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm(x)))))


def test_a_step_with_dropout_plans_and_draws_the_plain_steps_bits(mesh24):
    """``nnx.Dropout`` draws from the ``nnx.Rngs`` the model carries (a PRNG key array in the
    step's state): the graph sees one operator per draw, the key arrays' shardings cover
    their own dimensions only, and the sharding annotation JAX puts on each key array has the
    strategies of its operand (no operator is left without a rule). The plan trains as the
    plain step does, with the same masks."""
    rngs = nnx.Rngs(0, dropout=1)
    model = nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), _DropoutBlock(16, rngs=rngs),
                           _DropoutBlock(16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def train_step(model, optimizer, x, labels):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    args = (model, optimizer, jax.random.normal(jax.random.key(2), (16, 8)),
            jax.random.randint(jax.random.key(3), (16,), 0, 4))
    step = kiwi_jax.optimize(train_step, mesh=mesh24, memory_budget="100%", cache_dir=False,
                             time_limit=60, fit_compiles=1, recipes=False)
    report = step.verify(*args, steps=3)
    assert report.numerics.ok, report.numerics.summary()
    assert report.max_loss_rel_diff <= 1e-5 and report.max_param_rel_diff <= 1e-5
    # three draws per dropout (the split of its key, fold-in's, the mask's), each one operator
    # of two results
    assert sum(n.is_random_bits for n in step.prepared.traced.graph.nodes) >= 4
    assert any(n.is_sharding_annotation for n in step.prepared.traced.graph.nodes)
    assert not step.prepared.build.unsupported
    applied = jax.tree.leaves(step.prepared.applied.in_shardings)   # the keys' specs too
    assert list(step.export().specs.values()) == [s.spec for s in applied]


class _BatchNormCNN(nnx.Module):
    def __init__(self, *, rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = x + nnx.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(axis=(1, 2)))


def test_a_step_that_returns_nothing_and_updates_metrics_in_place(mesh24):
    """The NNX tutorials' step: it returns nothing, the optimizer and an ``nnx.MultiMetric``
    are updated in place, BatchNorm's statistics too (an output of no arrays came before the
    state, and the state's leaves were looked up one place off)."""
    model = _BatchNormCNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                                 optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))

    def train_step(model, optimizer, metrics, batch):
        def loss_fn(model):
            logits = model(batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        metrics.update(loss=loss)
        optimizer.update(model, grads)

    batch = {"image": jax.random.normal(jax.random.key(1), (8, 8, 8, 3)),
             "label": jnp.arange(8) % 10}
    step = kiwi_jax.optimize(train_step, mesh=mesh24, memory_budget="100%", cache_dir=False,
                             time_limit=60, fit_compiles=1, recipes=False)
    report = step.verify(model, optimizer, metrics, batch, steps=3)
    assert report.fits and report.numerics.ok, report.numerics.summary()
    assert step.prepared.traced.state_out == 1


def test_one_device_plans_recomputation_alone(mesh_factory):
    step, args = _step("gpt", mesh_factory((1, 1)), budget="2MiB", **SEARCH)
    report = step.verify(*args, steps=2)
    assert step.plan.mesh_shape == (1, 1) and step.plan.status == "optimal" and report.fits
    assert report.max_loss_rel_diff <= 1e-5 and report.max_param_rel_diff <= 1e-5
    assert report.compiled_collective_bytes == report.predicted_collective_bytes == 0


@pytest.mark.scenario
def test_a_budget_under_the_plain_step_is_searched_against_the_compiler(caplog, mesh_factory):
    # one device, per-operator model: it over-predicts this step (the plain step compiles to
    # 29.2 MB). Before the program counted chains at the stages their keep flags give, its
    # smallest predicted peak was 27.0 MB and 25 MB a budget only the model ruled out; now it
    # plans there, and the search of the solver's budget makes the compiled step use it
    mesh = mesh_factory((1, 1))
    ref = build("gpt", layers=2, hidden=64, heads=4, seq=128, batch=8, vocab=128)
    budget = 25_000_000
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh, memory_budget=budget,
                             memory_model="operator", **{**FAST, **SEARCH})
    with caplog.at_level("INFO"):
        prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    plan, fit = prepared.plan, prepared.plan.fit
    assert plan.budget_bytes == fit.budget_bytes == budget
    assert fit.fits and fit.solver_budget_bytes == (plan.solver_budget_bytes or budget)
    assert fit.compiled_peak_bytes == device_memory(prepared.compiled).peak_bytes <= budget
    assert 1 <= fit.compiles <= 6 and fit.solves <= 8
    assert caplog.text.count("fit: solver budget") == len(fit.trials)     # one line per trial
    # it uses 97% of the budget, or no plan is faster with more memory: the search stopped at
    # a plan the model prices as fast as the fastest with no limit, and what runs is the
    # fastest of the plans that fit by the compiled estimate (on the code of 2026-11-30 the
    # first trial, 0.861 of the budget, whose prediction is 5% slower than the last's)
    assert fit.ratio >= 0.97 or fit.stop == FitStop.FASTEST, fit.describe()
    if fit.ratio < 0.97:
        fastest = solvers.reference_plan(prepared.build.problem, time_limit=60.0)
        assert fit.trials[-1].predicted_step_seconds <= fastest.objective * (1 + FAST["mip_gap"])
        fitting = [t.compiled_step_seconds for t in fit.trials
                   if t.compiled and t.compiled_peak_bytes <= budget]
        assert fit.trials[fit.chosen].compiled_step_seconds == min(fitting)


@pytest.mark.scenario
def test_a_budget_under_the_models_smallest_peak_runs_what_compiles_smallest(mesh_factory):
    # The step of the test above, under the model's smallest peak. Its error's bounds are of
    # kiwi's own program (the exact form of the chains' lifetimes, which the solve falls back
    # to): none above a budget it plans under (25 MB, above). The search starts from the
    # smallest-peak plan the error names (one compile), and of it and the whole-block
    # recomputation, the one with the faster compiled estimate runs where both fit; here the
    # smallest-peak plan compiles over (19,104,092 B), and the whole-block one (17,335,788 B)
    # runs. 18 MB, 5% under the bound: the exact form proves it infeasible in 0.2 s, where at
    # 19 MB (0.2% under) that took 20 s. (A test of its own, so the two workers of the suite
    # share the two searches.)
    mesh = mesh_factory((1, 1))
    ref = build("gpt", layers=2, hidden=64, heads=4, seq=128, batch=8, vocab=128)
    quick = {**FAST, "time_limit": 40.0}
    under = kiwi_jax.optimize(ref.train_step, mesh=mesh, memory_budget=18_000_000,
                              memory_model="operator", **quick)
    ran = under.lower(*ref.abstract_init(), ref.abstract_batch())
    # the error's search, kept: its bound was 19,035,410 B alone on one core (18 s of the exact
    # form, at the time limit); beside the other test worker once 18,969,874 B, and under more
    # load 17,668,435 B (a bound proven in the time limit: weaker the less time the solver
    # gets; the decorator's own solve proved 18 MB infeasible)
    lower, fitting = solvers.min_feasible_budget(ran.build.problem, time_limit=40.0)
    assert lower <= 25_000_000 and 18_000_000 < fitting and lower <= fitting
    assert ran.plan.fit.fits and device_memory(ran.compiled).peak_bytes <= 18_000_000
    assert ran.plan.fit.stop == FitStop.BLOCKS and ran.plan.fit.trials[0].compiled_peak_bytes \
        > 18_000_000
    tight = kiwi_jax.optimize(ref.train_step, mesh=mesh, memory_budget=1_000_000,
                              memory_model="operator", **{**quick, "time_limit": 20.0})
    with pytest.raises(solvers.InfeasibleBudgetError) as error:     # names what the plan needs
        tight.lower(*ref.abstract_init(), ref.abstract_batch())
    # the smallest step compiled (the model's smallest-peak plan, or whole-block
    # recomputation), not the model's floor
    assert 1_000_000 < error.value.min_feasible_bytes <= ran.plan.fit.compiled_peak_bytes


def test_memory_at_both_peaks_is_attributed_to_operators(mesh24):
    step, args = _step("mlp", mesh24)
    step.lower(*args)
    report = step.verify(explain_memory=True)
    # the heap's own peak: all but its packing (the combined all-reduce's elements included)
    assert 0.95 * report.compiled_peak_bytes <= report.compiled_live_bytes \
        <= report.compiled_peak_bytes
    for row in report.memory_disagreements:
        difference = abs(row["predicted_bytes"] - row["compiled_bytes"])
        assert difference > 0.01 * report.predicted_peak_bytes
        assert difference > TOLERANCE * max(row["predicted_bytes"], row["compiled_bytes"])
    # Given the plan's own live set as XLA's, nothing disagrees; one buffer more shows up alone.
    prepared = step.prepared
    plan, problem, graph = prepared.plan, prepared.build.problem, prepared.traced.graph
    peak = solvers.simulate(problem, plan.strategy, recompute_at=plan.recompute_at).peak_time
    alive = live_bytes(problem, plan.strategy, peak, plan.recompute_at)
    mirror = [LiveBuffer(node.name, int(b), node.op_name, node.phase == Phase.PARAM)
              for node, b in zip(graph.nodes, alive) if b]
    assert _memory_disagreements(prepared, mirror) == ()
    dot = next(n for n in graph.nodes if n.opcode == "dot" and tag_of(n.op_name))
    extra = LiveBuffer("fusion.1", plan.predicted_peak_bytes // 10, dot.op_name, False)
    rows = _memory_disagreements(prepared, mirror + [extra])
    assert [r["operator"].split()[0] for r in rows] == [f"k{tag_of(dot.op_name)}"]
    if abs(report.memory_error) <= TOLERANCE:                # explained only when asked
        assert step.verify().compiled_live_bytes is None


def test_report_sets_the_predicted_step_beside_the_compiled_estimate(mesh24):
    step, args = _step("mlp", mesh24)
    step.lower(*args)
    report = step.verify()
    prepared = step.prepared
    plan = prepared.plan
    assert report.predicted_step_seconds == plan.predicted_step_seconds
    # without recomputation the compute part is the operators' compute, once each
    compute, _, _ = prepared.build.problem.costs_of(plan.strategy)
    if not plan.recomputed:
        assert report.predicted_compute_seconds == pytest.approx(compute.sum())
    assert 0 < report.predicted_compute_seconds < report.predicted_step_seconds
    assert report.compiled_cost == compiled_cost(prepared.compiled, mesh24, "v100-nvlink")
    assert report.estimated_step_seconds == report.compiled_cost.step_seconds > 0
    assert report.step_error == pytest.approx(
        plan.predicted_step_seconds / report.estimated_step_seconds - 1)
    row = report.to_dict()
    assert row["estimated_step_seconds"] == report.estimated_step_seconds
    assert row["compiled_cost"] == report.compiled_cost.to_dict()
    json.dumps(row)                                        # the CLI prints it as JSON
    table = report.table()
    assert f"{plan.predicted_step_seconds * 1e3:11.4f} ms" in table
    assert f"{report.estimated_step_seconds * 1e3:11.4f} ms" in table
    assert f"({report.step_error:+.1%}" in table
    # the compute by operation loses nothing on either side: its sums are the two computes
    rows = report.compute_rows
    assert len({r["operation"] for r in rows}) == len(rows) and row["compute_rows"] == list(rows)
    assert sum(r["predicted_seconds"] for r in rows) == pytest.approx(
        report.predicted_compute_seconds)
    assert sum(r["compiled_seconds"] for r in rows) == pytest.approx(
        report.compiled_cost.compute_seconds)
    assert sum(r["kernels"] for r in rows) == report.compiled_cost.kernels
    assert {"dot_general", "dot_general (backward)"} <= {r["operation"] for r in rows
                                                         if r["operators"] and r["kernels"]}
    gaps = [abs(r["predicted_seconds"] - r["compiled_seconds"]) for r in rows]
    assert gaps == sorted(gaps, reverse=True)
    off = abs(report.compiled_cost.compute_seconds / report.predicted_compute_seconds - 1)
    assert ("compute by the operation it comes from" in table) == (off > TOLERANCE)


def test_nnx_step_updates_in_place_and_compiles_once_per_shape(mesh24):
    ref = build("mlp", **SMALL["mlp"])
    model, optimizer = ref.init(0)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, memory_budget="95%", **FAST)
    before = np.asarray(model.linears[0].kernel[...]).copy()
    loss1 = step(model, optimizer, ref.batch(0))
    prepared = step.prepared
    loss2 = step(model, optimizer, ref.batch(1))
    assert step.prepared is prepared                      # same shapes: no new plan
    assert not np.allclose(before, np.asarray(model.linears[0].kernel[...]))
    assert np.isfinite(float(loss1)) and np.isfinite(float(loss2))
    placed = model.linears[0].kernel.get_value().sharding  # the state is on the plan's mesh
    assert isinstance(placed, jax.sharding.NamedSharding) and placed.mesh == mesh24
    wider = build("mlp", **{**SMALL["mlp"], "batch": 32})
    step(model, optimizer, wider.batch(0))
    assert step.prepared is not prepared                  # a new batch shape plans again


def test_linen_step_returns_state_and_metrics(mesh_factory):
    step, (state, batch) = _step("linen_mlp", mesh_factory((1, 8)))
    new_state, metrics = step(state, batch)
    assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_plans_are_cached_and_corrupt_entries_ignored(tmp_path, mesh24):
    options = dict(FAST, cache_dir=tmp_path)
    first, args = _step("mlp", mesh24, **options)
    first.lower(*args)
    assert not first.prepared.cached
    entries = list(tmp_path.glob("plan-*.json"))
    assert len(entries) == 1
    again, _ = _step("mlp", mesh24, **options)
    again.lower(*args)
    assert again.prepared.cached
    assert np.array_equal(again.plan.strategy, first.plan.strategy)
    assert again.plan.fit == first.plan.fit and first.plan.fit.compiles >= 1   # kept on disk
    entries[0].write_text("{not json")
    third, _ = _step("mlp", mesh24, **options)
    with pytest.warns(UserWarning, match="unreadable plan cache entry"):
        third.lower(*args)
    assert not third.prepared.cached
    rewritten = Plan.from_json(entries[0].read_text())
    assert rewritten.fingerprint == third.plan.fingerprint == first.plan.fingerprint


def test_infeasible_budget_names_the_smallest_feasible_one(mesh24):
    step, args = _step("mlp", mesh24, budget=1000)
    with pytest.raises(solvers.InfeasibleBudgetError) as error:
        step.lower(*args)
    assert error.value.min_feasible_bytes > 1000
    assert "smallest feasible budget" in str(error.value)


def test_a_function_without_gradient_is_refused(mesh24):
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def forward(model, x):
        return model(x).sum()

    step = kiwi_jax.optimize(forward, mesh=mesh24, memory_budget="1GiB", **FAST)
    with pytest.raises(NotATrainStepError, match="no gradient"):
        step(model, jnp.ones((8, 8)))


def test_mesh_must_have_two_axes():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with pytest.raises(ValueError, match="2-D"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh, memory_budget="1GiB")


def test_negative_fit_compiles_is_refused(mesh24):
    with pytest.raises(ValueError, match=r"fit_compiles: expected a count of compiles >= 0"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh24, memory_budget="1GiB", fit_compiles=-1)


@pytest.mark.parametrize("fit_seconds", [-1.0, "60"])
def test_a_fit_deadline_that_is_not_seconds_is_refused(mesh24, fit_seconds):
    with pytest.raises(ValueError, match=r"fit_seconds: expected seconds >= 0 or None"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh24, memory_budget="1GiB",
                          fit_seconds=fit_seconds)


def test_unknown_memory_model_is_named(mesh24):
    with pytest.raises(ValueError, match=r"unknown memory_model 'xla'.*'auto', 'operator'"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh24, memory_budget="1GiB", memory_model="xla")


def test_unknown_order_is_named(mesh24):
    with pytest.raises(ValueError, match=r"unknown order 'xla'.*'program', 'printed'"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh24, memory_budget="1GiB", order="xla")


def test_a_mesh_plans_in_the_programs_order_and_fused_bytes_charge_what_xla_stores(mesh24):
    # order="program" numbers a mesh's graph in the traced program's order (the printed
    # order is the mesh's default), and the fused model charges what the compiled reference
    # stores for a budget in bytes as it does for a percentage.
    step, args = _step("gpt", mesh24, budget="64MiB", memory_model="fused", order="program")
    prepared = step.lower(*args)
    graph, build_ = prepared.traced.graph, prepared.build
    keys = [k for k in map(program_order, (n.op_name for n in graph.nodes)) if k is not None]
    assert keys == sorted(keys)
    by_rules = build_problem(graph, build_.mesh, build_.cluster, memory_model="fused",
                             carried=carried_pairs(prepared.traced), donated=True)
    assert build_.memory_model == "fused"
    assert any(not np.array_equal(charged, rules) for charged, rules
               in zip(build_.problem.memory, by_rules.problem.memory))
    printed = trace(step.train_step, *args, traced_order=in_program_order(8)).graph
    keys = [k for k in map(program_order, (n.op_name for n in printed.nodes)) if k is not None]
    assert keys != sorted(keys)


@pytest.mark.scenario
def test_auto_on_a_mesh_charges_memory_as_the_model_closer_to_the_compiled_reference(
        tmp_path, mesh24):
    # The GPT at sequence 64 and hidden 32: the attention's elementwise chains, which XLA
    # fuses and the operator model charges value by value, decide its peak. With a budget in
    # bytes the reference plan is compiled and each model predicts it; the closer one plans
    # (the fused one here: +71.3% against +10.3% on the code of 2026-12-02). A plan from the
    # cache is applied on a problem of the model it was solved with.
    ref = build("gpt", layers=1, hidden=32, heads=2, seq=64, batch=8, vocab=64)
    args = (*ref.abstract_init(), ref.abstract_batch())
    options = {**FAST, "memory_budget": "1GiB", "cache_dir": tmp_path}
    prepared = kiwi_jax.optimize(ref.train_step, mesh=mesh24, **options).lower(*args)
    plan, build_ = prepared.plan, prepared.build
    assert plan.recomputed == () and build_.memory_model == plan.memory_model == "fused"
    compiled = prepared.applied.memory.peak_bytes
    operator = build_problem(prepared.traced.graph, build_.mesh, build_.cluster,
                             memory_model="operator", carried=carried_pairs(prepared.traced))
    by_operator = simulate(operator.problem, plan.strategy, plan.keep).peak_bytes
    assert abs(plan.predicted_peak_bytes / compiled - 1) < abs(by_operator / compiled - 1) - 0.3
    again = kiwi_jax.optimize(ref.train_step, mesh=mesh24, **options).lower(*args)
    assert again.cached and again.build.memory_model == again.plan.memory_model == "fused"
    assert again.applied.memory.peak_bytes == compiled
    one = kiwi_jax.optimize(ref.train_step, mesh=mesh24, **{**options, "memory_model": "operator",
                                                           "cache_dir": False}).lower(*args)
    assert one.build.memory_model == one.plan.memory_model == "operator"


@pytest.mark.parametrize("budget", ["100%", "2GiB"])
def test_the_reference_plan_runs_value_by_value_where_that_fits(budget, mesh24):
    # Resharding the weights again and tying the gradients in (the program a step over its
    # budget runs), the small GPT's reference plan compiled to 167,484 B on 2x4, against
    # 217,052 B value by value. Compiled against its own prediction, it ran so under a 2 GiB
    # budget, with more collectives, and "100%" was of that compile.
    step, args = _step("gpt", mesh24, budget=budget, memory_model="fused", order="program")
    prepared = step.lower(*args)
    assert prepared.plan.recomputed == ()
    assert prepared.applied.program == "values"
    if budget == "100%":
        assert prepared.plan.budget_bytes == prepared.applied.memory.peak_bytes


def test_keyword_arguments_are_refused(mesh24):
    step, _ = _step("mlp", mesh24)
    with pytest.raises(TypeError, match="positionally"):
        step(batch=None)


def test_indivisible_dimensions_exclude_strategies_not_crash(mesh24):
    ref = build("mlp", layers=2, width=24, in_dim=12, out_dim=12, batch=6)  # 6, 12, 24 vs 2x4
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, memory_budget="100%", **FAST)
    report = step.verify(*ref.init(0), ref.batch(0), steps=2)
    assert report.max_param_rel_diff <= 1e-5


@pytest.mark.scenario
def test_explain_prints_layers_and_writes_png(tmp_path, mesh_factory):
    step, args = _step("gpt", mesh_factory((1, 8)), budget="85%")     # 1x8 solves fastest
    step.lower(*args)
    png = tmp_path / "timeline.png"
    with open(tmp_path / "out.txt", "w") as sink:
        text = step.explain(png=png, file=sink)
    assert "== layer 0" in text and "outside layers" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recomputed = sum(line.endswith("recompute") for line in text.splitlines())
    assert recomputed == len(step.plan.recomputed) > 0      # 85% needs recomputation


def test_explain_before_any_call_says_what_to_do(mesh24):
    step, _ = _step("mlp", mesh24)
    with pytest.raises(RuntimeError, match="call it"):
        step.explain()


def test_custom_optax_chain_in_a_user_step(mesh_factory):
    """A step written by a user (not a registry model): SGD with momentum and clipping."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(16, 32, rngs=rngs)
            self.b = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    model = Net(nnx.Rngs(1))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    step = kiwi_jax.optimize(train_step, mesh=mesh_factory((2, 4)), memory_budget="100%", **FAST)
    x, y = jnp.ones((16, 16)), jnp.zeros((16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = step.verify(model, optimizer, x, y, steps=3)
    assert report.max_param_rel_diff <= 1e-5 and report.max_loss_rel_diff <= 1e-5


@pytest.mark.scenario
def test_a_chain_recomputed_inside_a_layer_matches_the_plain_step(mesh_factory):
    """Full recomputation keeps only what crosses a layer boundary: dropped values are
    recomputed from other dropped values of their layer, as jax.checkpoint around a block
    does, and the step computes what the plain step computes (on 1x8: 45 s on 2x4 in the
    suite)."""
    step, args = _step("gpt", mesh_factory((1, 8)), budget="100%", solver="alpa+full")
    report = step.verify(*args, steps=2)
    problem, plan = step.prepared.build.problem, step.plan
    operands = problem.operands()
    chained = [(i, j) for j in plan.recomputed for i in operands[j] if i in plan.recomputed]
    assert chained and all(problem.chained(i, j) for i, j in chained)
    assert report.max_loss_rel_diff <= 1e-5 and report.max_param_rel_diff <= 1e-5


def test_a_model_with_its_own_checkpoint_is_planned_and_keeps_it(mesh_factory):
    """A block under jax.checkpoint in the model (the reference GPT's remat option) is planned
    around: the interpreter keeps the model's recomputation behind its barrier, and the step
    computes what the plain step computes."""
    ref = build("gpt", **SMALL["gpt"], remat="nothing_saveable")
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh_factory((1, 8)), memory_budget="100%",
                             **FAST)
    report = step.verify(*ref.init(0), ref.batch(0), steps=2)
    assert report.max_loss_rel_diff <= 1e-5 and report.max_param_rel_diff <= 1e-5
    # the plan recomputes nothing itself, so the barriers are the model's checkpoint's
    assert not step.plan.recomputed
    assert "opt-barrier" in step.prepared.applied.compiled.as_text()


@pytest.mark.scenario
def test_on_one_device_the_values_the_compiled_reference_stores_are_charged(mesh_factory):
    # The fusion rules fuse values XLA stores (the ViT's residual adds, which a norm's
    # reduction reads, and the norms' broadcasts), some equations hold more than their value
    # (a norm's rsqrt(var) * scale keeps both operands broadcast into the backward pass) or
    # need room while they run (the attention's transposed copies): the problem solved for a
    # percentage is rebuilt from the reference plan compiled for it, and predicts that plan
    # within 10% (at the zoo's size; in a smaller ViT the parameters and optimizer state make
    # the peak).
    train_step, args = zoo.make("vit")
    step = kiwi_jax.optimize(train_step, mesh=mesh_factory((1, 1)), memory_budget="90%",
                             **FAST)
    prepared = step.lower(*args)
    graph, build = prepared.traced.graph, prepared.build
    problem = build.problem
    rules = fused_values(graph)
    assert build.memory_model == "fused" and not (build.fused & ~rules).any()
    assert (rules & ~build.fused).sum() >= 10
    sizes = np.array([n.nbytes for n in graph.nodes])
    charged = np.array([m[0] for m in problem.memory])
    assert (charged > sizes).sum() >= 6                       # the norms, at least
    assert problem.gathered_of(np.zeros(problem.num_nodes, int)).sum() > 0   # no resharding
    reference = solvers.reference_plan(problem).peak_bytes
    by_rules = solvers.reference_plan(
        build_problem(graph, build.mesh, build.cluster).problem).peak_bytes
    compiled = int(prepared.plan.budget_bytes / 0.9)
    assert by_rules < reference and abs(reference / compiled - 1) <= 0.10
    # at 100% the reference plan runs, predicted on the rebuilt problem too
    held = kiwi_jax.optimize(train_step, mesh=mesh_factory((1, 1)), memory_budget="100%",
                             **FAST).lower(*args).plan
    assert held.recomputed == () and held.predicted_peak_bytes == reference


def test_donated_state_is_written_over_its_arguments(mesh_factory):
    # XLA writes the new parameters and Adam moments into the donated state's buffers: counted
    # beside the old ones, they made the one-device reference MLP's predicted peak 1.35x what
    # it compiles to. Not donated, each is a buffer of its own.
    ref = build("mlp", layers=2, width=128, in_dim=64, out_dim=64, batch=32)
    args = (*ref.init(0), ref.batch(0))
    steps = {donate: kiwi_jax.optimize(ref.train_step, mesh=mesh_factory((1, 1)),
                                       memory_budget="100%", donate=donate, **FAST).lower(*args)
             for donate in (True, False)}
    for donate, prepared in steps.items():
        problem, traced = prepared.build.problem, prepared.traced
        values = [v for v, _ in carried_pairs(traced)]
        assert values and prepared.build.donated == donate
        assert all((problem.memory[v] == 0).all() == donate for v in values)
        compiled = device_memory(prepared.compiled).peak_bytes
        assert abs(prepared.plan.predicted_peak_bytes / compiled - 1) <= 0.10, donate


def test_a_percentage_is_of_the_reference_plans_compiled_memory(mesh_factory):
    # On one device the model misses what XLA holds for the ViT (layout copies of the kernels,
    # the LayerNorms' broadcasts): a percentage of the reference plan's predicted peak was a
    # budget the reference plan itself compiled 1.23x over. "100%" is what it compiles to.
    train_step, args = zoo.make("vit", depth=1, dim=16, heads=2, mlp_dim=32, batch=4,
                                image_size=16, patch_size=4)
    step = kiwi_jax.optimize(train_step, mesh=mesh_factory((1, 1)), memory_budget="100%",
                             **FAST)
    prepared = step.lower(*args)
    plan, compiled = prepared.plan, device_memory(prepared.compiled).peak_bytes
    predicted = solvers.reference_plan(prepared.build.problem).peak_bytes
    assert plan.budget_bytes > predicted
    # the reference plan fits it, and no plan is faster: it runs
    assert compiled == plan.budget_bytes and plan.fit.fits and plan.recomputed == ()
    text = step.explain(file=io.StringIO())
    assert text.startswith("kiwi's plan is the reference plan (alpa's fastest with no memory "
                           "limit, no recomputation): it compiles within the budget, so 'kiwi' "
                           "solved nothing\nplan: alpa (optimal)")


@pytest.mark.scenario
def test_where_memory_does_not_bind_the_program_with_free_layouts_is_compiled_too(mesh24):
    """The zoo Llama at a budget nothing needs recomputing under: the search stops at the
    reference plan, as fast as the fastest with no memory limit; the plan with no memory limit
    of the program with the layouts left free (:func:`kiwi_jax.problem.with_free_layouts`) is
    compiled after it, and the faster by the compiled estimate runs. Here the free program's
    plan updates Adam's state where it lies and gathers none of it back: 0.067 against
    0.207 ms estimated (measured on the code of 2026-12-04). It trains as the plain step does."""
    sizes = dict(layers=2, dim=16, heads=2, kv_heads=1, batch=8, seq=8, vocab=64)
    train_step, args = zoo.make("llama", abstract=False, **sizes)
    step = kiwi_jax.optimize(train_step, mesh=mesh24, memory_budget="100MiB",
                             **{**FAST, **SEARCH})
    fit = step.lower(*args).plan.fit
    assert "layouts left to the solver" in step.explain()
    searched, free = fit.trials
    assert not searched.layouts and free.layouts and fit.fits
    assert fit.stop == FitStop.LAYOUTS and fit.chosen == 1, fit.describe()
    assert free.compiled_step_seconds < 0.5 * searched.compiled_step_seconds
    report = step.verify(*args, steps=2)
    assert report.fits and report.max_loss_rel_diff <= 1e-5
    assert report.max_param_rel_diff <= 1e-5


@pytest.mark.scenario
def test_where_memory_binds_the_program_with_free_layouts_is_solved_under_the_search_budget(
        mesh24):
    """The MLP on 2x4 at 70%: the search stops at a plan that fits (its solve proven
    optimal); the program with the layouts left free is then solved under that plan's solver
    budget, from it, and compiled. Its plan fits and is estimated slower here (35.9 against
    30.3 us, measured on the code of 2026-12-05), so the search's plan runs: the compiled
    estimate chooses, not the model."""
    step, args = _step("mlp", mesh24, "70%", **SEARCH)
    plan = step.lower(*args).plan
    fit = plan.fit
    assert fit.stop == FitStop.FITS and plan.status == "optimal", fit.describe()
    settled, free = fit.trials[fit.chosen], fit.trials[-1]
    assert not settled.layouts and free.layouts
    assert free.solver_budget_bytes == settled.solver_budget_bytes
    assert free.compiled_peak_bytes <= fit.budget_bytes
    assert free.compiled_step_seconds > settled.compiled_step_seconds


@pytest.mark.scenario
def test_a_free_program_plan_over_the_budget_is_solved_again_under_its_overshoot(mesh24):
    """The zoo mixer at its default sizes on 2x4 at 80%: the free program's plan under the
    search's solver budget is estimated 2.1x faster than the search's and compiles 0.9% over
    the budget; solved again under that solver budget scaled by the overshoot, twice, it fits
    at 0.998 of the budget and runs (0.1663 against 0.3311 ms estimated, measured on the code
    of 2026-12-05). It trains as the plain step does."""
    train_step, args = zoo.make("mixer", abstract=False, seed=0)
    step = kiwi_jax.optimize(train_step, mesh=mesh24, memory_budget="80%", time_limit=60.0,
                             cache_dir=False, recipes=False)     # the decorator's defaults
    fit = step.lower(*args).plan.fit
    arises(fit.stop == FitStop.LAYOUTS, "the free program's plan compiles over the budget: "
           + fit.describe())
    assert fit.fits, fit.describe()
    free = [trial for trial in fit.trials if trial.layouts]
    assert len(free) >= 2 and fit.chosen == len(fit.trials) - 1
    # each over the budget, then solved under less; the last fits and is the fastest compiled
    assert all(trial.compiled_peak_bytes > fit.budget_bytes for trial in free[:-1])
    assert all(a.solver_budget_bytes > b.solver_budget_bytes for a, b in zip(free, free[1:]))
    searched = fit.trials[:-len(free)]
    assert free[-1].compiled_step_seconds < min(
        trial.compiled_step_seconds for trial in searched
        if trial.compiled_step_seconds is not None
        and trial.compiled_peak_bytes <= fit.budget_bytes)
    report = step.verify(*args, steps=3)
    assert report.fits and report.numerics.ok, report.numerics.summary()

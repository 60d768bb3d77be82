"""The zoo of user-style models: each step runs under plain ``jit`` with a finite loss, the
models are what their docstrings say (BatchNorm statistics updated, a tied embedding, scanned
layers), and the quick zoo study's row is consistent with itself."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import zoo, zoo_study

TINY = {
    "llama": {"layers": 1, "dim": 16, "heads": 2, "kv_heads": 1, "batch": 2, "seq": 8,
              "vocab": 32},
    "vit": {"depth": 1, "dim": 16, "heads": 2, "mlp_dim": 16, "batch": 2, "image_size": 16,
            "patch_size": 8},
    "mixer": {"blocks": 1, "hidden_dim": 16, "tokens_mlp_dim": 8, "channels_mlp_dim": 16,
              "batch": 2, "image_size": 16, "patch_size": 8},
    "resnet": {"stage_sizes": (1,), "num_filters": 4, "batch": 4, "image_size": 16},
    "encdec": {"layers": 1, "emb_dim": 16, "heads": 2, "mlp_dim": 16, "batch": 2, "seq": 8,
               "vocab": 32},
    "moe": {"layers": 1, "dim": 16, "heads": 2, "hidden": 16, "experts": 4, "batch": 2,
            "seq": 8, "vocab": 32},
    "llama_scan": {"layers": 2, "dim": 16, "heads": 2, "kv_heads": 1, "batch": 2, "seq": 8,
                   "vocab": 32},
    "linen_scan": {"layers": 2, "dim": 16, "heads": 2, "mlp_dim": 16, "batch": 2, "seq": 8,
                   "vocab": 32},
}


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options that cut the CPU compile of these one-off steps several-fold."""


def _one_step(name, before=lambda args: None):
    """``(before(args), outputs)`` of one concrete step, initialisation included, under plain
    ``jax.jit`` (NNX steps update the model and optimizer they create in place)."""
    def run():
        step, args = zoo.make(name, abstract=False, **TINY[name])
        return before(args), step(*args)

    return jax.jit(run).lower().compile(compiler_options=FAST_COMPILE)()


def _loss(outputs):
    metrics = outputs[1] if isinstance(outputs, tuple) else outputs
    return metrics["loss"] if isinstance(metrics, dict) else metrics


def test_every_model_is_in_the_table():
    assert set(TINY) == set(zoo.MODELS)
    with pytest.raises(ValueError, match="unknown zoo model 'gpt'"):
        zoo.make("gpt")
    with pytest.raises(ValueError, match="the zoo vit takes no size layers; its sizes are "
                                         "depth, dim, heads, mlp_dim"):
        zoo.make("vit", layers=2)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_one_step_under_jit_has_a_finite_loss(name):
    _, outputs = _one_step(name)
    loss = _loss(outputs)
    assert loss.shape == () and bool(jnp.isfinite(loss)), (name, loss)


def test_resnet_updates_its_batch_statistics():
    stats, (new_state, _) = _one_step("resnet", lambda args: args[0].batch_stats)
    before, after = jax.tree.leaves(stats), jax.tree.leaves(new_state.batch_stats)
    assert len(before) == len(after) > 0
    assert all(not np.allclose(a, b) for a, b in zip(before, after))
    assert int(new_state.step) == 1


def test_encdec_reads_and_writes_tokens_through_one_embedding():
    sizes = TINY["encdec"]
    _, (state, _) = zoo.make("encdec", **sizes)
    vocab, dim = sizes["vocab"], sizes["emb_dim"]
    leaves = jax.tree_util.tree_leaves_with_path(state.params)
    tables = [jax.tree_util.keystr(path) for path, leaf in leaves if leaf.shape == (vocab, dim)]
    assert tables == ["['shared_embedding']['embedding']"]
    assert not [path for path, leaf in leaves if leaf.shape[-1:] == (vocab,)]   # no output head


def _primitives(jaxpr) -> set:
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found |= _primitives(inner)
    return found


@pytest.mark.parametrize("name", ["llama_scan", "linen_scan", "llama"])
def test_the_scanned_models_scan_their_layers(name):
    step, args = zoo.make(name, **TINY[name])
    if nnx.graph.is_graph_node(args[0]):
        graphdef, state = nnx.split(args[:2])

        def fn(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            return step(model, optimizer, batch)

        args = (state, args[2])
    else:
        fn = step
    found = _primitives(jax.make_jaxpr(fn)(*args).jaxpr)
    assert ("scan" in found) == (name in zoo.SCANNED), sorted(found)
    traced = zoo_study.traced_row(name, TINY[name])
    assert traced["lowers"], traced
    if name in zoo.SCANNED:             # kiwi-jax unrolls the scan: a layer per iteration
        assert traced["layers_found"] == TINY[name]["layers"] == 2


def test_zoo_study_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIWI_RESULTS_DIR", str(tmp_path))
    result = zoo_study.main(["--quick", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["study"] == "zoo_study" and printed["rows"] == result["rows"]
    assert json.loads((tmp_path / "zoo.json").read_text())["rows"] == printed["rows"]
    (traced,), (row,) = result["traced"], result["rows"]
    assert traced["lowers"] and (row["model"], row["mesh"]) == ("llama", "2x4")
    assert row["planned"] and "error" not in row, row
    assert row["layers"] == traced["layers_found"]
    assert row["nodes"] == traced["graph_nodes"] >= row["nodes_after_merge"]
    assert row["strategy_variables"] >= row["nodes"]
    assert row["status"] in ("optimal", "feasible", "timeout_with_incumbent")
    assert row["compiled_over_budget"] == pytest.approx(
        row["compiled_peak_bytes"] / row["budget_bytes"])
    assert row["compiled_over_predicted"] == pytest.approx(
        row["compiled_peak_bytes"] / row["predicted_peak_bytes"])
    assert row["fits"] == (row["compiled_peak_bytes"] <= row["budget_bytes"])
    assert row["predicted_peak_bytes"] <= (row["solver_budget_bytes"] or row["budget_bytes"])
    assert 0 < row["solve_seconds"] <= row["plan_seconds"] < row["wall_seconds"]
    assert 0 < row["compiled_step_seconds"] < 1.0        # the running program's estimate
    assert row["numerics"]["steps"] == 3
    assert row["numerics"]["max_param_rel_diff"] < 1e-4
    assert row["numerics"]["max_loss_rel_diff"] < 1e-4
    assert row["numerics"]["ok"], row["numerics"]       # 1e-6 loss, 1e-5 or 10x noise floor


def test_a_failure_is_a_row_with_its_stage_type_and_first_line(monkeypatch):
    def refuse(*args, **kwargs):
        raise NotImplementedError("no plan for this step\nsecond line")

    monkeypatch.setattr(zoo_study, "trace", refuse)
    monkeypatch.setattr(zoo_study.kiwi_jax, "optimize", refuse)
    traced = zoo_study.traced_row("llama", TINY["llama"])
    row = zoo_study.cell("llama", TINY["llama"], "2x4", "80%", time_limit=1.0)
    assert not traced["lowers"] and not row["planned"]
    error = {"type": "NotImplementedError", "message": "no plan for this step"}
    assert traced["error"] == {"stage": "trace", **error}
    assert row["error"] == {"stage": "plan", **error}


def test_a_cell_plans_in_the_order_it_is_given(monkeypatch):
    given = {}

    def record(*args, **kwargs):
        given.update(kwargs)
        raise NotImplementedError("recorded")

    monkeypatch.setattr(zoo_study.kiwi_jax, "optimize", record)
    row = zoo_study.cell("llama", TINY["llama"], "2x4", "80%", time_limit=1.0, order="program")
    assert given["order"] == "program" and given["recipes"] is False
    assert row["error"]["message"] == "recorded"

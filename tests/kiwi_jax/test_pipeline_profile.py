"""Profiling a reference model for pipeline planning, and the ``pipeline`` and Lynx ``plan``
commands."""

import json

import pytest

from experiments.zoo.llama import make as llama
from kiwi_jax.cli import main
from kiwi_jax.frontend import problem_for_step
from kiwi_jax.pipeline import model_profile, problem_profile
from solvers.pipeline import partition

TINY = {"hidden": 32, "heads": 2, "seq": 16, "vocab": 64}


@pytest.fixture(scope="module")
def profile():
    return model_profile("gpt", layers=6, mesh="1x2", cluster="a100-nvlink", micro_batch=4,
                         **TINY)


def test_a_layer_holds_its_weights_adam_state_and_gradient_accumulator(profile):
    # GPT layer: 4 h^2 + 4 h (attention) + 8 h^2 + 5 h (MLP) + 4 h (two layer norms) floats;
    # Adam keeps two moments, the pipeline one gradient accumulator: 4 copies when the plan
    # replicates them, fewer bytes per device when it shards some.
    h = TINY["hidden"]
    weights = (12 * h * h + 13 * h) * 4
    assert weights * 4 / 2 <= profile.layer.static_bytes <= weights * 4
    assert profile.layers == 6 and profile.micro_batch == 4
    assert profile.layer.forward_seconds > 0 and profile.layer.backward_seconds > 0
    # the embedding holds its two tables (tokens, positions) x 4 copies at most: the other
    # layer's optimizer state is not the embedding's
    embed = (TINY["vocab"] + TINY["seq"]) * h * 4
    assert 0 < profile.embed.static_bytes <= embed * 4 + 64
    assert profile.head.static_bytes > 0
    assert profile.layer_ops.needed.any() and profile.boundary_bytes > 0


def test_cli_pipeline_json(capsys):
    args = ["pipeline", "--model", "gpt", "--layers", "6", "--hidden", "32", "--heads", "2",
            "--seq", "16", "--vocab", "64", "--batch", "4", "--micro-batches", "4",
            "--stages", "3", "--mesh", "1x2", "--budget", "1GiB", "--method", "dawnpiper",
            "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("stage_layers", "stage_step_seconds", "stage_peak_bytes",
                "simulated_throughput", "search_seconds"):
        assert key in result
    assert sum(result["stage_layers"]) == 6 and len(result["stage_layers"]) == 3
    assert result["fits"] and result["simulated_throughput"] > 0


def test_cli_plan_lynx_heu_reports_overlapped_and_on_demand_recomputation(capsys):
    args = ["plan", "--model", "gpt", "--layers", "3", "--hidden", "32", "--heads", "2",
            "--seq", "16", "--batch", "16", "--vocab", "64", "--mesh", "1x2",
            "--cluster", "a100-pcie", "--budget", "95%", "--solver", "lynx-heu", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["solver"] == "lynx-heu" and result["feasible"]
    assert result["predicted_peak_bytes"] <= result["budget_bytes"]
    assert result["hidden_recomputations"] > 0           # 8 of 73 recomputations here
    assert result["overlapped_recompute_seconds"] > 0
    assert result["on_demand_recompute_seconds"] >= 0
    assert result["predicted_step_seconds"] == pytest.approx(result["objective_step_seconds"])


def test_a_user_model_without_scopes_profiles_from_its_found_layers():
    step, args = llama(layers=2)
    built, _ = problem_for_step(step, *args, mesh="1x2", cluster="a100-nvlink")
    profile = problem_profile(built.problem, layers=6, cluster="a100-nvlink", micro_batch=8)
    # a decoder layer: wq, wo (h x h), wk, wv (h x h/2), w1, w3, w2 (h x 4h), two norms;
    # AdamW's two moments and the pipeline's gradient accumulator: at most 4 copies
    h = 32
    weights = (2 * h * h + h * h + 12 * h * h + 2 * h) * 4
    assert weights * 4 / 2 <= profile.layer.static_bytes <= weights * 4
    assert profile.layer.forward_seconds > 0 and profile.layer.backward_seconds > 0
    assert profile.embed.static_bytes > 0 and profile.head.static_bytes > 0
    result = partition(profile, stages=3, micro_batches=4, budget_bytes=1 << 30,
                       method="dawnpiper")
    assert sum(s.layers for s in result.stages) == 6 and result.fits


def test_profiling_a_step_without_repeated_layers_says_what_it_needs():
    step, args = llama(layers=1)
    built, _ = problem_for_step(step, *args, mesh="1x2")
    with pytest.raises(ValueError, match="at least two repeated layers, found 0.*layers_i"):
        problem_profile(built.problem, layers=6)


def test_profiling_a_step_with_an_encoders_and_a_decoders_layers_says_it_cannot():
    from experiments.zoo import encdec

    step, args = encdec.make(layers=2)
    built, _ = problem_for_step(step, *args, mesh="1x2")
    with pytest.raises(ValueError, match="several structures.*solver 'kiwi'"):
        problem_profile(built.problem, layers=6)

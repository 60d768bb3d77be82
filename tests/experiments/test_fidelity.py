"""The fidelity study's summary: every plan outside the memory target is named, distinct plans
count once, failed groups are listed; and its figure is drawn."""

from experiments import fidelity


def _row(fingerprint, memory_error, step_error, method="kiwi", fraction=1.0):
    return {"feasible": True, "fingerprint": fingerprint, "method": method,
            "budget_fraction": fraction, "memory_error": memory_error, "step_error": step_error,
            "memory_within_target": abs(memory_error) <= fidelity.MEMORY_TARGET}


def test_the_summary_names_every_miss_and_counts_each_plan_once(tmp_path):
    groups = [
        {"model": "mlp", "mesh": "2x4", "agreement": {"kendall_tau": 0.5},
         "rows": [_row("a", 0.05, 0.1), _row("a", 0.05, 0.1, fraction=0.9),
                  _row("b", -0.31, -0.5, fraction=0.8), {"feasible": False}]},
        {"model": "llama", "mesh": "1x8", "agreement": {"kendall_tau": None},
         "rows": [_row("c", 0.12, 0.0)]},
        {"model": "encdec", "mesh": "4x2", "error": "SolverTimeoutError: no plan"},
    ]
    stats = fidelity.summary(groups)
    assert stats["points"] == 3 and stats["memory_within_target"] == 1
    assert [(m["model"], m["budget_fraction"]) for m in stats["memory_misses"]] == \
        [("mlp", 0.8), ("llama", 1.0)]
    assert stats["max_abs_memory_error"] == 0.31
    assert stats["median_kendall_tau"] == 0.5
    assert stats["groups_failed"][0]["model"] == "encdec"
    result = {"groups": groups, "summary": stats}
    fidelity.plot(result, tmp_path / "fidelity.png")
    assert (tmp_path / "fidelity.png").stat().st_size > 10_000

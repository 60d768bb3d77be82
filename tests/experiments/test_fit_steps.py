"""The budget search's rules against recorded searches: each case counted once, by kind, and
each rule's errors as hand-computed."""

import json

import pytest

from experiments import fit_steps


def _trial(solver_budget, predicted, compiled):
    return {"solver_budget_bytes": solver_budget, "predicted_peak_bytes": predicted,
            "compiled_peak_bytes": compiled}


def test_rules_are_scored_on_each_distinct_pair_of_compiled_trials(tmp_path):
    search = {"budget_bytes": 1000, "trials": [
        _trial(1000, 1000, 1100),           # over: tightening to the next compiled trial
        _trial(885, 800, 950),
        {"solver_budget_bytes": 900, "predicted_peak_bytes": 880, "compiled_peak_bytes": None},
        _trial(940, 900, 990)]}             # after a fit, looser: loosening
    (tmp_path / "a.json").write_text(json.dumps({"rows": [{"fit": search}]}))
    (tmp_path / "b.json").write_text(json.dumps(search))        # the same search again
    (tmp_path / "notes.json").write_text("not json")
    found = fit_steps.cases(tmp_path)
    assert [len(found[k]) for k in ("tightening", "loosening")] == [1, 1]
    _, first, second = found["tightening"][0]
    assert fit_steps.predicted("excess", first, second) == 900      # 800 + 100
    assert fit_steps.predicted("ratio", first, second) == pytest.approx(880)
    stats = fit_steps.summary(found["tightening"])
    # the next plan compiled to 950: excess 50 under (5% of the budget), ratio 70 under (7%)
    assert stats["excess"]["median_abs_error"] == pytest.approx(0.05)
    assert stats["ratio"]["mean_error"] == pytest.approx(-0.07)
    assert stats["excess"]["under_by_more"] == 1.0 and stats["excess"]["within_half_band"] == 0


def test_a_missing_results_folder_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fit_steps.main(["--results", str(tmp_path / "nowhere")])
    assert "is not a folder of result files" in capsys.readouterr().err

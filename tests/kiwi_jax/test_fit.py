"""The solver-budget search against fakes: hand-computed search sequences, and invariants over
random monotone and non-monotone responses."""

import dataclasses
import json
import random
import time

import pytest

from kiwi_jax.fit import FitRecord, FitStop, NoPlanInTime, fit_budget


@dataclasses.dataclass(frozen=True)
class FakePlan:
    name: str
    predicted_peak_bytes: int
    predicted_step_seconds: float
    compiled_bytes: int
    """What compiling it measures."""


class Landscape:
    """A fake solver and compiler over a fixed set of plans. ``solve(b)``: the fastest plan whose
    predicted peak is at most ``b`` (or ``answers(b)`` when given); every call is recorded."""

    def __init__(self, *plans, answers=None):
        self.plans, self.answers = plans, answers
        self.solved, self.compiled, self.unlimited_calls = [], [], 0

    def solve(self, budget):
        self.solved.append(budget)
        if self.answers is not None:
            return self.answers(budget)
        fitting = [p for p in self.plans if p.predicted_peak_bytes <= budget]
        return min(fitting, key=lambda p: (p.predicted_step_seconds, p.predicted_peak_bytes),
                   default=None)

    def compile(self, plan):
        self.compiled.append(plan.name)
        return plan.compiled_bytes

    def unlimited(self):
        self.unlimited_calls += 1
        return min(self.plans, key=lambda p: (p.predicted_step_seconds, p.predicted_peak_bytes))

    def fit(self, budget, **options):
        options.setdefault("unlimited", self.unlimited)
        return fit_budget(budget, self.solve, self.compile, key=lambda p: p.name, **options)


def _trials(record):
    return [(t.solver_budget_bytes, t.predicted_peak_bytes, t.compiled_peak_bytes,
             t.predicted_step_seconds, t.compiled) for t in record.trials]


def test_over_tightens_then_secant_lands_in_the_band():
    land = Landscape(FakePlan("A", 1000, 1.0, 1100), FakePlan("B", 900, 1.1, 990),
                     FakePlan("C", 800, 1.2, 880))
    result = land.fit(1000)
    # 1000 -> A compiles 100 over its prediction; 985 - 100 = 885 -> C fits at 0.88; the
    # secant between (885, 880) and (1000, 1100) aims at 985: 885 + 105 * 115 / 220 = 940 -> B
    # at 0.99.
    assert land.solved == [1000, 885, 940]
    assert _trials(result.record) == [(1000, 1000, 1100, 1.0, True), (885, 800, 880, 1.2, True),
                                      (940, 900, 990, 1.1, True)]
    assert result.plan.name == "B" and result.record.stop == FitStop.FITS
    assert result.record.compiles == 3 and result.record.ratio == pytest.approx(0.99)
    assert result.record.solver_budget_bytes == 940 and land.unlimited_calls == 1


def test_the_plans_that_fit_are_ranked_by_their_compiled_estimate():
    # the same search as above, with the compiled programs ranking C, which the model predicts
    # slower than B, faster: C is kept, and every compiled trial records its estimate
    land = Landscape(FakePlan("A", 1000, 1.0, 1100), FakePlan("B", 900, 1.1, 990),
                     FakePlan("C", 800, 1.2, 880))
    estimates = {"A": 0.95, "B": 0.9, "C": 0.85}
    result = land.fit(1000, seconds=lambda plan: estimates[plan.name])
    assert land.solved == [1000, 885, 940] and result.record.stop == FitStop.FITS
    assert [t.compiled_step_seconds for t in result.record.trials] == [0.95, 0.85, 0.9]
    assert result.plan.name == "C" and result.record.solver_budget_bytes == 885
    assert FitRecord.from_dict(json.loads(json.dumps(result.record.to_dict()))) == result.record


def test_past_its_deadline_the_search_stops_once_a_plan_fits():
    # the search above with its deadline already passed: the plan over the budget does not stop
    # it, the first plan that fits does (C at 0.88, where B at 0.99 was one solve away)
    land = Landscape(FakePlan("A", 1000, 1.0, 1100), FakePlan("B", 900, 1.1, 990),
                     FakePlan("C", 800, 1.2, 880))
    result = land.fit(1000, deadline=time.perf_counter())
    assert land.solved == [1000, 885]
    assert result.plan.name == "C" and result.record.stop == FitStop.DEADLINE
    assert result.record.fits and "(stopped: deadline)" in result.record.describe()
    later = Landscape(*land.plans)
    assert later.fit(1000, deadline=time.perf_counter() + 3600).plan.name == "B"


def test_under_by_more_than_the_band_loosens():
    land = Landscape(FakePlan("A", 1300, 1.0, 1200), FakePlan("B", 1100, 1.1, 980),
                     FakePlan("C", 1000, 1.2, 890), FakePlan("D", 900, 1.3, 800))
    result = land.fit(1000)
    # 1000 -> C at 0.89, slower than A (the unlimited plan): 1000 * 985 / 890 = 1107 -> B.
    assert land.solved == [1000, 1107]
    assert result.plan.name == "B" and result.record.stop == FitStop.FITS
    assert result.record.solver_budget_bytes == 1107 > result.record.budget_bytes


def test_infeasible_at_the_budget_searched_from_the_smallest_feasible_one():
    land = Landscape(FakePlan("A", 1500, 1.0, 1250), FakePlan("B", 1300, 1.1, 1050),
                     FakePlan("B'", 1250, 1.2, 980), FakePlan("C", 1200, 1.3, 900))
    result = land.fit(1000, start=1200, floor=1200)
    # 1200 -> C at 0.90; 1200 * 985 / 900 = 1313 -> B over; secant between (1200, 900) and
    # (1300, 1050): 1200 + 85 * 100 / 150 = 1257 -> B' at 0.98.
    assert land.solved == [1200, 1313, 1257]
    assert result.plan.name == "B'" and result.record.fits
    assert result.record.stop == FitStop.FITS and result.record.compiles == 3


def test_no_plan_compiles_under_and_none_is_tighter():
    land = Landscape(FakePlan("A", 1500, 1.0, 1400), FakePlan("C", 1200, 1.3, 1100))
    result = land.fit(1000, start=1200, floor=1200)
    assert land.solved == [1200] and result.record.stop == FitStop.NO_PLAN
    assert result.plan.name == "C" and not result.record.fits      # the closest, flagged


def test_over_and_no_plan_under_the_next_guess_halves_instead_of_creeping_up_by_a_byte():
    # every plan compiles 30% over its prediction and nothing is feasible under 800: the guess
    # after each plan over the budget falls under the smallest budget known to have no plan
    # (the zoo ViT on one device: 929,454, 929,455, 929,456 B were solved in turn)
    def answers(budget):
        return None if budget < 800 else FakePlan(str(budget), budget, 2000 / budget,
                                                  int(1.3 * budget))

    land = Landscape(answers=answers)
    result = land.fit(1000, unlimited=None, max_compiles=10, max_solves=12)
    failed = sorted(b for b in land.solved if b < 800)
    assert all(b - a > 1 for a, b in zip(failed, failed[1:])), land.solved
    assert not result.record.fits and result.record.stop == FitStop.CONVERGED


def test_no_plan_at_the_start_tries_looser_solver_budgets():
    # at the model's smallest feasible budget the program is at its tightest, and its solve may
    # end at the time limit without a plan (the zoo mixer on 2x4 at 80%)
    plan = FakePlan("C", 1300, 1.3, 900)
    land = Landscape(plan, answers=lambda budget: plan if budget >= 1300 else None)
    result = land.fit(1000, start=1200, floor=1200)
    assert land.solved == [1200, 1320]                  # 10% looser
    assert result.plan.name == "C" and result.record.fits


def test_no_plan_at_the_start():
    land = Landscape(FakePlan("A", 1500, 1.0, 1400))
    result = land.fit(1000)
    assert result.plan is None and result.record.chosen is None
    assert result.record.stop == FitStop.NO_PLAN and result.record.compiles == 0
    assert "no plan measured" in result.record.describe()


def test_the_unlimited_plan_fitting_stops_at_once():
    land = Landscape(FakePlan("A", 700, 1.0, 600), FakePlan("B", 500, 1.2, 450))
    result = land.fit(1000)
    assert land.solved == [1000] and land.compiled == ["A"]
    assert result.plan.name == "A" and result.record.stop == FitStop.FASTEST


def test_loosening_reaches_the_unlimited_plan_without_a_solve():
    land = Landscape(FakePlan("A", 1050, 1.0, 960), FakePlan("C", 1000, 1.2, 700))
    result = land.fit(1000)
    # 1000 -> C at 0.70; 1000 * 985 / 700 = 1407 is above the unlimited plan's 1050 peak:
    # A itself is tried, fits at 0.96 and cannot be made faster.
    assert land.solved == [1000] and land.compiled == ["C", "A"]
    assert _trials(result.record)[-1] == (1050, 1050, 960, 1.0, True)
    assert result.plan.name == "A" and result.record.stop == FitStop.FASTEST


def test_a_plan_solved_again_is_not_compiled_again():
    land = Landscape(FakePlan("A", 1300, 1.0, 1200), FakePlan("C", 1000, 1.2, 890))
    result = land.fit(1000, max_solves=4)
    # 1000 -> C at 0.89; 1107 and 1225 (x 985 / 890 each) -> C again, not compiled; 1356 is
    # above A's 1300 peak: A, over; the secant between (1225, 890) and (1300, 1200) gives
    # 1248 -> C again; the four solves are spent.
    assert land.solved == [1000, 1107, 1225, 1248] and land.compiled == ["C", "A"]
    assert [t.compiled for t in result.record.trials] == [True, False, False, True, False]
    assert result.record.stop == FitStop.SOLVES and result.plan.name == "C"


def test_a_plan_no_faster_than_a_fit_is_not_compiled():
    plans = FakePlan("A", 1000, 1.0, 1100), FakePlan("P", 880, 1.05, 960), \
        FakePlan("Q", 900, 1.08, 980)
    land = Landscape(*plans, answers=lambda b: plans[0] if b >= 1000 else
                     plans[2] if b >= 900 else plans[1])    # a solver gap: Q is slower than P
    result = land.fit(1000)
    # A 100 over its prediction -> 885: P fits at 0.96 -> secant 885 + 25 * 115 / 140 = 906:
    # Q, slower than P, is not compiled; one solve just under A's 1000 finds nothing faster
    # either: converged.
    assert land.solved == [1000, 885, 906, 999] and land.compiled == ["A", "P"]
    assert _trials(result.record)[2] == (906, 900, None, 1.08, False)
    assert result.plan.name == "P" and result.record.stop == FitStop.CONVERGED
    assert result.record.ratio == pytest.approx(0.96) and result.record.compiles == 2


def test_a_fit_seen_is_never_traded_for_a_plan_over_the_budget():
    # non-monotone: looser budgets compile over, and the bound stops the search
    answers = lambda b: (FakePlan("D", 800, 1.2, 850) if b < 900 else   # noqa: E731
                         FakePlan("C", 900, 1.1, 1010) if b < 1000 else FakePlan("A", 1000, 1.0, 1080))
    land = Landscape(FakePlan("A", 1000, 1.0, 1080), answers=answers)
    result = land.fit(1000, max_compiles=3)
    # A 80 over its prediction -> 905: C 110 over -> 985 - 110 = 875: D fits (0.85), bound
    # spent
    assert land.solved == [1000, 905, 875] and result.record.stop == FitStop.COMPILES
    assert result.plan.name == "D" and result.record.fits


def test_non_monotone_response_converges_on_the_fit_it_saw():
    land = Landscape(FakePlan("A", 1000, 1.0, 1080), FakePlan("B", 950, 1.05, 900),
                     FakePlan("C", 900, 1.1, 1010), FakePlan("D", 800, 1.2, 850))
    result = land.fit(1000)
    # A over -> 905: C over -> 875: D fits -> secant 875 + 135 * 25 / 160 = 896: D again, and
    # (896, 900) is narrower than 0.5% of the budget. B (950, fits) lies above an over plan the
    # search has no reason to look past.
    assert land.solved == [1000, 905, 875, 896] and result.record.stop == FitStop.CONVERGED
    assert result.plan.name == "D" and result.record.compiles == 3


def test_the_compile_bound_is_respected():
    # every budget gets a new plan, and every plan compiles over: 2 b + 1000 (its excess over
    # the prediction is more than the budget, so each next budget is half the one before)
    land = Landscape(answers=lambda b: FakePlan(str(b), b, 1000.0 / b, 2 * b + 1000))
    result = land.fit(1000, max_compiles=4, unlimited=None)
    assert land.solved == [1000, 499, 249, 124]
    assert len(land.compiled) == result.record.compiles == 4
    assert result.record.stop == FitStop.COMPILES and not result.record.fits
    assert result.plan.name == "124"            # none fits: the one that compiled smallest


def test_no_plan_in_the_solvers_time_stops_the_search_with_what_it_measured():
    # the first plan compiles over; the solver then finds nothing in its time under 885 B,
    # where plans exist (a timeout proves nothing), nor once more halfway back up (942 B):
    # the search stops there
    def answers(budget):
        if budget < 1000:
            raise NoPlanInTime("no plan found within the time limit")
        return FakePlan("A", 1000, 1.0, 1100)

    land = Landscape(answers=answers)
    result = land.fit(1000, unlimited=None)
    assert land.solved == [1000, 885, 942] and land.compiled == ["A"]
    record = result.record
    assert record.stop == FitStop.TIME and record.solves == 3 and not record.fits
    assert result.plan.name == "A" and "(stopped: time)" in record.describe()


def test_after_no_plan_in_time_the_search_tries_halfway_back_up():
    # the program is looser halfway back up to the plan that compiled over: B is found there
    # and fits
    def answers(budget):
        if budget < 920:
            raise NoPlanInTime("no plan found within the time limit")
        return FakePlan("A", 1000, 1.0, 1100) if budget >= 1000 else FakePlan("B", 940, 1.2, 990)

    land = Landscape(answers=answers)
    result = land.fit(1000, unlimited=None)
    assert land.solved == [1000, 885, 942] and land.compiled == ["A", "B"]
    assert result.record.fits and result.plan.name == "B"
    assert result.record.stop == FitStop.FITS


def test_a_plan_over_the_budget_that_a_fitting_step_beats_stops_the_search():
    # A compiles over, faster than the step that fits; B, solved under less memory
    # (985 - 200), compiles over too and is no faster than that step: the search stops, and
    # C, which would fit, is never solved for
    land = Landscape(FakePlan("A", 1000, 1.0, 1200), FakePlan("B", 700, 1.5, 1050),
                     FakePlan("C", 600, 2.0, 950))
    asked = []

    def beaten(plan):
        asked.append(plan.name)
        return plan.predicted_step_seconds >= 1.4

    result = land.fit(1000, beaten=beaten)
    assert land.solved == [1000, 785] and land.compiled == ["A", "B"] == asked
    record = result.record
    assert record.stop == FitStop.BEATEN and not record.fits and result.plan.name == "B"
    assert "(stopped: beaten)" in record.describe()
    # never asked of a plan that fits
    fits = Landscape(FakePlan("A", 1000, 1.0, 900))
    assert fits.fit(1000, beaten=beaten).record.stop == FitStop.FASTEST and asked == ["A", "B"]


def test_no_unlimited_plan_means_no_ceiling():
    land = Landscape(answers=lambda b: FakePlan(str(b), b, 1000.0 / b, int(0.5 * b)))
    result = fit_budget(1000, land.solve, land.compile, key=lambda p: p.name)
    # 1000 -> 500 B; 1000 * 985 / 500 = 1970 -> 985 B: in the band
    assert land.solved == [1000, 1970] and result.record.stop == FitStop.FITS


def test_record_round_trips_through_json():
    land = Landscape(FakePlan("A", 1000, 1.0, 1100), FakePlan("B", 900, 1.1, 990),
                     FakePlan("C", 800, 1.2, 880))
    record = land.fit(1000).record
    data = json.loads(json.dumps(record.to_dict()))
    assert data["compiles"] == 3 and data["ratio"] == pytest.approx(0.99)
    assert FitRecord.from_dict(data) == record


@pytest.mark.parametrize("options,match", [
    (dict(max_compiles=0), "max_compiles: expected at least 1"),
    (dict(max_solves=0), "max_solves: expected at least 1"),
    (dict(tolerance=1.5), r"tolerance: expected a fraction in \(0, 1\)"),
])
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        Landscape(FakePlan("A", 1, 1.0, 1)).fit(1000, **options)


def _random_landscape(rng: random.Random, monotone: bool) -> Landscape:
    """Plans whose step falls as their peak grows; compiled = peak x a model error of 0.7-1.3,
    the same for every plan when ``monotone``."""
    error = rng.uniform(0.7, 1.3)
    plans, peak, step = [], rng.randint(300, 700), 2.0
    for i in range(rng.randint(2, 12)):
        plans.append(FakePlan(f"p{i}", peak, step,
                              int(peak * (error if monotone else rng.uniform(0.7, 1.3)))))
        peak += rng.randint(5, 200)
        step *= rng.uniform(0.8, 0.99)
    return Landscape(*plans)


@pytest.mark.parametrize("monotone", [True, False], ids=["monotone", "non-monotone"])
def test_invariants_over_random_responses(monotone):
    rng = random.Random(0)
    for _ in range(300):
        land = _random_landscape(rng, monotone)
        max_compiles = rng.randint(1, 8)
        smallest = min(p.predicted_peak_bytes for p in land.plans)
        budget = rng.randint(300, 1500)
        start = None if smallest <= budget else smallest
        result = land.fit(budget, start=start, floor=start, max_compiles=max_compiles)
        record = result.record
        assert record.compiles == len(land.compiled) == len(set(land.compiled)) <= max_compiles
        assert record.solves == len(land.solved) <= max_compiles + 2
        fitting = [t for t in record.trials if t.compiled_peak_bytes is not None
                   and t.compiled_peak_bytes <= budget]
        assert record.fits == bool(fitting)
        if fitting:
            assert record.trials[record.chosen].predicted_step_seconds == \
                min(t.predicted_step_seconds for t in fitting)
        if record.chosen is not None:
            trial = record.trials[record.chosen]
            if record.fits:              # a plan not compiled was no faster than the one kept
                assert all(t.predicted_step_seconds >= trial.predicted_step_seconds
                           for t in record.trials if t.compiled_peak_bytes is None)
            assert (result.plan.predicted_peak_bytes, result.plan.compiled_bytes) == \
                (trial.predicted_peak_bytes, trial.compiled_peak_bytes)
        last = record.trials[-1] if record.trials else None
        if record.stop == FitStop.FITS:
            assert 0.97 * budget <= last.compiled_peak_bytes <= budget
        if record.stop == FitStop.FASTEST:
            assert last.predicted_step_seconds == land.unlimited().predicted_step_seconds
        if record.stop == FitStop.COMPILES:
            assert record.compiles == max_compiles
        best = min((p for p in land.plans if p.compiled_bytes <= budget),
                   key=lambda p: p.predicted_step_seconds, default=None)
        if monotone and max_compiles >= 6 and best is not None:
            # the fastest plan that fits is found, or one within the band
            assert result.plan == best or record.stop == FitStop.FITS, (land.plans, record)

"""How well each rule of the budget search predicts the next plan's compiled memory.

The search of the solver's budget (:mod:`kiwi_jax.fit`) picks the next solver budget from what
the last compiled plan showed. Two rules are compared over every search recorded in the result
files (each ``trials`` list beside a ``budget_bytes``, in any JSON under the folder read):

- ``excess``: the next plan compiles to its prediction plus the last plan's excess of compiled
  over predicted memory (the excess taken as fixed);
- ``ratio``: the next plan compiles to its prediction times the last plan's compiled/predicted
  ratio (the ratio taken as fixed).

Each pair of consecutive compiled trials of one search is a case, counted once however many
files repeat it: ``tightening`` where the first trial compiled over the budget, ``loosening``
where it fit and the next solver budget was larger. Per rule and kind: the median and 75th
percentile of ``|predicted - compiled| / budget``, the mean signed error, the share of cases
within half the search's 3% band of the compiled memory, and the share where the rule
under-predicts by more than that (a next plan aimed at the band's middle would compile over
the budget).

Usage: python -m experiments.fit_steps [--results docs/results] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from experiments.common import write_result
from kiwi_jax.fit import BAND

RULES = ("excess", "ratio")


def searches(folder: pathlib.Path):
    """``(budget, compiled trials)`` of every search recorded under ``folder``."""
    def walk(value):
        if isinstance(value, dict):
            if isinstance(value.get("trials"), list) and "budget_bytes" in value:
                yield int(value["budget_bytes"]), [
                    t for t in value["trials"] if t.get("compiled_peak_bytes")]
            for child in value.values():
                yield from walk(child)
        elif isinstance(value, list):
            for child in value:
                yield from walk(child)

    for path in sorted(folder.glob("*.json")):
        try:
            yield from walk(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue


def cases(folder: pathlib.Path) -> dict[str, list[tuple[int, dict, dict]]]:
    """Consecutive compiled trials, by kind, each distinct pair once."""
    found = {"tightening": [], "loosening": []}
    seen = set()
    for budget, trials in searches(folder):
        for first, second in zip(trials, trials[1:]):
            key = (budget, first["predicted_peak_bytes"], first["compiled_peak_bytes"],
                   second["predicted_peak_bytes"], second["compiled_peak_bytes"])
            if key in seen:
                continue
            seen.add(key)
            if first["compiled_peak_bytes"] > budget:
                found["tightening"].append((budget, first, second))
            elif second["solver_budget_bytes"] > first["solver_budget_bytes"]:
                found["loosening"].append((budget, first, second))
    return found


def predicted(rule: str, first: dict, second: dict) -> float:
    """The second trial's compiled memory as ``rule`` predicts it from the first."""
    p0, c0 = first["predicted_peak_bytes"], first["compiled_peak_bytes"]
    p1 = second["predicted_peak_bytes"]
    return p1 + (c0 - p0) if rule == "excess" else p1 * c0 / p0


def summary(pairs: list[tuple[int, dict, dict]]) -> dict:
    """Per rule: the errors' median, 75th percentile and mean, and the shares in and under."""
    half = BAND / 2
    out = {"cases": len(pairs)}
    for rule in RULES:
        errors = np.array([(predicted(rule, a, b) - b["compiled_peak_bytes"]) / budget
                           for budget, a, b in pairs])
        if not len(errors):
            out[rule] = None
            continue
        out[rule] = {"median_abs_error": float(np.median(abs(errors))),
                     "p75_abs_error": float(np.quantile(abs(errors), 0.75)),
                     "mean_error": float(errors.mean()),
                     "within_half_band": float((abs(errors) <= half).mean()),
                     "under_by_more": float((errors < -half).mean())}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("docs/results"),
                        help="folder of result files to read (default: docs/results)")
    parser.add_argument("--json", action="store_true", help="print the JSON as the last line")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"--results: {args.results} is not a folder of result files (run from the "
                     f"repository root, or pass the folder)")
    result = {"study": "fit_steps", "results": str(args.results), "band": BAND,
              **{kind: summary(pairs) for kind, pairs in cases(args.results).items()}}
    for kind in ("tightening", "loosening"):
        print(f"{kind}: {result[kind]['cases']} cases")
        for rule in RULES:
            row = result[kind][rule]
            if row is not None:
                print(f"  {rule:6s} median |error| {row['median_abs_error']:.1%}, within "
                      f"{BAND / 2:.1%}: {row['within_half_band']:.0%}, under by more: "
                      f"{row['under_by_more']:.0%}")
    write_result("fit_steps", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()

"""Markdown tables of the studies' JSON results (the tables of docs/results.md).

Usage: python -m experiments.report [--results results]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from experiments.optimality import KIWI_TABLE1

GB = 1e9


def _load(folder: pathlib.Path, study: str) -> dict | None:
    path = folder / f"{study}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _speedups(rows) -> dict:
    """Per baseline: the largest (baseline step / kiwi step) over budgets where both fit."""
    table = {}
    for row in rows:
        table.setdefault(row["budget_bytes"], {})[row["method"]] = row
    best = {}
    for methods in table.values():
        kiwi = methods.get("kiwi")
        if not kiwi or not kiwi["feasible"]:
            continue
        for name, row in methods.items():
            if name != "kiwi" and row["feasible"]:
                ratio = row["step_seconds"] / kiwi["step_seconds"]
                best[name] = max(best.get(name, 0.0), ratio)
    return best


def mesh_table(result: dict) -> str:
    lines = ["| model | mesh | reference peak GB | smallest feasible budget GB: alpa / +dots / "
             "+megatron / kiwi | kiwi / best baseline | largest speedup of kiwi over alpa / "
             "+dots / +megatron | solves stopped at the limit | KIWI's smallest (GB) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in result["studies"]:
        mins = {r["method"]: r["min_feasible_bytes"] for r in s["rows"]}
        base = min(v for k, v in mins.items() if k != "kiwi" and v)
        speed = _speedups(s["rows"])
        plans = [r for r in s["rows"] if r["feasible"]]
        stopped = sum(r["status"] != "optimal" for r in plans)
        lines.append(
            f"| {s['model']} | {s['mesh']} | {s['reference_peak_bytes'] / GB:.2f} | "
            + " / ".join(f"{mins[m] / GB:.2f}" if mins.get(m) else "-"
                         for m in ("alpa", "alpa+dots", "alpa+megatron", "kiwi"))
            + f" | {mins['kiwi'] / base:.3f} | "
            + " / ".join(f"{speed.get(m, float('nan')):.3f}x"
                         for m in ("alpa", "alpa+dots", "alpa+megatron"))
            + f" | {stopped} of {len(plans)} | {s.get('paper_kiwi_min_budget_gb') or ''} |")
    return "\n".join(lines)


def compiled_table(result: dict) -> str:
    lines = ["| model | mesh | method | budget MiB | predicted peak MiB | compiled peak MiB |"
             " compiled / predicted | compiled fits |", "|---|---|---|---|---|---|---|---|"]
    for s in result["compiled"]:
        for r in s["rows"]:
            if r.get("compiled_peak_bytes"):
                lines.append(
                    f"| {s['model']} | {s['mesh']} | {r['method']} | "
                    f"{r['budget_bytes'] / 2**20:.2f} | {r['peak_bytes'] / 2**20:.2f} | "
                    f"{r['compiled_peak_bytes'] / 2**20:.2f} | "
                    f"{r['compiled_peak_bytes'] / r['peak_bytes']:.3f} | {r['compiled_fits']} |")
    return "\n".join(lines)


def bandwidth_table(result: dict) -> str:
    lines = ["| links | budget | alpa | alpa+dots | alpa+megatron | kiwi | kiwi recomputed"
             " (values, GiB/device) |", "|---|---|---|---|---|---|---|"]
    for sweep in result["sweeps"]:
        table = {}
        for r in sweep["rows"]:
            table.setdefault(r["budget_fraction"], {})[r["method"]] = r
        for fraction in sorted(table, reverse=True):
            row = table[fraction]
            cells = [f"{row[m]['normalised_to_full_bandwidth']:.3f}" if row[m]["feasible"]
                     else "-" for m in ("alpa", "alpa+dots", "alpa+megatron", "kiwi")]
            kiwi = row["kiwi"]
            recomputed = (f"{kiwi['recomputed_nodes']}, {kiwi['recomputed_bytes'] / 2**30:.2f}"
                          if kiwi["feasible"] else "-")
            lines.append(f"| {sweep['slowdown']}x | {fraction:.1%} | " + " | ".join(cells)
                         + f" | {recomputed} |")
    return "\n".join(lines)


def scaling_table(result: dict) -> str:
    """One line per depth; each cell ``seconds status (step / reference)``, full / tied graph
    (``*``: stopped at the time limit; ``none``: no plan in time)."""
    marks = {"optimal": "", "feasible": "*", "timeout_with_incumbent": "*",
             "timeout_no_incumbent": " none", "infeasible": " infeasible"}
    lines = ["| layers | operators (KIWI) | kiwi variables full / tied | alpa 100% full / tied |"
             " kiwi 100% full / tied | alpa 90% full / tied | kiwi 90% full / tied |",
             "|---|---|---|---|---|---|---|"]
    depths: dict = {}
    for r in result["rows"]:
        depths.setdefault(r["layers"], {})[(r["solver"], r["budget_fraction"],
                                            r["reuse_layers"])] = r

    def cell(r):
        step = f" ({r['normalised_step']:.3f})" if r.get("normalised_step") else ""
        return f"{r['solve_seconds']:.0f} s{marks.get(r['status'], ' ' + r['status'])}{step}"
    for layers, runs in sorted(depths.items()):
        full, tied = runs[("kiwi", 1.0, False)], runs[("kiwi", 1.0, True)]
        cells = [cell(runs[(solver, f, False)]) + " / " + cell(runs[(solver, f, True)])
                 for f in (1.0, 0.9) for solver in ("alpa", "kiwi")]
        lines.append(f"| {layers} | {full['operators']} ({full.get('paper_operators') or '-'}) | "
                     f"{full.get('num_vars', '-')} / {tied.get('num_vars', '-')} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def optimality_table(result: dict) -> str:
    lines = ["| budget | kiwi-full latency | kiwi latency | kiwi / kiwi-full | solve s kiwi-full |"
             " solve s kiwi | KIWI paper: full / reduced latency, solve s |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        paper = KIWI_TABLE1[r["budget_fraction"]]

        def cell(key, ci=None, missing="-", r=r):
            if r.get(key) is None:
                return missing
            return f"{r[key]:.3f}" + (f" ± {r[ci]:.2f}" if ci and r.get(ci) else "")
        ratio = (f"{r['kiwi_latency'] / r['kiwi_full_latency']:.4f}"
                 if r.get("kiwi_latency") and r.get("kiwi_full_latency") else "-")
        lines.append(
            f"| {r['budget_fraction']:.0%} | "
            f"{cell('kiwi_full_latency', missing=r.get('kiwi_full_status') or 'infeasible')} | "
            f"{cell('kiwi_latency', missing=r.get('kiwi_status') or 'infeasible')} | {ratio} | "
            f"{cell('kiwi_full_solve_seconds', 'kiwi_full_solve_seconds_ci95')} | "
            f"{cell('kiwi_solve_seconds', 'kiwi_solve_seconds_ci95')} | "
            f"{paper[0]} / {paper[2]}, {paper[1]} / {paper[3]} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results")
    args = parser.parse_args(argv)
    folder = pathlib.Path(args.results)
    parts = []
    for study, key, render in (("mesh_sweep", "studies", mesh_table),
                               ("mesh_sweep_compiled", "compiled", compiled_table),
                               ("bandwidth_sweep", "sweeps", bandwidth_table),
                               ("solver_scaling", "rows", scaling_table),
                               ("optimality", "rows", optimality_table)):
        result = _load(folder, study)
        if result and result.get(key):
            parts.append(f"### {study}\n\n{render(result)}\n")
    text = "\n".join(parts)
    print(text)
    return text


if __name__ == "__main__":
    main()

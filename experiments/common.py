"""Shared pieces of the experiment scripts: the papers' reference numbers and result files."""

from __future__ import annotations

import json
import os
import pathlib

__all__ = ["KIWI_TABLE2", "RESULTS_DIR", "write_result"]

KIWI_TABLE2 = {1: 308, 4: 1192, 8: 2254, 12: 3366, 16: 4478, 20: 5590}
"""KIWI Table 2: HLO operators per encoder depth."""

RESULTS_DIR = pathlib.Path(os.environ.get("KIWI_RESULTS_DIR", "results"))


def write_result(study: str, result: dict, print_json: bool = False) -> pathlib.Path:
    """Write ``results/<study>.json``; with ``print_json``, also print the result as the last
    line of stdout (the ``--json`` convention of every study)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{study}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    if print_json:
        print(json.dumps(result))
    return path

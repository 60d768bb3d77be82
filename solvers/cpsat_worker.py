"""The CP-SAT backend's child process: reads a pickled model from stdin, writes the result.

Run as ``python -m solvers.cpsat_worker``; :func:`solvers.backend._solve_cpsat` starts it.
CP-SAT works on integers only: every variable is counted in its resolution (1 ns, 1 byte, or 1
for binaries) and every row is scaled to integer coefficients.
"""

from __future__ import annotations

import math
import pickle
import sys
import time

import numpy as np

__all__ = ["solve", "integer_row"]

SMALLEST = 1e4
"""What the smallest coefficient of a row that is not exactly integral is scaled to."""
LARGEST = 1e12
"""Cap on a scaled coefficient (products with variable domains must stay within int64)."""


def integer_row(coefs: np.ndarray, lo: float, hi: float):
    """The row scaled to integer coefficients, with bounds rounded inwards (None: no bound).

    Exact when the coefficients are multiples of the smallest; otherwise the smallest becomes
    ``SMALLEST`` (rounding error under 1/(2 SMALLEST) of it), unless that would take the largest
    past ``LARGEST``.
    """
    nonzero = np.abs(coefs[coefs != 0])
    if not len(nonzero):
        return coefs.astype(np.int64), lo, hi
    factor = 1.0 / nonzero.min()
    if not np.allclose(coefs * factor, np.round(coefs * factor), rtol=0, atol=1e-9):
        factor = min(SMALLEST / nonzero.min(), LARGEST / nonzero.max())
    ints = np.round(coefs * factor).astype(np.int64)
    if (ints[coefs != 0] == 0).any():
        raise ValueError(f"row coefficients span more than {LARGEST:.0e}: "
                         f"{nonzero.min():.3g} .. {nonzero.max():.3g}")
    lo_i = int(math.ceil(lo * factor - 1e-6)) if np.isfinite(lo) else None
    hi_i = int(math.floor(hi * factor + 1e-6)) if np.isfinite(hi) else None
    return ints, lo_i, hi_i


def solve(arrays, time_limit, mip_gap, seed, threads, hint):
    """Build and solve the CP-SAT model; returns ``(status name, x, bound, seconds)``."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        return "IMPORT_ERROR", None, float("nan"), 0.0
    matrix, lo, hi, lb, ub, cost, _integer, resolution, _offset = arrays
    cp = cp_model.CpModel()
    lo_int = np.ceil(lb / resolution - 1e-9)
    if not np.isfinite(ub).all():
        raise ValueError("CP-SAT needs a finite upper bound on every variable")
    hi_int = np.floor(ub / resolution + 1e-9)
    xs = [cp.new_int_var(int(a), int(b), "") for a, b in zip(lo_int, hi_int)]
    scaled = matrix.multiply(resolution[None, :]).tocsr()
    for r in range(scaled.shape[0]):
        begin, end = scaled.indptr[r], scaled.indptr[r + 1]
        ints, lo_r, hi_r = integer_row(scaled.data[begin:end], lo[r], hi[r])
        row = sum(xs[j] * int(c) for j, c in zip(scaled.indices[begin:end], ints) if c)
        if lo_r is not None:
            cp.add(row >= lo_r)
        if hi_r is not None:
            cp.add(row <= hi_r)
    cp.minimize(sum(xs[j] * float(cost[j] * resolution[j]) for j in np.flatnonzero(cost)))
    for j, value in hint.items():
        cp.add_hint(xs[j], int(round(value / resolution[j])))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.relative_gap_limit = mip_gap
    solver.parameters.num_workers = threads
    solver.parameters.random_seed = seed
    start = time.perf_counter()
    code = solver.solve(cp)
    seconds = time.perf_counter() - start
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return code.name, None, float("nan"), seconds
    x = np.array([solver.value(v) for v in xs], float) * resolution
    return code.name, x, float(solver.best_objective_bound), seconds


def main() -> None:
    request = pickle.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(pickle.dumps(solve(*request)))


if __name__ == "__main__":
    main()

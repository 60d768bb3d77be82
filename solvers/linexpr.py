"""Sparse linear expressions over MILP variables, for building formulations row by row."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Expr", "const", "var", "total"]


@dataclasses.dataclass(frozen=True)
class Expr:
    """``constant + coefs @ x[indices]``; repeated indices add up."""

    indices: np.ndarray
    """Variable indices (int64)."""
    coefs: np.ndarray
    """Their coefficients (float)."""
    constant: float = 0.0
    """The constant part."""

    def __add__(self, other: "Expr") -> "Expr":
        return Expr(np.concatenate([self.indices, other.indices]),
                    np.concatenate([self.coefs, other.coefs]), self.constant + other.constant)

    def __sub__(self, other: "Expr") -> "Expr":
        return self + other * -1.0

    def __mul__(self, factor: float) -> "Expr":
        return Expr(self.indices, self.coefs * factor, self.constant * factor)

    @property
    def is_constant(self) -> bool:
        return not len(self.indices)

    @property
    def key(self) -> tuple:
        """A hashable identity: equal keys, equal expressions (the same terms in the same
        order; an expression built the same way from the same variables has the same key)."""
        return self.indices.tobytes(), self.coefs.tobytes(), self.constant

    def upper(self, ub: np.ndarray) -> float:
        """Its largest value for variables in [0, ub] (coefficients >= 0 assumed)."""
        return float(self.constant + np.maximum(self.coefs, 0) @ ub[self.indices])


def const(value: float) -> Expr:
    """A constant expression."""
    return Expr(np.zeros(0, np.int64), np.zeros(0), float(value))


def var(index: int, coef: float = 1.0) -> Expr:
    """``coef * x[index]``."""
    return Expr(np.array([index], np.int64), np.array([float(coef)]))


def total(exprs) -> Expr:
    """Sum of expressions."""
    exprs = list(exprs)
    if not exprs:
        return const(0.0)
    return Expr(np.concatenate([e.indices for e in exprs]).astype(np.int64),
                np.concatenate([e.coefs for e in exprs]).astype(float),
                float(sum(e.constant for e in exprs)))

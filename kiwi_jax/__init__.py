"""kiwi-jax: joint sharding and rematerialisation planning for JAX train steps."""

from kiwi_jax.cluster import Cluster, Device, Link, MeshSpec, PRESETS, parse_bytes
from kiwi_jax.frontend import problem_for_step, trace_step
from kiwi_jax.optimize import NotATrainStepError, OptimizedStep, optimize
from kiwi_jax.problem import ProblemBuild, build_problem
from kiwi_jax.strategies import Strategy

__all__ = [
    "Cluster", "Device", "Link", "MeshSpec", "PRESETS", "parse_bytes",
    "problem_for_step", "trace_step", "ProblemBuild", "build_problem", "Strategy",
    "optimize", "OptimizedStep", "NotATrainStepError",
]

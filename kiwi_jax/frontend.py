"""From a train step and its arguments to the costed sharding problem."""

from __future__ import annotations

import time

from hlo_tools.graph import OpGraph
from kiwi_jax.apply import TracedStep, carried_pairs, in_program_order, trace_for_planning
from kiwi_jax.cluster import MeshSpec
from kiwi_jax.problem import ProblemBuild, build_problem
from kiwi_jax.step import PureStep, functionalize

__all__ = ["trace_step", "trace", "problem_for_step"]


def trace(train_step, *args, traced_order: bool = True) -> TracedStep:
    """Functionalize a Flax train step, trace its flat jaxpr and build the operator graph of its
    interpreted form (every node tagged with the equation that produced it), numbered in the
    traced program's order or, with ``traced_order=False``, in the order XLA prints it (a mesh:
    :func:`kiwi_jax.apply.in_program_order`).

    Args may be concrete or abstract (``nnx.eval_shape`` / ``jax.ShapeDtypeStruct``): lowering
    allocates nothing.
    """
    return trace_for_planning(functionalize(train_step, args), traced_order)


def trace_step(train_step, *args) -> tuple[PureStep, OpGraph]:
    """``(functionalized step, operator graph)`` of a train step (see :func:`trace`)."""
    traced = trace(train_step, *args)
    return traced.pure, traced.graph


def problem_for_step(train_step, *args, mesh, cluster="v100-nvlink", merge=True,
                     memory_model="auto", order="auto") -> tuple[ProblemBuild, dict]:
    """Trace ``train_step(*args)`` and build its sharding problem (``memory_model``: see
    :data:`kiwi_jax.problem.MEMORY_MODELS`; ``order``: :data:`kiwi_jax.apply.ORDERS`).

    Returns:
      (build, timings): the problem build and the seconds spent lowering and building.
    """
    start = time.perf_counter()
    traced = trace(train_step, *args,
                   traced_order=in_program_order(MeshSpec.parse(mesh).num_devices, order))
    lowered = time.perf_counter()
    build = build_problem(traced.graph, mesh, cluster, merge=merge, memory_model=memory_model,
                          carried=carried_pairs(traced))
    done = time.perf_counter()
    return build, {"lower_seconds": lowered - start, "build_seconds": done - lowered}

"""Profile a model for pipeline planning from one representative layer.

Like Lynx's profiler, only a short model is lowered: the same configuration with two layers, so
that a layer sits between the embedding and another layer (:func:`model_profile` for the
reference models; :func:`problem_profile` for any step whose layers the graph knows, from name
scopes or from the parameter tree). Its sharding is the fastest plan with no memory limit on the
stage's mesh (``solvers.reference_plan``); its costs come from the cost model. The full model is
that layer repeated ``layers`` times between the embedding and the head.

Attribution (all per device, under the plan):
- forward and backward nodes by layer; outside layers, forward nodes that feed a layer are the
  embedding's, the others the head's; backward nodes downstream of a layer's backward are the
  embedding's, the others the head's;
- weights by layer, optimizer state by its layer or its tree path (``...['mu'][path]`` belongs
  to the weight at ``path``); the gradient accumulator of a pipeline adds one copy of the
  weights; optimizer seconds are shared in proportion to the static bytes;
- workspace: what the no-limit plan's peak holds beyond inputs and kept activations.

References:
  Lynx (sec. 6, Model Profiler: one representative layer); DawnPiper (sec. 4, appendix C.1).
"""

from __future__ import annotations

import re

import numpy as np

import solvers
from kiwi_jax.cluster import Cluster
from kiwi_jax.frontend import problem_for_step
from kiwi_jax.models import build
from solvers.lynx import layer_ops, split_costs
from solvers.pipeline import Block, ModelProfile
from solvers.phase import Phase
from solvers.reuse import REPEAT_SHARE, tie_shares

__all__ = ["model_profile", "problem_profile"]

_ARGS = re.compile(r"^args(\[\d+\])+")


def _path(op_name: str) -> str:
    return _ARGS.sub("", op_name).replace("\\", "")


def _input_groups(problem, side_of_weight: dict[int, str]) -> dict[int, str]:
    """Per input node, 'layer', 'repeat' (another layer's), 'embed' or 'head' (optimizer state
    follows its weight; inputs that are no weight's, such as the batch, go with the
    embedding)."""
    paths = {i: _path(problem.op_names[i]) for i in np.flatnonzero(problem.phase == Phase.PARAM)}
    weights = {paths[i]: side for i, side in side_of_weight.items() if paths[i]}
    out = {}
    for i, path in paths.items():
        if i in side_of_weight:
            out[i] = side_of_weight[i]
            continue
        match = [side for wpath, side in weights.items() if path.endswith(wpath)]
        out[i] = match[0] if match else "embed"
    return out


def _downstream(problem, seeds: np.ndarray, within: np.ndarray) -> np.ndarray:
    """bool: nodes of ``within`` reachable from ``seeds`` along edges."""
    reached = seeds.copy()
    for src, dst, _slot in sorted(problem.edges.tolist(), key=lambda e: e[1]):
        if reached[src] and within[dst]:
            reached[dst] = True
    return reached & within


def model_profile(model: str = "gpt", layers: int = 32, mesh="1x4", cluster="a100-nvlink",
                  micro_batch: int | None = None, time_limit: float = 60.0,
                  **config) -> ModelProfile:
    """Profile ``model`` with ``layers`` layers for pipeline planning (see the module notes).

    Args:
      model: a reference model name (``gpt``, ``bert``).
      layers: the full model's depth.
      mesh: the mesh of one stage (tensor parallelism inside a stage).
      cluster: hardware; stages talk over its inter-node link.
      micro_batch: samples per micro-batch (the model's ``batch``).
      config: other model settings (hidden, heads, seq, vocab).
    """
    if micro_batch is not None:
        config["batch"] = micro_batch
    ref = build(model, layers=2, **config)
    built, _ = problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                                mesh=mesh, cluster=cluster)
    return problem_profile(built.problem, layers, cluster, ref.config.batch, time_limit)


def problem_profile(problem, layers: int, cluster="a100-nvlink", micro_batch: int = 1,
                    time_limit: float = 60.0) -> ModelProfile:
    """Profile a short train step's problem for pipeline planning: its layers (from name
    scopes or from the parameter tree, see :mod:`hlo_tools.layers`) are layer 0 and repeats
    of it, what feeds them the embedding, the rest the head (see the module notes).

    Args:
      problem: the step's problem on one stage's mesh, with at least two identical layers.
      layers: the full model's depth.
      cluster: hardware; stages talk over its inter-node link.
      micro_batch: samples per micro-batch of the profiled step.
      time_limit: seconds for the no-limit reference plan.

    Raises:
      ValueError: the problem has fewer than two layers, or layers of several structures (an
        encoder's and a decoder's).
    """
    found = np.unique(problem.layer[problem.layer >= 0])
    if len(found) < 2:
        raise ValueError(
            f"pipeline profiling needs a step with at least two repeated layers, found "
            f"{len(found)}: name scopes layer_<i>, or numbered blocks of identical parameters "
            "in the parameter tree (blocks[i], layers_i); lower the step with two layers or "
            "more")
    for layer, shares in tie_shares(problem).items():
        share = shares.get(int(found[0]), 0.0)
        if layer != found[0] and share < REPEAT_SHARE:
            raise ValueError(
                f"pipeline profiling models the step as one run of identical layers, but only "
                f"{share:.0%} of layer {layer}'s operators repeat layer {found[0]}'s: the step "
                "has layers of several structures (an encoder's and a decoder's blocks), which "
                "the pipeline model cannot represent; plan it on one stage (solver 'kiwi')")
    plan = solvers.reference_plan(problem, time_limit=time_limit)
    strategy = plan.strategy
    compute, comm = split_costs(problem, strategy)
    cost = compute + comm
    memory = problem.memory_of(strategy)
    ops = layer_ops(problem, strategy, int(found[0]))
    tagged = problem.layer >= 0
    phase = problem.phase

    untagged_fwd = (phase == Phase.FORWARD) & ~tagged
    feeds_layer = np.zeros(problem.num_nodes, bool)
    readers: list[list[int]] = [[] for _ in range(problem.num_nodes)]
    for src, dst, _slot in problem.edges:           # data flow, fused values included
        readers[src].append(int(dst))
    for i in reversed(range(problem.num_nodes)):
        feeds_layer[i] = any(tagged[r] and phase[r] == Phase.FORWARD or feeds_layer[r]
                             for r in readers[i])
    embed_fwd = untagged_fwd & feeds_layer
    head_fwd = untagged_fwd & ~feeds_layer
    untagged_bwd = (phase == Phase.BACKWARD) & ~tagged
    embed_bwd = _downstream(problem, tagged & (phase == Phase.BACKWARD), untagged_bwd)
    head_bwd = untagged_bwd & ~embed_bwd

    side_of_weight = {}
    for i in np.flatnonzero(phase == Phase.PARAM):
        users = readers[i]
        if not any(phase[u] == Phase.FORWARD for u in users):
            continue                                  # optimizer state, not a weight
        if problem.layer[i] == found[0]:
            side_of_weight[int(i)] = "layer"
        elif problem.layer[i] >= 0:
            side_of_weight[int(i)] = "repeat"         # later layers repeat layer 0
        elif any(embed_fwd[u] for u in users):
            side_of_weight[int(i)] = "embed"
        elif any(head_fwd[u] for u in users):
            side_of_weight[int(i)] = "head"
    groups = _input_groups(problem, side_of_weight)
    for i in groups:                                  # state the layer finder placed
        if i not in side_of_weight and problem.layer[i] >= 0:
            groups[i] = "layer" if problem.layer[i] == found[0] else "repeat"
    static = {"layer": 0, "embed": 0, "head": 0, "repeat": 0}
    for i, side in groups.items():
        grad = memory[i] if i in side_of_weight else 0
        static[side] += int(memory[i] + grad)
    optimizer = float(cost[phase == Phase.OPTIMIZER].sum())
    total_static = static["layer"] * len(found) + static["embed"] + static["head"]

    def held(mask) -> int:
        return int(memory[mask & problem.z.astype(bool)].sum())

    def share(static_bytes) -> float:
        """Optimizer seconds of a part, in proportion to its static bytes."""
        return optimizer * static_bytes / max(total_static, 1)

    def block(fwd, bwd, static_bytes, held_bytes) -> Block:
        return Block(forward_seconds=float(cost[fwd].sum()),
                     backward_seconds=float(cost[bwd].sum()),
                     optimizer_seconds=share(static_bytes),
                     static_bytes=int(static_bytes), held_bytes=int(held_bytes))

    layer_held = ops.kept_bytes(ops.needed | ops.pinned)
    layer = Block(ops.forward_seconds, ops.backward_seconds, share(static["layer"]),
                  static["layer"], layer_held)
    embed = block(embed_fwd, embed_bwd, static["embed"], held(embed_fwd))
    head = block(head_fwd, head_bwd, static["head"], held(head_fwd))
    inputs = int(memory[phase == Phase.PARAM].sum())
    workspace = max(0, plan.peak_bytes - inputs - len(found) * layer_held - embed.held_bytes
                    - head.held_bytes)
    boundary = int(sum(memory[i] for i in ops.nodes
                       if any(problem.layer[r] == found[1] for r in readers[i])))
    hardware = Cluster.parse(cluster)
    link, slow = hardware.inter_node, hardware.comm_slowdown
    return ModelProfile(layer_ops=ops, layer=layer, embed=embed, head=head, layers=layers,
                        workspace_bytes=workspace, boundary_bytes=boundary,
                        link_latency=link.latency_s * slow, link_bandwidth=link.bandwidth / slow,
                        micro_batch=micro_batch)

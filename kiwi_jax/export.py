"""A plan handed to someone who does not use the decorator: the arguments' PartitionSpecs by
path, and per layer a ``jax.checkpoint`` policy that saves what the plan keeps.

The decorator applies a plan to the differentiated step, value by value
(:mod:`kiwi_jax.interpret`). A hand-written step has two places to put it instead: the jitted
step's input shardings, and a ``jax.checkpoint`` (``nnx.remat``, ``nn.remat``) around each
block with a policy. The export gives both:

- ``specs``: the plan's ``PartitionSpec`` for every leaf of the step's arguments, by path
  (``0/0/blocks/0/attn/query/kernel/value`` for the NNX state ``nnx.split((model,
  optimizer))``, ``1/tokens`` for a batch), and :meth:`PlanExport.shardings` as the pytree of
  ``NamedSharding``\\ s ``jax.jit(in_shardings=...)`` takes;
- per layer, the values a ``jax.checkpoint`` policy must save so that the block's backward pass
  reads what the plan keeps and recomputes the rest: the forward values the plan keeps that the
  backward pass (or a recomputation) reads, and that the compiler stores (a value the fusion
  rules, :func:`hlo_tools.liveness.fused_values`, fuse into its readers is left to be recomputed
  inside the backward fusion, as XLA does with it anyway). A value the model names with
  ``jax.ad_checkpoint.checkpoint_name`` is saved by its name, as
  ``jax.checkpoint_policies.save_only_these_names`` does; any other by its operation: the
  primitive, its operands' shapes and its parameters, which is all a policy is shown of an
  equation. Two values of one block with the same operation (a query and a key projection of
  one shape) cannot be told apart that way; where the plan keeps one and recomputes the other,
  both are saved and the layer lists the operation as ambiguous: naming the values in the
  model removes the ambiguity;
- per layer, the plan's spec of its input activation (``boundary``), which
  :meth:`PlanExport.apply` puts on each block's input and outputs when given the mesh.

The policy acts on the model before differentiation and recomputes a whole block's dropped
values at the start of its backward pass, where the decorator recomputes each right before its
first reader; and inside the block XLA's sharding propagation decides the layout where the
decorator constrains every value. The two steps are not the same program, and their compiled
memory differs (measured in docs/apply.md, "Exporting a plan"). So the decorator compiles this
one too (:func:`compile_exported`) and lets the compiler choose (:func:`compile_applied`).

References:
  JAX's ``jax.checkpoint`` policies (``save_only_these_names``); MaxText's named remat
  policies (``checkpoint_name`` on a block's projections, a policy naming those to keep).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
from typing import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hlo_tools.graph import Phase
from hlo_tools.liveness import fused_values, held_operands
from hlo_tools.lower import argument_paths
from kiwi_jax.apply import TracedStep, recomputed_values
from kiwi_jax.compile import CompiledPlan, compile_plan, compiler_options, jit_step
from kiwi_jax.estimate import compiled_cost
from kiwi_jax.interpret import inlined_call, is_unit, scan_body, tag_of, unit_of
from kiwi_jax.plan import Plan
from kiwi_jax.problem import ProblemBuild
from kiwi_jax.recipe_remat import (BlockPolicyError, block_paths, stacked_layers,
                                   with_block_policy, with_scan_policy)
from kiwi_jax.recipe_specs import state_leaves
from kiwi_jax.sharding import of_value, to_partition_spec
from kiwi_jax.step import abstract_arrays, carried_state, functionalize

__all__ = ["LayerPolicy", "PlanExport", "export_plan", "operation", "compile_exported",
           "compile_applied", "with_buckets", "with_export", "fastest_program", "leaf_paths"]

log = logging.getLogger(__name__)


def operation(primitive: str, avals, params: dict) -> str:
    """How a policy tells equations apart: the primitive, its operands' types and shapes and
    its parameters other than sub-programs (``dot_general(f32[8,16],f32[16,64]){...}``)."""
    operands = ",".join(f"{a.dtype}[{','.join(str(d) for d in a.shape)}]"
                        for a in avals if hasattr(a, "shape"))
    kept = {k: v for k, v in params.items()
            if not hasattr(v, "eqns") and not hasattr(v, "jaxpr") and not callable(v)}
    return f"{primitive}({operands}){{{', '.join(f'{k}={kept[k]!r}' for k in sorted(kept))}}}"


def _operation_of(eqn) -> str:
    return operation(eqn.primitive.name, [v.aval for v in eqn.invars], eqn.params)


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """What one layer's ``jax.checkpoint`` saves."""

    layer: int
    """The layer (the graph's numbering)."""
    block: tuple
    """The block module's path in the parameter tree (``('blocks', '3')``); ``()`` when the
    blocks are not separate modules (layers stacked for a scan)."""
    names: tuple[str, ...]
    """``checkpoint_name`` names of the values saved."""
    operations: tuple[str, ...]
    """:func:`operation`\\ s of the unnamed values saved."""
    saved_bytes: int
    """Bytes of the values the plan keeps for the backward pass, as the graph counts them."""
    recomputed: int
    """Forward values the backward pass (or a recomputation) reads that the policy recomputes:
    those the plan recomputes, and those the fusion rules fuse."""
    ambiguous: tuple[str, ...] = ()
    """Operations saved although the plan recomputes a value with that operation (it keeps
    another one with it)."""
    boundary: tuple | None = None
    """The plan's ``PartitionSpec`` of the layer's input activation (the largest forward value
    from outside the layer that it reads), which :meth:`PlanExport.apply` puts on the block's
    input and outputs; None: the layer reads none."""

    @property
    def needs_checkpoint(self) -> bool:
        """Whether the layer recomputes anything: one that does not runs as written, with no
        ``jax.checkpoint`` (whose barriers would only cost fusion)."""
        return self.recomputed > 0

    def policy(self) -> Callable:
        """A ``jax.checkpoint`` policy saving this layer's names and operations."""
        names, operations = frozenset(self.names), frozenset(self.operations)

        def policy(prim, *avals, **params):
            if prim.name == "name":
                return params.get("name") in names
            return operation(prim.name, avals, params) in operations
        return policy


@dataclasses.dataclass(frozen=True)
class PlanExport:
    """A plan as a hand-written step takes it (see the module docstring)."""

    axis_names: tuple[str, ...]
    """The mesh axes the specs name."""
    specs: dict
    """``path -> PartitionSpec`` for every leaf of the step's (functionalized) arguments."""
    layers: tuple[LayerPolicy, ...]
    """Per layer, in order, its checkpoint policy."""
    arg_tree: object = dataclasses.field(default=None, compare=False, repr=False)
    """Pytree structure of the arguments (for :meth:`shardings`)."""

    def shardings(self, mesh, *args) -> tuple:
        """``NamedSharding`` pytrees for the step's arguments, ``jax.jit``'s ``in_shardings``:
        in the structure of ``args`` when given (``(state, batch)`` with ``state =
        nnx.split((model, optimizer))[1]`` for NNX; a Linen step's own arguments: a
        ``TrainState`` carries its ``apply_fn`` in its structure), else of the arguments the
        plan was made for.

        Raises:
          ValueError: a mesh with other axis names than the plan's; ``args`` whose leaves are
            not the plan's (another model, or a state split in another order).
        """
        if tuple(mesh.axis_names) != tuple(self.axis_names):
            raise ValueError(f"the plan's specs name the mesh axes {self.axis_names}; got a mesh "
                             f"with {tuple(mesh.axis_names)}")
        tree = self.arg_tree
        if tree is None and not args:
            raise ValueError("an export read from JSON knows its arguments' paths, not their "
                             "pytree: pass them, shardings(mesh, state, batch)")
        if args:
            paths, tree = leaf_paths(args), jax.tree.structure(args)
            if paths != list(self.specs):
                wrong = next((f"{a!r} where the plan has {b!r}" for a, b in
                              zip(paths, self.specs) if a != b),
                             f"{len(paths)} leaves where the plan has {len(self.specs)}")
                raise ValueError(f"these arguments are not the ones the plan was made for: "
                                 f"{wrong}")
        leaves = [NamedSharding(mesh, spec) for spec in self.specs.values()]
        return tuple(jax.tree.unflatten(tree, leaves))

    def policy(self, layer: int | None = None) -> Callable:
        """Layer ``layer``'s policy; with None, the policy of every layer, when they are one
        (layers the solver tied are).

        Raises:
          ValueError: layers that save different values, with None; an unknown layer.
        """
        if layer is not None:
            found = [p for p in self.layers if p.layer == layer]
            if not found:
                raise ValueError(f"no layer {layer}: the plan has layers "
                                 f"{[p.layer for p in self.layers]}")
            return found[0].policy()
        kinds = {(p.names, p.operations) for p in self.layers}
        if len(kinds) != 1:
            raise ValueError(f"the plan's {len(self.layers)} layers save {len(kinds)} different "
                             "sets of values: take each block's with policy(layer=i)")
        return self.layers[0].policy()

    def apply(self, train_step, args, mesh=None) -> Callable:
        """``train_step`` with every block that recomputes something under its layer's policy
        while it is traced (the model is not edited;
        :func:`kiwi_jax.recipe_remat.with_block_policy`); with ``mesh``, each block's input
        and outputs (those of the input's rank) constrained to the layer's boundary spec, where
        XLA's propagation would otherwise lay out the activations alone.

        Layers stacked for a scan (no block modules) share one body: it runs under the policy
        that saves what any of the layers saves (:meth:`scan_policy`), its carry constrained
        to the first layer's boundary spec (:func:`kiwi_jax.recipe_remat.with_scan_policy`).

        Raises:
          BlockPolicyError: the layers are neither block modules nor stacked for a scan that
            runs through ``jax.lax.scan``.
        """
        blocks = [p for p in self.layers if p.block]
        if not blocks:
            return self._apply_to_scan(train_step, args, mesh)
        style = "nnx" if any(nnx.graph.is_graph_node(a) for a in args) else "linen"
        return with_block_policy(train_step, args, style, [p.block for p in blocks],
                                 [p.policy() if p.needs_checkpoint else None for p in blocks],
                                 [None if mesh is None or p.boundary is None
                                  else _constraint(mesh, p.boundary) for p in blocks])

    def scan_policy(self) -> Callable | None:
        """The policy of a scanned body shared by every layer: it saves what any layer's
        policy saves (layers the solver tied save the same); None when no layer recomputes."""
        if not any(p.needs_checkpoint for p in self.layers):
            return None
        names = tuple(sorted({n for p in self.layers for n in p.names}))
        operations = tuple(sorted({o for p in self.layers for o in p.operations}))
        return LayerPolicy(-1, (), names, operations, 0, 1).policy()

    def _apply_to_scan(self, train_step, args, mesh) -> Callable:
        stacked = stacked_layers(functionalize(train_step, args))
        if not stacked:
            raise BlockPolicyError(
                "the plan's layers are neither separate block modules nor stacked for a scan; "
                "put jax.checkpoint(policy=export.policy(layer=i)) (nnx.remat / nn.remat) "
                "around each layer in the model instead")
        boundary = next((p.boundary for p in self.layers if p.boundary is not None), None)
        constrain = None if mesh is None or boundary is None else _constraint(mesh, boundary)
        return with_scan_policy(train_step, stacked, self.scan_policy(), constrain)

    def table(self) -> str:
        """Per layer: what its policy saves, and what it recomputes."""
        lines = []
        for p in self.layers:
            block = "/".join(map(str, p.block)) or "(no block module)"
            lines.append(f"layer {p.layer} {block}: saves "
                         f"{len(p.names)} named + {len(p.operations)} unnamed values "
                         f"({p.saved_bytes:,} B), recomputes {p.recomputed}"
                         + (f"; {len(p.ambiguous)} ambiguous" if p.ambiguous else ""))
            if p.names:
                lines.append(f"  names: {', '.join(p.names)}")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The export as JSON (specs as lists of axis names per dimension)."""
        return json.dumps({
            "axis_names": list(self.axis_names),
            "specs": {path: [list(a) if isinstance(a, tuple) else a for a in spec]
                      for path, spec in self.specs.items()},
            "layers": [dataclasses.asdict(p) for p in self.layers]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PlanExport:
        """An export read back from :meth:`to_json` (its :meth:`shardings` then need the
        arguments)."""
        data = json.loads(text)
        entry = lambda a: tuple(a) if isinstance(a, list) else a  # noqa: E731
        layers = []
        for p in data["layers"]:
            boundary = None if p["boundary"] is None else tuple(entry(a) for a in p["boundary"])
            layers.append(LayerPolicy(
                p["layer"], tuple(p["block"]), tuple(p["names"]), tuple(p["operations"]),
                p["saved_bytes"], p["recomputed"], tuple(p["ambiguous"]), boundary))
        return cls(tuple(data["axis_names"]),
                   {path: PartitionSpec(*[entry(a) for a in spec])
                    for path, spec in data["specs"].items()}, tuple(layers))


def compile_exported(train_step, args: tuple, mesh, export: PlanExport,
                     donate: bool = True) -> CompiledPlan:
    """The step a user writes with ``export`` (:meth:`PlanExport.apply` with the boundary
    constraints, the exported input shardings, the state donated and keeping its layout),
    compiled as the decorator compiles a plan (abstract ``args`` are enough).

    Raises:
      BlockPolicyError: the layers are neither block modules nor stacked for a scan.
    """
    pure = functionalize(export.apply(train_step, args, mesh), args)
    shardings = export.shardings(mesh, *pure.args)
    outputs = jax.eval_shape(pure.fn, *pure.args)
    state_out = carried_state(pure, outputs)
    jitted, out_shardings = jit_step(pure.fn, shardings, (None,) * len(outputs), state_out,
                                     donate)
    compiled = jitted.lower(*abstract_arrays(pure.args)).compile(
        compiler_options=compiler_options())
    return CompiledPlan(tuple(shardings), tuple(out_shardings), state_out, jitted, compiled,
                        program="blocks")


def compile_applied(train_step, args: tuple, traced: TracedStep, build: ProblemBuild,
                    plan: Plan, mesh, abstract, donate: bool = True, overlap: bool = True,
                    budget_bytes: int | None = None, blocks: bool = True) -> CompiledPlan:
    """kiwi's plan compiled as the decorator runs it: value by value
    (:func:`kiwi_jax.compile.compile_plan`), or another program of the same plan
    (``CompiledPlan.program`` says which runs).

    On a mesh, of the programs compiled, the one estimated fastest among those within
    ``budget_bytes`` (default: the plan's budget) runs, else the smallest
    (:func:`fastest_program`). They are the plan value by value; with ``blocks``, its export
    (:func:`with_export`) where a block of it recomputes, with the layout inside a block left
    to XLA's propagation; and, when value by value is over the budget, the plan with the
    backward pass resharding the step's arguments and the forward pass's values again for each reader
    (``regather``, as the plan prices them; XLA otherwise merges such a copy with the forward
    pass's and holds it in between) and each gradient tied into the backward pass where it is
    made (``settle``, reduced there as the plan prices it; XLA otherwise merges every
    gradient's all-reduce into a few at the end of the backward pass and holds the gradients
    unreduced until then); with ``blocks``, where that program runs, also with the gradients
    tied in by buckets (:func:`with_buckets`). The zoo ResNet's plan at 80% of its reference
    on 2x4 compiled to 613,932 B value by value and 522,540 B so (with the arguments alone
    resharded again, no smaller than value by value). The reference
    GPT at hidden 1024, planned for 419,200,612 B on 2x4 (predicted 407,756,300 B), compiled
    to 510,831,892 B value by value, 447,864,916 B resharding again, 527,623,700 B with the
    gradients tied in, and 412,195,156 B with both, its estimated step 3.7% slower
    (24.06 -> 24.96 ms). The export was the fastest of the three on the zoo ViT (2 blocks, dim
    768, batch 32, 224x224 images) on 4x2 for the ``fsdp/dots_saveable`` recipe's plan: 7.961
    ms at 181,900,632 B, against 9.087 ms at 244,091,720 B value by value and 9.151 ms at
    189,550,104 B regathered; the recipe itself compiles to 7.982 ms at 172,105,496 B.

    On one device, when that step is over the budget and a block of the plan recomputes, its
    export is the other program, and it runs if it is smaller.

    On one device the two programs differ in how recomputation lowers the compiled peak. The
    export recomputes a block's dropped values together at the start of its backward pass, as
    the program's chains do (``ShardingProblem.chained``); value by value, behind barriers,
    XLA's CPU backend kept what the dropped values' readers were fused with (the zoo mixer's
    plan at 70% of its reference: 0.850 of the reference compiled, 0.640 as its export). But
    the export also recomputes what the fusion rules expect XLA to fuse, and saves every
    value whose operation it cannot tell from a recomputed one, so it is slower where both
    fit (the reference GPT's plan at 100% of its prediction on one device: 3.45 ms estimated
    as its export, 3.03 ms value by value) and on some models larger (the zoo Llama's plan at
    90%: 2.62 MiB against 2.17 MiB).

    Args:
      args: the step's arguments (abstract arrays are enough); ``abstract``: its
        functionalized form (:class:`kiwi_jax.step.PureStep`).
      blocks: on a mesh, compile the export too (:func:`with_export`), and the regathered
        program with its gradients by buckets (:func:`with_buckets`). The decorator's budget
        search leaves it out of its trials and compiles it for the plan it settles on. In
        the trials logged on the zoo ViT on 4x2 (dim 768) and the zoo Llama on 2x4 (the
        suite's size) the export never ran (over the budget where the plan's own programs
        were, or within it and slower), and it cost a compile each, 3-14 s. And its memory
        does not follow the solver budget the search steers by (only the blocks' boundaries
        and policies reach it): two whole-block plans of that ViT, solved under 409 and 280
        MB, both compiled to 233,869,280 B as their exports, and the search that steered by
        them (the smallest program of each trial) found no plan under a 172,105,496 B budget,
        where steering by the plans' own programs finds one at 0.983 of it.
    """
    values = compile_plan(traced, build, plan, mesh, abstract, donate, overlap)
    budget = plan.budget_bytes if budget_bytes is None else budget_bytes
    if mesh.devices.size != 1:
        programs = [values]
        if values.memory.peak_bytes > budget:
            # a plan that hides recomputations under collectives (Lynx) needs them to run
            # beside the backward pass, which a gradient tied into it waits for
            settle = not (overlap and plan.hidden_under)
            programs.append(dataclasses.replace(
                compile_plan(traced, build, plan, mesh, abstract, donate, overlap,
                             regather=True, settle=settle), program="regathered"))
        own = fastest_program(programs, budget, mesh, build.cluster)
        if not blocks:
            return own
        own = with_buckets(traced, build, plan, mesh, abstract, own, budget, donate, overlap)
        return with_export(train_step, args, traced, build, plan, mesh, own, budget, donate)
    if values.memory.peak_bytes <= budget:
        return values
    export = _block_export(traced, build, plan, mesh)
    if export is None:
        return values
    try:
        blocks = compile_exported(train_step, args, mesh, export, donate)
    except BlockPolicyError:
        return values
    return blocks if blocks.memory.peak_bytes < values.memory.peak_bytes else values


def _block_export(traced: TracedStep, build: ProblemBuild, plan: Plan, mesh) -> PlanExport | None:
    """The plan's export (:func:`export_plan`); None where no block of it (or, layers stacked
    for a scan, no layer) recomputes anything (there the export is the plan's shardings at the
    blocks' boundaries only)."""
    if not plan.recomputed:
        return None
    export = export_plan(traced, build, plan, mesh)
    scanned = not any(layer.block for layer in export.layers)
    return export if any((layer.block or scanned) and layer.needs_checkpoint
                         for layer in export.layers) else None


def with_buckets(traced: TracedStep, build: ProblemBuild, plan: Plan, mesh, abstract,
                 compiled: CompiledPlan, budget: int, donate: bool = True,
                 overlap: bool = True) -> CompiledPlan:
    """``compiled``, or where it is the regathered program with each gradient tied in and
    fits ``budget`` with room R to spare, that program with the gradients tied in by buckets
    of R / 2 bytes (``compile_plan(..., settle_bytes=...)``: each bucket's all-reduces merged
    into one, its gradients held unreduced until then beside their reduced copies), whichever
    :func:`fastest_program` chooses within the budget. One compile more; the decorator's
    budget search leaves it out of its trials. On the demo's plan (GPT, hidden 256, 2x4,
    17,362,608 B): 7 all-reduces instead of 11 and an estimated 0.4447 ms instead of
    0.4671, at the same memory (16,773,876 B)."""
    headroom = budget - compiled.memory.peak_bytes
    if compiled.program != "regathered" or compiled.settle_bytes or headroom <= 0 \
            or (overlap and plan.hidden_under):
        return compiled
    bucketed = compile_plan(traced, build, plan, mesh, abstract, donate, overlap,
                            regather=True, settle=True, settle_bytes=headroom // 2)
    return fastest_program([compiled, dataclasses.replace(
        bucketed, program="regathered", settle_bytes=headroom // 2)], budget, mesh,
        build.cluster)


def with_export(train_step, args: tuple, traced: TracedStep, build: ProblemBuild, plan: Plan,
                mesh, compiled: CompiledPlan, budget: int, donate: bool = True) -> CompiledPlan:
    """On a mesh, ``compiled`` (a program of ``plan``) or the plan as its export
    (:func:`compile_exported`), whichever :func:`fastest_program` chooses within ``budget``;
    ``compiled`` where no block of the plan recomputes anything, on one device (where
    :func:`compile_applied` weighs the export itself), where its layers are not block
    modules, or where the export does not compile (a warning says why). Where no block
    recomputes, the export is the plan's shardings at the blocks' boundaries only, and it was
    slower: the zoo Llama (dim 1024) on 4x2 at 768,787,084 B, whose plan recomputes two values
    outside its blocks, 25.009 ms at 769,901,964 B as its export against 23.893 ms at
    692,311,308 B value by value (docs/apply.md)."""
    if mesh.devices.size == 1 or compiled.program == "blocks":
        return compiled
    export = _block_export(traced, build, plan, mesh)
    if export is None:
        return compiled
    try:
        blocks = compile_exported(train_step, args, mesh, export, donate)
    except BlockPolicyError:
        return compiled
    except Exception as error:  # noqa: BLE001 - an optional program: the plan's own stands
        log.warning("kiwi's plan as its export did not compile, so it is not compared: %s: %s",
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return compiled
    return fastest_program([compiled, blocks], budget, mesh, build.cluster)


def fastest_program(programs: list[CompiledPlan], budget: int, mesh, cluster) -> CompiledPlan:
    """Of ``programs`` (compiled steps of one plan), the one the compiled-cost estimate
    (:func:`kiwi_jax.estimate.compiled_cost`) puts fastest among those within ``budget``; the
    earlier one at a tie; the smallest where none is within it."""
    fitting = [p for p in programs if p.memory.peak_bytes <= budget]
    if len(fitting) <= 1:
        chosen = fitting[0] if fitting else min(programs, key=lambda p: p.memory.peak_bytes)
        if len(programs) > 1:
            log.info("the plan's programs: %s; budget %s B; %s runs", ", ".join(
                f"{p.label} at {p.memory.peak_bytes:,} B" for p in programs),
                f"{budget:,}", chosen.label)
        return chosen
    seconds = [compiled_cost(p.compiled, mesh, cluster).step_seconds for p in fitting]
    best = min(range(len(fitting)), key=lambda k: seconds[k])
    log.info("the plan's programs within the budget: %s; %s runs", ", ".join(
        f"{p.label} {s * 1e3:.4f} ms at {p.memory.peak_bytes:,} B"
        for p, s in zip(fitting, seconds)), fitting[best].label)
    return fitting[best]


def _constraint(mesh, spec):
    """A sharding constraint to ``spec`` on arrays of its rank (others pass unchanged)."""
    sharding = NamedSharding(mesh, PartitionSpec(*spec))

    def constrain(x):
        if getattr(x, "ndim", None) != len(spec):
            return x
        return jax.lax.with_sharding_constraint(x, sharding)
    return constrain


def leaf_paths(args) -> list[str]:
    """Per leaf of ``args``, its path (``0/0/blocks/0/attn/query/kernel/value``)."""
    return ["/".join(str(c) for c in p[1:]) for p in argument_paths(*args)]


def _equation(jaxpr, path: str):
    """The equation at an interpreter path (``12``, ``12s4_3``)."""
    eqn = None
    for index, _ in re.findall(r"(\d+)(s\d+)?", path):
        eqn = jaxpr.eqns[int(index)]
        body = scan_body(eqn) or inlined_call(eqn)
        jaxpr = body[0] if body else None
    return eqn


def _unit(key: tuple | None, op_name: str) -> tuple | None:
    """``(path, output index)`` of the recompute unit a node is (``key``, its equation output)
    or is inside (from its ``op_name``'s tag; index None), None when untagged."""
    if key is not None and is_unit(key[0]):
        return key
    path = unit_of(tag_of(op_name) if key is None else key[0])
    return (path, None) if path else None


def _output_operations(eqn) -> list[str]:
    """The operations a policy sees for ``eqn``'s outputs: its own, or, for a call JAX
    partially evaluates equation by equation (``jit``), those of the body's equations that
    produce the call's outputs."""
    body = inlined_call(eqn)
    if body is None:
        return [_operation_of(eqn)]
    made = {v: e for e in body[0].eqns for v in e.outvars}
    out = []
    for var in body[0].outvars:
        if var in made:
            out += _output_operations(made[var])
    return out


def _names(closed) -> dict:
    """``(path, output index) -> name`` of the values a ``checkpoint_name`` names, at the top
    level and in unrolled scan bodies (the interpreter's paths)."""
    out = {}

    def visit(jaxpr, prefix):
        made = {}
        for index, eqn in enumerate(jaxpr.eqns):
            path = f"{prefix}_{index}" if prefix else str(index)
            for k, var in enumerate(eqn.outvars):
                made[var] = (path, k)
            if eqn.primitive.name == "name" and eqn.invars[0] in made:
                out[made[eqn.invars[0]]] = eqn.params["name"]
            scan = scan_body(eqn)
            if scan is not None:
                for i in range(scan[2]):
                    visit(scan[0], f"{path}s{i}")
    visit(closed.jaxpr, "")
    return out


def export_plan(traced: TracedStep, build: ProblemBuild, plan: Plan, mesh) -> PlanExport:
    """The export of ``plan``, solved on ``build`` for ``traced`` on ``mesh``."""
    graph = traced.graph
    axes = tuple(mesh.axis_names)
    specs = {path: of_value(to_partition_spec(plan.specs[node], axes), aval)
             for path, node, aval in zip(leaf_paths(traced.pure.args), graph.parameters,
                                         traced.closed.in_avals)}

    rules = fused_values(graph)
    if build.memory_model == "fused":
        # followers from the rules, as the decorator applies the plan (kiwi_jax.compile); what
        # holds nothing from the build: the rules less what the compiled reference stores
        recompute, fused = recomputed_values(graph, plan.recomputed, rules), build.fused
    else:
        recompute, fused = recomputed_values(graph, plan.recomputed), rules
    # what the backward pass (and each recomputation) reads once XLA fused what it fuses
    held = held_operands(graph, fused)
    read_back = sorted({v for w in graph.nodes if w.phase != Phase.FORWARD or w.id in recompute
                        for v in held[w.id]})
    named, paths = _names(traced.closed), traced.node_paths()
    saved = collections.defaultdict(lambda: (set(), set()))
    dropped = collections.defaultdict(lambda: (set(), set()))
    saved_bytes, recomputed = collections.Counter(), collections.Counter()
    for node in read_back:
        value = graph.nodes[node]
        unit = _unit(paths.get(node), value.op_name)
        if value.layer < 0 or value.phase != Phase.FORWARD or unit is None:
            continue
        keep = node not in recompute
        by_name, by_operation = (saved if keep else dropped)[value.layer]
        if unit in named:
            by_name.add(named[unit])
        else:
            by_operation.update(_output_operations(_equation(traced.closed.jaxpr, unit[0])))
        if keep:
            saved_bytes[value.layer] += value.shape.nbytes
        else:
            recomputed[value.layer] += 1
    blocks, inputs = _blocks(traced), _layer_inputs(graph)
    layers = []
    for layer in sorted(set(saved) | set(dropped)):
        kept_names, kept_ops = saved[layer]
        boundary = None if layer not in inputs else \
            tuple(to_partition_spec(plan.specs[inputs[layer]], axes))
        layers.append(LayerPolicy(
            layer, blocks.get(layer, ()), tuple(sorted(kept_names)), tuple(sorted(kept_ops)),
            saved_bytes[layer], recomputed[layer],
            tuple(sorted(kept_ops & dropped[layer][1])), boundary))
    return PlanExport(axes, specs, tuple(layers), jax.tree.structure(traced.pure.args))


def _layer_inputs(graph) -> dict[int, int]:
    """``layer -> node``: the layer's input activation, the largest forward value from outside
    the layer that its forward operators read and that has the dimensions of one the layer
    hands on (a residual stream; not a mask made once for every layer)."""
    def crossing(reader, value) -> bool:
        return (reader.phase == value.phase == Phase.FORWARD and value.layer != reader.layer
                and bool(value.shape.dims))

    handed_on: dict[int, set] = {}
    for node in graph.nodes:
        for o in node.operands:
            value = graph.nodes[o]
            if value.layer >= 0 and crossing(node, value):
                handed_on.setdefault(value.layer, set()).add(value.shape.dims)
    out: dict[int, int] = {}
    for node in graph.nodes:
        if node.layer < 0:
            continue
        for o in node.operands:
            value = graph.nodes[o]
            if crossing(node, value) and value.shape.dims in handed_on.get(node.layer, ()) \
                    and (node.layer not in out
                         or value.shape.nbytes > graph.nodes[out[node.layer]].shape.nbytes):
                out[node.layer] = o
    return out


def _blocks(traced: TracedStep) -> dict[int, tuple]:
    """``layer -> block module path``: the blocks of the parameter tree
    (:func:`kiwi_jax.recipe_remat.block_paths`), each numbered by the layer of the graph's
    parameters under it."""
    leaves = state_leaves(traced.pure)
    out = {}
    for block in block_paths(leaves, traced.pure.args):
        key = tuple(str(c) for c in block)
        layers = {traced.graph.nodes[traced.graph.parameters[i]].layer
                  for i, k in enumerate(leaves.param_key)
                  if k is not None and tuple(str(c) for c in k[:len(key)]) == key}
        layers.discard(-1)
        if len(layers) == 1:
            out[layers.pop()] = block
    return out


"""The costed sharding + rematerialisation problem: everything a solver needs, in numpy.

This module imports nothing from jax: a problem can be saved, loaded and solved on a machine
without an accelerator stack.

References:
  KIWI (Liu et al.), eq. 2-11: strategies s_i with costs c_i, d_i and memory mem_i, resharding
  matrices R_ji on edges, z_i, live_i and the sets X, L, Y; Alpa (Zheng et al.), sec. 4.2
  (merged follower nodes share one strategy variable).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging

import numpy as np

from solvers.phase import Phase

__all__ = ["ShardingProblem"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardingProblem:
    """A train step's operators, their sharding strategies and costs on one mesh."""

    names: tuple[str, ...]
    """Stable node ids (HLO instruction names), topological order."""
    opcodes: tuple[str, ...]
    """HLO opcode per node."""
    phase: np.ndarray
    """int8 per node: the :class:`~solvers.phase.Phase` value."""
    layer: np.ndarray
    """int per node: repeated-layer index, -1 outside layers."""
    strategy_names: tuple[tuple[str, ...], ...]
    """Per node, a readable name of each strategy."""
    compute: tuple[np.ndarray, ...]
    """Per node, compute seconds of each strategy (c_i)."""
    comm: tuple[np.ndarray, ...]
    """Per node, seconds of the operator's own collectives for each strategy (d_i)."""
    memory: tuple[np.ndarray, ...]
    """Per node, per-device output bytes of each strategy (mem_i)."""
    edges: np.ndarray
    """int (E, 3): source node, destination node, operand slot."""
    resharding: tuple[np.ndarray, ...]
    """Per edge, seconds to reshard: [source strategy, destination strategy] (R_ji)."""
    z: np.ndarray
    """bool per node: forward node read by the backward pass (z_i)."""
    live: np.ndarray
    """int per node: last reader (live_i); |V| for outputs."""
    fwd_last_use: np.ndarray
    """int per node: last forward reader of a forward node (defines L_t); -1 otherwise."""
    first_bwd_use: np.ndarray
    """int per node: first backward reader of a forward node with z (defines X_t); -1 otherwise."""
    is_output: np.ndarray
    """bool per node: returned by the step."""
    mesh_shape: tuple[int, int]
    """The mesh the costs are for."""
    flops: np.ndarray
    """float per node: total FLOPs of the unsharded operator."""
    peak_flops: float
    """Device peak FLOP/s (for the ideal-compute lower bound)."""
    leader: np.ndarray = None
    """int per node: node whose strategy variable decides this node's strategy (itself when not
    merged)."""
    follow: tuple[np.ndarray, ...] = None
    """Per node: for each strategy of its leader, the strategy this node takes."""
    op_names: tuple[str, ...] = ()
    """Per node, the JAX op_name path (name scopes such as ``layer_0/attention_core``); used by
    scope-based heuristics. Empty when unknown."""
    uses: np.ndarray | None = None
    """int (U, 2): (value, reader) pairs, the reader needing the value alive when it runs: the
    memory semantics of the edges. A value the compiler fuses into its readers (no buffer, no
    memory) is resolved to the values it reads; see :func:`hlo_tools.liveness.held_operands`.
    Default: the edges' (source, destination) pairs."""
    ties: np.ndarray | None = None
    """int per node: the node of the first repeated layer whose decisions it copies under layer
    reuse (itself when untied), as :func:`solvers.reuse.layer_ties` finds them. Filled where
    problems are built (``kiwi_jax.build_problem``, :mod:`solvers.synthetic`, :meth:`load`,
    through :func:`solvers.reuse.with_layer_ties`). Default: the identity, nothing tied, so that
    ``reuse_layers`` solves such a problem untied. ``dataclasses.replace`` copies it: after
    changing names, phases, costs or memory, fill it again with ``with_layer_ties``."""
    carried: np.ndarray | None = None
    """int (C, 2): (updated state value, parameter) pairs: the step returns the value as the
    parameter's next value, in the parameter's spec (the next step reads it in place), so a
    value in another spec is resharded at the end of every step. Priced like an edge into the
    parameter (:attr:`carried_resharding`); not data flow: no memory, no order. Default:
    none (a step that carries no state, or a problem built without knowing it)."""
    carried_resharding: tuple[np.ndarray, ...] = ()
    """Per carried pair, seconds to reshard: [value strategy, parameter strategy]."""
    gathered: tuple[np.ndarray, ...] = ()
    """Per edge, per-device bytes of the operand copy its resharding makes: [source strategy,
    destination strategy]. An operand all-gathered or exchanged (all-to-all) for its reader is
    a new buffer, alive while the reader runs (:meth:`gathered_of`); a slice is fused into the
    reader and holds nothing. Empty: no edge makes a copy (a problem built without them)."""

    def __post_init__(self):
        n = len(self.names)
        if self.leader is None:
            object.__setattr__(self, "leader", np.arange(n))
        if self.follow is None:
            object.__setattr__(self, "follow",
                               tuple(np.arange(len(c)) for c in self.compute))
        if self.uses is None:
            pairs = np.asarray(self.edges, np.int64).reshape(-1, 3)[:, :2]
            object.__setattr__(self, "uses", np.array(list(dict.fromkeys(map(tuple, pairs))),
                                                      np.int64).reshape(-1, 2))
        if self.ties is None:
            object.__setattr__(self, "ties", np.arange(n))
        carried = np.zeros((0, 2), np.int64) if self.carried is None else self.carried
        object.__setattr__(self, "carried", np.asarray(carried, np.int64).reshape(-1, 2))
        if len(self.carried) != len(self.carried_resharding):
            raise ValueError(f"{len(self.carried)} carried pairs but "
                             f"{len(self.carried_resharding)} matrices")
        if len(self.ties) != n:
            raise ValueError(f"ties has {len(self.ties)} entries for {n} nodes; expected one per "
                             "node (solvers.reuse.with_layer_ties fills it)")
        for field in ("compute", "comm", "memory", "strategy_names"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"{field} has {len(getattr(self, field))} entries for {n} nodes")
        if len(self.edges) != len(self.resharding):
            raise ValueError(f"{len(self.edges)} edges but {len(self.resharding)} matrices")
        if self.gathered and len(self.gathered) != len(self.edges):
            raise ValueError(f"{len(self.edges)} edges but {len(self.gathered)} matrices of "
                             "gathered bytes; expected one per edge, or none")

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    @functools.cached_property
    def digest(self) -> str:
        """A digest of everything the problem holds (what :meth:`save` writes): equal for two
        problems built alike, as each trace of one step builds its own, so an answer kept for
        one serves the other."""
        digest = hashlib.sha256(repr((self.names, self.opcodes, self.strategy_names,
                                      self.op_names, self.mesh_shape, self.peak_flops)).encode())
        for array in (self.phase, self.layer, self.edges, self.z, self.live, self.fwd_last_use,
                      self.first_bwd_use, self.is_output, self.flops, self.leader, self.uses,
                      self.ties, self.carried, *self.compute, *self.comm, *self.memory,
                      *self.follow, *self.resharding, *self.carried_resharding, *self.gathered):
            array = np.ascontiguousarray(array)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    @property
    def num_devices(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    @property
    def num_strategies(self) -> np.ndarray:
        return np.array([len(c) for c in self.compute])

    @functools.cached_property
    def recomputable(self) -> np.ndarray:
        """bool per node: forward values that may be dropped after the forward pass and
        recomputed for the backward pass. KIWI's z_i, less the values a backward reader needs
        before the last forward reader is done with them: those are alive throughout, dropping
        them frees nothing, and counting their two lifetime parts separately would count the
        overlap twice."""
        return (self.phase == Phase.FORWARD) & self.z \
            & (self.first_bwd_use > self.fwd_last_use)

    def chained(self, src: int, dst: int) -> bool:
        """Whether a dropped ``dst`` may be recomputed from a dropped ``src``: both are
        droppable values (:attr:`droppable`) of the same layer, and ``dst`` is recomputed in
        the layer's backward pass, after ``src``'s last forward reader: the two are recomputed
        together, as ``jax.checkpoint`` around a block recomputes (see
        :attr:`recompute_stage`). Elsewhere KIWI's eq. 9 holds: the inputs of a recomputed
        value are kept."""
        droppable, stage, block = self._recompute_plan
        return bool(droppable[src] and droppable[dst] and self.layer[src] >= 0
                    and self.layer[src] == self.layer[dst]
                    and stage[dst] >= block[dst] and stage[dst] > self.fwd_last_use[src])

    @property
    def droppable(self) -> np.ndarray:
        """bool per node: values the reduced program may drop after the forward pass. The
        :attr:`recomputable` ones, and forward values of a layer the backward pass does not
        read (a residual branch's output, a GELU's inner terms) that a droppable value of
        their layer reads: dropping one makes its layer's recomputation recompute it too (a
        chain), where keeping it would hold it until then."""
        return self._recompute_plan[0]

    @property
    def recompute_stage(self) -> np.ndarray:
        """int per node: the earliest stage in which a dropped value can be recomputed (-1 for
        values that are not droppable); the keep flags decide the stage itself
        (:meth:`dropped_stages`).

        Outside layers it is the stage of the value's first backward reader (KIWI's reduced
        semantics). Inside a layer a dropped value may be read by the recomputation of another
        dropped value of the layer (a chain, :meth:`chained`): the earliest of its first
        backward reader's stage and those of its droppable readers in the layer, where those
        come after its last forward reader (an earlier one reads the value before it is
        dropped).

        References:
          KIWI (Liu et al.), sec. 3.2 (X sets, eq. 9); Checkmate (Jain et al., 2020), sec. 4
          (a recomputation may read recomputed values).
        """
        return self._recompute_plan[1]

    @functools.cached_property
    def latest_recompute_stage(self) -> np.ndarray:
        """int per node: the latest stage a dropped value can be recomputed in (-1 for values
        that are not droppable): its first backward reader's, or, for a value the backward pass
        does not read, the latest of its chained readers'. With :attr:`recompute_stage` (the
        earliest) it brackets the stage the keep flags give (:meth:`dropped_stages`)."""
        droppable, recomputable = self.droppable, self.recomputable
        late = np.where(recomputable, self.first_bwd_use, -1)
        readers = self.readers()
        for i in reversed(range(self.num_nodes)):
            if droppable[i] and not recomputable[i]:
                late[i] = max(late[j] for j in readers[i] if self.chained(i, j))
        return late

    def dropped_stages(self, keep) -> dict[int, int]:
        """The stage each dropped value is recomputed in, given the keep flags: the earliest of
        its first backward reader's and those of the dropped values of its layer that chain
        from it (a value the backward pass does not read is recomputed only for such readers,
        and not at all without one)."""
        keep = np.asarray(keep, bool)
        droppable, recomputable = self.droppable, self.recomputable
        readers = self.readers()
        n = self.num_nodes
        stage: dict[int, int] = {}
        for i in reversed(range(n)):
            if keep[i] or not droppable[i]:
                continue
            first = int(self.first_bwd_use[i]) if recomputable[i] else n
            for j in readers[i]:
                if j in stage and self.chained(i, j) and stage[j] > self.fwd_last_use[i]:
                    first = min(first, stage[j])
            if first < n:
                stage[i] = first
        return stage

    @functools.cached_property
    def _recompute_plan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(:attr:`droppable`, :attr:`recompute_stage`, per node the first backward stage of
        its layer), computed in reverse topological order. A value's stage follows its
        droppable readers in the layer that are recomputed in the layer's backward pass (not
        those a backward reader needs earlier, such as a residual branch the final norm's
        gradient reads: chaining through those would recompute the whole layer there); a
        forward value the backward pass does not read is droppable when it has such a
        reader."""
        n = self.num_nodes
        recomputable = self.recomputable
        droppable = recomputable.copy()
        stage = np.where(recomputable, self.first_bwd_use, n)
        starts: dict[int, int] = {}
        for i in np.flatnonzero((self.phase == Phase.BACKWARD) & (self.layer >= 0)):
            starts.setdefault(int(self.layer[i]), int(i))
        block = np.array([starts.get(int(lay), n) if lay >= 0 else n for lay in self.layer])
        readers = self.readers()
        candidate = (self.phase == Phase.FORWARD) & (self.layer >= 0) & ~self.z \
            & ~self.is_output
        for i in reversed(range(n)):
            if self.layer[i] < 0 or not (recomputable[i] or candidate[i]):
                continue
            for j in readers[i]:
                if droppable[j] and self.layer[j] == self.layer[i] and stage[j] >= block[j] \
                        and self.fwd_last_use[i] < stage[j] < stage[i]:
                    stage[i] = stage[j]
            droppable[i] = stage[i] < n
        return droppable, np.where(droppable, stage, -1), block

    @property
    def leaders(self) -> np.ndarray:
        """Ids of the nodes that carry a strategy variable."""
        return np.flatnonzero(self.leader == np.arange(self.num_nodes))

    def operands(self) -> list[list[int]]:
        """Per node, the values it needs alive when it runs (``uses``, each once)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for src, dst in self.uses:
            out[int(dst)].append(int(src))
        return out

    def readers(self) -> list[list[int]]:
        """Per node, the nodes that need it alive when they run (``uses``, each once)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for src, dst in self.uses:
            out[int(src)].append(int(dst))
        return out

    def priced_pairs(self) -> list[tuple[int, int, np.ndarray]]:
        """``(source, destination, [source strategy, destination strategy] seconds)`` of every
        resharding the step pays: the edges, then the carried state (charged to the
        parameter). A list the problem keeps: not to be changed."""
        return self._priced_pairs

    @functools.cached_property
    def _priced_pairs(self) -> list[tuple[int, int, np.ndarray]]:
        return ([(int(src), int(dst), r) for (src, dst, _), r in zip(self.edges,
                                                                     self.resharding)]
                + [(int(v), int(p), r) for (v, p), r in zip(self.carried,
                                                            self.carried_resharding)])

    def costs_of(self, strategy) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(compute, own collectives, operand resharding)`` seconds per node under
        ``strategy`` (one strategy index per node); a parameter's resharding is that of its
        carried updated value (:attr:`carried`)."""
        strategy = np.asarray(strategy)
        compute = np.array([self.compute[i][s] for i, s in enumerate(strategy)])
        comm = np.array([self.comm[i][s] for i, s in enumerate(strategy)])
        reshard = np.zeros(self.num_nodes)
        for src, dst, matrix in self.priced_pairs():
            reshard[dst] += matrix[strategy[src], strategy[dst]]
        return compute, comm, reshard

    def gathered_of(self, strategy) -> np.ndarray:
        """Per node, the bytes of the operand copies its resharding makes under ``strategy``
        (:attr:`gathered`), held while the node runs."""
        strategy = np.asarray(strategy)
        out = np.zeros(self.num_nodes, np.int64)
        for (src, dst, _slot), matrix in zip(self.edges, self.gathered):
            out[dst] += matrix[strategy[src], strategy[dst]]
        return out

    def memory_of(self, strategy) -> np.ndarray:
        """Per-device output bytes per node under ``strategy``."""
        return np.array([self.memory[i][s] for i, s in enumerate(np.asarray(strategy))],
                        dtype=np.int64)

    def node_cost(self, i: int) -> np.ndarray:
        """c_i + d_i per strategy of node i."""
        return self.compute[i] + self.comm[i]

    def sets(self, which: str) -> dict[int, tuple[int, ...]]:
        """KIWI's X_t, L_t (forward nodes by first backward / last forward use) or Y_t
        (non-forward nodes by last use)."""
        if which == "X":
            key = self.first_bwd_use
        elif which == "L":
            key = self.fwd_last_use
        elif which == "Y":
            key = np.where(self.phase != Phase.FORWARD, self.live, -1)
        else:
            raise ValueError(f"expected 'X', 'L' or 'Y', got {which!r}")
        out: dict[int, list[int]] = {}
        for node, t in enumerate(key):
            if t >= 0:
                out.setdefault(int(t), []).append(node)
        return {t: tuple(v) for t, v in out.items()}

    def ideal_compute_seconds(self) -> float:
        """Total FLOPs / (devices x peak): the physical limit of any plan."""
        return float(self.flops.sum() / (self.num_devices * self.peak_flops))

    def summary(self) -> dict:
        """Sizes of the problem."""
        return {
            "nodes": self.num_nodes,
            "edges": int(len(self.edges)),
            "carried": int(len(self.carried)),
            "strategies_total": int(self.num_strategies.sum()),
            "nodes_after_merge": int(len(self.leaders)),
            "forward_nodes": int((self.phase == Phase.FORWARD).sum()),
            "backward_nodes": int((self.phase == Phase.BACKWARD).sum()),
            "optimizer_nodes": int((self.phase == Phase.OPTIMIZER).sum()),
            "param_nodes": int((self.phase == Phase.PARAM).sum()),
            "recomputable_nodes": int(self.recomputable.sum()),
            "mesh": f"{self.mesh_shape[0]}x{self.mesh_shape[1]}",
        }

    def save(self, path) -> None:
        """Write the problem to an ``.npz`` file."""
        arrays = {f"compute_{i}": c for i, c in enumerate(self.compute)}
        arrays.update({f"comm_{i}": c for i, c in enumerate(self.comm)})
        arrays.update({f"memory_{i}": c for i, c in enumerate(self.memory)})
        arrays.update({f"follow_{i}": c for i, c in enumerate(self.follow)})
        arrays.update({f"resharding_{e}": r for e, r in enumerate(self.resharding)})
        arrays.update({f"carried_resharding_{c}": r
                       for c, r in enumerate(self.carried_resharding)})
        arrays.update({f"gathered_{e}": g for e, g in enumerate(self.gathered)})
        np.savez_compressed(
            path, names=np.array(self.names), opcodes=np.array(self.opcodes), phase=self.phase,
            layer=self.layer, edges=self.edges, z=self.z, live=self.live,
            fwd_last_use=self.fwd_last_use, first_bwd_use=self.first_bwd_use,
            is_output=self.is_output, mesh_shape=np.array(self.mesh_shape), flops=self.flops,
            peak_flops=np.array(self.peak_flops), leader=self.leader, uses=self.uses,
            ties=self.ties, carried=self.carried,
            op_names=np.array(self.op_names, dtype=str),
            strategy_names=np.array(["\n".join(s) for s in self.strategy_names]), **arrays)

    @classmethod
    def load(cls, path) -> "ShardingProblem":
        """Read a problem written by :meth:`save`. A file written before problems carried their
        layer ties gets the identity (see :attr:`ties`), with a warning."""
        with np.load(path) as data:
            if "ties" not in data:
                log.warning("%s holds no layer ties (written before problems stored them): "
                            "nothing is tied; solvers.reuse.with_layer_ties(problem) finds them",
                            path)
            n, e = len(data["names"]), len(data["edges"])
            carried = data["carried"] if "carried" in data else np.zeros((0, 2), np.int64)
            return cls(
                names=tuple(data["names"].tolist()), opcodes=tuple(data["opcodes"].tolist()),
                phase=data["phase"], layer=data["layer"],
                strategy_names=tuple(tuple(s.split("\n")) for s in data["strategy_names"]),
                compute=tuple(data[f"compute_{i}"] for i in range(n)),
                comm=tuple(data[f"comm_{i}"] for i in range(n)),
                memory=tuple(data[f"memory_{i}"] for i in range(n)),
                edges=data["edges"], resharding=tuple(data[f"resharding_{k}"] for k in range(e)),
                z=data["z"], live=data["live"], fwd_last_use=data["fwd_last_use"],
                first_bwd_use=data["first_bwd_use"], is_output=data["is_output"],
                mesh_shape=tuple(int(v) for v in data["mesh_shape"]), flops=data["flops"],
                peak_flops=float(data["peak_flops"]), leader=data["leader"],
                follow=tuple(data[f"follow_{i}"] for i in range(n)),
                op_names=tuple(data["op_names"].tolist()),
                uses=data["uses"] if "uses" in data else None,
                ties=data["ties"] if "ties" in data else None, carried=carried,
                carried_resharding=tuple(data[f"carried_resharding_{c}"]
                                         for c in range(len(carried))),
                gathered=tuple(data[f"gathered_{k}"] for k in range(e)
                               if f"gathered_{k}" in data))

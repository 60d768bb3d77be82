"""One plan for every process of a multi-controller run (``jax.distributed``).

On several hosts every process runs the same SPMD program on its share of a global mesh, so
every process must apply the same plan: two processes on different plans issue different
collectives and wait for each other for ever (or compute something else). A solve under a
time limit is not reproducible (the incumbent at the deadline depends on how fast the machine
was), so the processes must not each solve on their own. Here process 0 plans (solves, or
loads its plan cache) and publishes the plan through the distributed runtime's key-value
store; the other processes read it instead of solving. Before the first step every process
publishes what it is about to run (the plan's fingerprint and the key of what it planned for:
step HLO, mesh, budget, solver options) and compares with every other process: a mismatch is
a :class:`PlanMismatchError` in every process, a process that does not answer in time a
:class:`PlanExchangeError`; neither ever hangs.

Inputs of the step are placed from each process's data (:func:`place`): a host array (numpy,
or a jax array on this process's devices) is taken to hold the full value, the same in every
process, and each process puts its own devices' shards; a global ``jax.Array`` (e.g. a batch
made by ``jax.make_array_from_process_local_data`` from each process's rows) is resharded to
the plan's sharding.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import zlib

import jax
import numpy as np

from kiwi_jax.sharding import is_prng_key

__all__ = ["PlanMismatchError", "PlanExchangeError", "Exchange", "exchange", "place",
           "to_host", "CHUNK_BYTES"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Largest value written to the key-value store at once (a plan is split into chunks)."""
PREFIX = "kiwi_jax/plan_exchange"
"""Key-value store directory of the exchanges."""


class PlanMismatchError(RuntimeError):
    """The processes of one run are about to apply different plans (or plans of different
    steps); raised in every process before the first step."""

    def __init__(self, records: dict):
        self.records = dict(records)
        rows = "; ".join(f"process {p}: plan {r.get('plan') or '(none)'} for "
                         f"{r.get('key')}" for p, r in sorted(self.records.items()))
        keys = {r.get("key") for r in self.records.values()}
        cause = ("they planned for different steps or options (step HLO, mesh, budget, solver "
                 "options): run the same program with the same arguments and options in every "
                 "process" if len(keys) > 1 else
                 "they planned the same step separately and their solves ended at different "
                 "plans: leave share_plan=True (process 0 plans, the others receive its plan) "
                 "or give every process the same plan cache")
        super().__init__(f"the {len(self.records)} processes are not on one plan ({rows}); "
                         f"{cause}")


class PlanExchangeError(RuntimeError):
    """A process did not publish its plan or fingerprint in time, or process 0 failed to
    plan."""


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The key-value store of a multi-process run, for the exchanges of one planned step."""

    client: object
    """The distributed runtime's key-value client (``key_value_set_bytes``,
    ``blocking_key_value_get_bytes``, ``key_value_increment``)."""
    process_id: int
    """This process's index (``jax.process_index()``)."""
    process_count: int
    """Number of processes (``jax.process_count()``)."""
    timeout_seconds: float
    """How long a process waits for another's answer."""
    round: int
    """Which exchange of this process this is (every process plans its steps in the same
    order, so the n-th exchange of each process is about the same step)."""

    @property
    def is_planner(self) -> bool:
        """Process 0 plans; the others receive."""
        return self.process_id == 0

    def _key(self, *parts) -> str:
        return "/".join([PREFIX, str(self.round), *map(str, parts)])

    def _get(self, key: str, timeout_seconds: float, waiting_for: str) -> bytes:
        try:
            return self.client.blocking_key_value_get_bytes(key, int(timeout_seconds * 1000))
        except Exception as error:      # the runtime raises its own error types on a timeout
            raise PlanExchangeError(
                f"process {self.process_id}: no answer from {waiting_for} within "
                f"{timeout_seconds:.0f} s ({type(error).__name__}: {error}); that process "
                "failed, is still planning, or runs another program: check its log, or raise "
                "sync_timeout if its planning takes longer") from error

    def publish_plan(self, plan_json: str | None, error: str | None = None) -> None:
        """Process 0: the plan (or the error that stopped it) for the other processes."""
        if self.process_count == 1:
            return
        data = zlib.compress((plan_json or "").encode())
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        for i, chunk in enumerate(chunks):
            self.client.key_value_set_bytes(self._key("plan", i), chunk)
        header = {"chunks": len(chunks), "error": error}
        self.client.key_value_set_bytes(self._key("plan"), json.dumps(header).encode(),
                                        allow_overwrite=True)

    def receive_plan(self, timeout_seconds: float) -> str:
        """A receiving process: process 0's plan JSON.

        Raises:
          PlanExchangeError: process 0 failed to plan, or published nothing in time.
        """
        header = json.loads(self._get(self._key("plan"), timeout_seconds, "process 0's plan"))
        if header["error"] is not None:
            raise PlanExchangeError(f"process 0 failed to plan this step, so process "
                                    f"{self.process_id} has no plan: {header['error']}")
        data = b"".join(self._get(self._key("plan", i), self.timeout_seconds, "process 0")
                        for i in range(header["chunks"]))
        return zlib.decompress(data).decode()

    def abandon(self, error: str, shared: bool) -> None:
        """This process failed to plan: tell the others (process 0's plan, when ``shared``, and
        this process's check) so that they raise at once instead of waiting."""
        if shared and self.is_planner:
            self.publish_plan(None, error)
        self.client.key_value_set_bytes(self._key("check", self.process_id), json.dumps(
            {"key": None, "plan": None, "error": error}).encode(), allow_overwrite=True)

    def check(self, key: str, plan_fingerprint: str | None) -> None:
        """Every process: publish what this process is about to run and compare it with every
        other process's.

        Raises:
          PlanMismatchError: the processes differ (raised in every process).
          PlanExchangeError: a process published nothing within ``timeout_seconds``.
        """
        mine = {"key": key, "plan": plan_fingerprint}
        self.client.key_value_set_bytes(self._key("check", self.process_id),
                                        json.dumps(mine).encode())
        records = {self.process_id: mine}
        for other in range(self.process_count):
            if other != self.process_id:
                records[other] = json.loads(self._get(
                    self._key("check", other), self.timeout_seconds,
                    f"process {other} (its plan fingerprint)"))
        failed = {p: r["error"] for p, r in records.items() if r.get("error")}
        if failed:
            raise PlanExchangeError("; ".join(f"process {p} failed to plan this step: {e}"
                                              for p, e in sorted(failed.items())))
        if len({(r["key"], r["plan"]) for r in records.values()}) > 1 or plan_fingerprint is None:
            raise PlanMismatchError(records)
        log.info("process %d: the %d processes run plan %s", self.process_id,
                 self.process_count, plan_fingerprint)


def exchange(timeout_seconds: float) -> Exchange | None:
    """The exchange for the next step this process plans, or None in a single-process run.

    Raises:
      PlanExchangeError: several processes but no distributed runtime to talk through.
    """
    if jax.process_count() == 1:
        return None
    from jax._src import distributed    # the runtime's key-value client (no public accessor)

    client = distributed.global_state.client
    if client is None:
        raise PlanExchangeError(
            f"{jax.process_count()} processes but no jax.distributed client: call "
            "jax.distributed.initialize(...) before planning")
    round_ = client.key_value_increment(f"{PREFIX}/rounds/{jax.process_index()}", 1)
    return Exchange(client, jax.process_index(), jax.process_count(), float(timeout_seconds),
                    int(round_))


def place(args, shardings):
    """Put the step's arguments on the devices with the plan's shardings.

    One process: ``jax.device_put``. Several: a global ``jax.Array`` is resharded; any other
    array (numpy, or a jax array on this process's devices) is taken to be the full value,
    the same in every process, and each process puts the shards of its own devices
    (``jax.make_array_from_process_local_data`` with the value's own shape as global shape).
    """
    if jax.process_count() == 1:
        return jax.device_put(args, shardings)

    def put(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == sharding else jax.device_put(x, sharding)
        value = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, value, value.shape)

    return jax.tree.map(put, args, shardings)


def to_host(tree):
    """The values of a tree of arrays as numpy, gathered from every process where an array is
    spread over several (a collective: every process must call it, in the same order); a PRNG
    key array as its key data."""
    from jax.experimental import multihost_utils

    def gather(x):
        if is_prng_key(x):
            x = jax.random.key_data(x)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(gather, tree)

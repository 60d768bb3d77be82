"""Several processes, one plan: the exchange through the key-value store (with an in-memory
store), and two real processes on this machine forming a 2x4 mesh of 4 CPU devices each."""

import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import kiwi_jax
from kiwi_jax import multihost
from kiwi_jax.multihost import Exchange, PlanExchangeError, PlanMismatchError
from kiwi_jax.verify import max_rel_diff
from multihost_models import MODELS

log = logging.getLogger(__name__)

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
ROOT = pathlib.Path(__file__).parents[2]
TIMEOUT = 240
"""Seconds the two processes of a test may take together before both are killed."""
BUDGET = "2MB"
"""Per-device budget of both models (a fixed size: no reference solve)."""
TIME_LIMIT = 30.0
"""Process 0's solver limit (the other process receives its plan, whatever it is)."""


class FakeStore:
    """The distributed runtime's key-value client, in memory, shared by threads."""

    def __init__(self):
        self.values, self.changed = {}, threading.Condition()

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        with self.changed:
            if key in self.values and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = bytes(value)
            self.changed.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.values[key]

    def key_value_increment(self, key, increment):
        with self.changed:
            self.values[key] = int(self.values.get(key, 0)) + increment
            return self.values[key]


def _in_threads(store, count, work, timeout=0.5):
    """Run ``work(exchange)`` as each of ``count`` processes; their results or errors."""
    results = {}

    def run(process_id):
        exchange = Exchange(store, process_id, count, timeout, round=1)
        try:
            results[process_id] = work(exchange)
        except Exception as error:  # noqa: BLE001  (the test inspects every outcome)
            results[process_id] = error

    threads = [threading.Thread(target=run, args=(p,)) for p in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads), "an exchange did not return"
    return results


def test_different_plans_raise_in_every_process_naming_both():
    plans = {0: "a1b2c3d4e5f60718", 1: "ffee00112233aabb"}
    start = time.perf_counter()
    results = _in_threads(FakeStore(), 2, lambda ex: ex.check("key", plans[ex.process_id]))
    assert time.perf_counter() - start < 5
    for process_id in (0, 1):
        error = results[process_id]
        assert isinstance(error, PlanMismatchError), error
        assert plans[0] in str(error) and plans[1] in str(error)
        assert "solves ended at different plans" in str(error)
        assert error.records[0]["plan"] == plans[0] and error.records[1]["plan"] == plans[1]


def test_the_same_plan_passes_and_different_steps_are_named():
    assert _in_threads(FakeStore(), 3, lambda ex: ex.check("key", "a1")) == {0: None, 1: None,
                                                                             2: None}
    results = _in_threads(FakeStore(), 2, lambda ex: ex.check(f"key{ex.process_id}", "a1"))
    assert all(isinstance(e, PlanMismatchError) and "different steps or options" in str(e)
               for e in results.values())


def test_a_process_that_never_answers_is_an_error_within_the_timeout():
    exchange = Exchange(FakeStore(), 1, 2, 0.3, round=1)
    start = time.perf_counter()
    with pytest.raises(PlanExchangeError, match="no answer from process 0's plan within 0 s"):
        exchange.receive_plan(0.3)
    with pytest.raises(PlanExchangeError, match="no answer from process 0 .its plan fingerprint"):
        exchange.check("key", "a1")
    assert time.perf_counter() - start < 3


def test_a_plan_travels_in_chunks_and_a_failure_reaches_the_others(monkeypatch):
    monkeypatch.setattr(multihost, "CHUNK_BYTES", 64)
    text = json.dumps({"plan": list(range(2000))})
    store = FakeStore()
    results = _in_threads(store, 2, lambda ex: ex.publish_plan(text) if ex.is_planner
                          else ex.receive_plan(2))
    assert results[1] == text
    assert sum(key.startswith(f"{multihost.PREFIX}/1/plan/") for key in store.values) > 2

    def fails(exchange):
        if exchange.is_planner:
            exchange.abandon("InfeasibleBudgetError: no plan fits 1000 bytes", shared=True)
            return None
        return exchange.receive_plan(2)

    results = _in_threads(FakeStore(), 2, fails)
    assert isinstance(results[1], PlanExchangeError)
    assert "process 0 failed to plan this step" in str(results[1])
    assert "no plan fits 1000 bytes" in str(results[1])


def test_one_process_has_no_exchange():
    assert multihost.exchange(1.0) is None


# ------------------------------------------------------------------ two real processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_processes(tmp_path, timeout, **config) -> list[dict]:
    """Start two worker processes (4 CPU devices each, one 2x4 mesh), wait at most
    ``timeout`` seconds for both, and return what each wrote; on a timeout kill both and
    fail."""
    port, procs = _free_port(), []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("XLA_FLAGS", None)
    for process_id in range(2):
        mine = {"process_id": process_id, "num_processes": 2, "port": port,
                "local_devices": 4, "out": str(tmp_path / f"out{process_id}.json"), **config}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(mine)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    deadline, logs = time.monotonic() + timeout, []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = [proc.communicate()[0][-2000:] for proc in procs]
        pytest.fail(f"the two processes did not finish within {timeout} s (killed); the last "
                    f"of their output:\n--- process 0\n{tails[0]}\n--- process 1\n{tails[1]}")
    outputs = []
    for process_id, (proc, log) in enumerate(zip(procs, logs)):
        path = tmp_path / f"out{process_id}.json"
        assert path.exists(), f"process {process_id} exited {proc.returncode}:\n{log[-3000:]}"
        outputs.append(json.loads(path.read_text()))
    return outputs


@pytest.mark.scenario
def test_two_processes_run_one_plan_like_one_process_on_eight_devices(tmp_path, mesh24):
    start = time.perf_counter()
    # the sharding-only solver: no plan of the reference GPT or this Llama comes near this
    # budget (kiwi's compile to 0.19-0.22 of it), and it solved the two in 4 s where kiwi took
    # 20 s; what travels is a plan all the same. One model, the user-style one: with the GPT
    # too, the test took 69 s of the suite.
    solver = {"solver": "alpa", "recipes": False}
    cache, options = tmp_path / "cache", dict(memory_budget=BUDGET, cluster="v100-nvlink",
                                              time_limit=TIME_LIMIT, mip_gap=1e-2,
                                              **solver)     # the processes' plan
    outputs = _run_processes(tmp_path, timeout=TIMEOUT, models=["llama"], steps=3,
                             cache_dir=str(cache), time_limit=TIME_LIMIT, budget=BUDGET,
                             options=solver)
    figures = {"processes_wall_seconds": time.perf_counter() - start,
               "process_seconds": [o["total_seconds"] for o in outputs]}
    assert [o["process_id"] for o in outputs] == [0, 1]
    assert all(o["devices"] == 8 and o["local_devices"] == 4 for o in outputs)
    first, second = (o["models"]["llama"] for o in outputs)
    assert first["fingerprint"] == second["fingerprint"]
    assert not first["received"] and second["received"]
    # one process on this process's 8 devices, with the plan process 0 cached
    train_step, args = MODELS["llama"]()
    step = kiwi_jax.optimize(train_step, mesh=mesh24, cache_dir=str(cache), **options)
    losses = [float(step(*args)) for _ in range(3)]
    assert step.prepared.cached and step.plan.fingerprint == first["fingerprint"]
    state = kiwi_jax.step.functionalize(train_step, args).args[0]
    single = [np.asarray(x) for x in jax.tree.leaves(state)]
    for process_id, output in enumerate((first, second)):
        loss_diff = max_rel_diff(np.array(output["losses"]), np.array(losses))
        state_diff = max_rel_diff([np.array(x) for x in output["state"]], single)
        figures[f"llama/{process_id}"] = {
            "loss_rel_diff": loss_diff, "state_rel_diff": state_diff,
            **{k: output[k] for k in ("plan_seconds", "compile_seconds", "step_seconds")}}
        assert loss_diff <= 1e-5 and state_diff <= 1e-5, figures
    figures["test_seconds"] = time.perf_counter() - start
    log.info("two processes vs one: %s", json.dumps(figures))


def test_processes_planning_alone_to_different_plans_fail_at_the_check(tmp_path):
    # share_plan=False and a budget that differs between the processes: each plans its own
    # step; the check before the first step turns what would hang into an error in both
    start = time.perf_counter()
    outputs = _run_processes(tmp_path, timeout=TIMEOUT, models=["mlp"], steps=1,
                             cache_dir=False, time_limit=TIME_LIMIT, budget="50MB",
                             options={"solver": "alpa", "share_plan": False},
                             per_process={"1": {"memory_budget": "60MB"}})
    for output in outputs:
        error = output["error"]
        assert error["type"] == "PlanMismatchError", error
        assert "process 0: plan" in error["message"] and "process 1: plan" in error["message"]
        assert "different steps or options" in error["message"]
    log.info("mismatch raised in both processes after %.1f s",
             time.perf_counter() - start)

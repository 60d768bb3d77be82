"""One process of a multi-process kiwi-jax run on this machine (used by test_multihost.py).

    python tests/kiwi_jax/multihost_worker.py '<json config>'

The config names ``process_id``, ``num_processes``, ``port``, ``local_devices``, ``models``
(``llama`` or ``mlp``), ``steps``, ``cache_dir``, ``time_limit``, ``budget`` and
``out`` (a JSON file this process writes); optionally ``options`` (more keywords of
``kiwi_jax.optimize``) and ``per_process`` (``{process id: keywords}`` for one process only). Every process builds the same model from the same seed, joins
the global mesh through ``jax.distributed`` (CPU collectives through gloo), runs the optimized
step and writes its plan's fingerprint, the losses, the final parameters (gathered from every
process) and its timings.
"""

import json
import os
import sys
import time


def _setup(config):
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count="
                               f"{config['local_devices']}")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", config["local_devices"])
    jax.distributed.initialize(coordinator_address=f"localhost:{config['port']}",
                               num_processes=config["num_processes"],
                               process_id=config["process_id"],
                               initialization_timeout=config.get("init_timeout", 60))
    return jax


def main() -> int:
    config = json.loads(sys.argv[1])
    start = time.perf_counter()
    jax = _setup(config)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kiwi_jax
    from kiwi_jax.multihost import to_host
    from multihost_models import MODELS

    mesh = jax.make_mesh(tuple(config.get("mesh", (2, 4))), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    out = {"process_id": jax.process_index(), "process_count": jax.process_count(),
           "devices": jax.device_count(), "local_devices": jax.local_device_count(),
           "init_seconds": time.perf_counter() - start, "models": {}}
    options = dict(memory_budget=config["budget"], cluster="v100-nvlink",
                   time_limit=config["time_limit"], mip_gap=1e-2, cache_dir=config["cache_dir"],
                   **config.get("options", {}))
    options.update(config.get("per_process", {}).get(str(jax.process_index()), {}))
    for name in config["models"]:
        train_step, args = MODELS[name]()
        step = kiwi_jax.optimize(train_step, mesh=mesh, **options)
        t0 = time.perf_counter()
        losses, step_seconds = [], []
        for _ in range(config["steps"]):
            t = time.perf_counter()
            try:
                loss = step(*args)
            except (kiwi_jax.PlanMismatchError, kiwi_jax.PlanExchangeError) as error:
                out["error"] = {"type": type(error).__name__, "message": str(error),
                                "seconds": time.perf_counter() - t0}
                _write(config, out)
                return 1
            losses.append(float(to_host(loss)))
            step_seconds.append(time.perf_counter() - t)
        state = jax.tree.leaves(kiwi_jax.step.functionalize(train_step, args).args[0])
        params = [x.tolist() for x in to_host(state)]
        prepared = step.prepared
        out["models"][name] = {
            "fingerprint": step.plan.fingerprint, "status": step.plan.status,
            "cached": prepared.cached, "received": getattr(prepared, "received", None), "losses": losses, "state": params,
            "plan_seconds": prepared.plan_seconds, "compile_seconds": prepared.compile_seconds,
            "first_step_seconds": step_seconds[0], "step_seconds": step_seconds,
            "total_seconds": time.perf_counter() - t0}
    out["total_seconds"] = time.perf_counter() - start
    _write(config, out)
    jax.distributed.shutdown()
    return 0


def _write(config, out):
    with open(config["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.exit(main())

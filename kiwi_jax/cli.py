"""The ``kiwi-jax`` command line.

Subcommands:
  problem   build the costed sharding problem of a reference model and print its size.
  plan      solve it under a per-device memory budget with one of the solvers and check the
            plan with the simulator.
  pipeline  cut a deep model into pipeline stages (even, lynx, dawnpiper), plan each stage's
            recomputation under the budget and simulate the 1F1B step.
  verify    plan, apply and compile the step on the mesh (8 simulated CPU devices by default),
            compile the hand-written recipes too and keep the faster step that fits the budget
            (--no-recipes: kiwi's plan only), compare compiled memory and collectives with the
            plan and run the step that runs against the plain step.
  compare   compile the hand-written recipes (dp, fsdp, tp, fsdp+tp, each with no, dots-saveable
            or nothing-saveable per-block checkpointing) and kiwi's plans at a range of
            budgets; print compiled memory and estimated step per row.

Every subcommand prints a human-readable summary and, with ``--json``, a JSON object as the last
line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

__all__ = ["main"]

MODEL_FIELDS = ("layers", "hidden", "heads", "seq", "batch", "vocab", "width")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt", help="reference model: gpt, bert, mlp, "
                        "linen_mlp")
    parser.add_argument("--preset", default=None, help="config preset, e.g. 'kiwi'")
    for field in MODEL_FIELDS:
        parser.add_argument(f"--{field}", type=int, default=None)
    parser.add_argument("--mesh", default="2x4", help="2-D mesh shape, e.g. 2x4")
    parser.add_argument("--cluster", default="v100-nvlink",
                        help="cluster preset (v100-nvlink, v100-2node, a100-nvlink, a100-pcie, "
                        "h100), optionally with a slow-down such as v100-nvlink@10x")
    parser.add_argument("--memory-model", default="auto",
                        help="auto (default): values fused into their readers hold no memory "
                        "on one device; on a mesh, that model or the one where every "
                        "operator's output counts, whichever predicts the compiled reference "
                        "plan closer; fused or operator force one")
    parser.add_argument("--order", default="auto",
                        help="the schedule planned in: auto (default): the traced program's "
                        "order on one device, the order XLA prints the module on a mesh; "
                        "program or printed force one")
    parser.add_argument("--json", action="store_true", help="print a JSON summary last")


class UsageError(ValueError):
    """The command line asks for something that does not exist or cannot run here; the CLI
    prints the message and exits with 2 (any other exception is a bug and keeps its
    traceback)."""


def _reference(args):
    from kiwi_jax.models import build

    overrides = {f: getattr(args, f) for f in MODEL_FIELDS if getattr(args, f) is not None}
    try:
        return build(args.model, preset=args.preset, **overrides)
    except ValueError as error:
        raise UsageError(str(error)) from error


def _check_args(args) -> None:
    """Parse every option that names something (mesh, cluster, memory model, budget, solver,
    backend, verify's recipes) before any work, so a typo is a usage error rather than a
    failure later on."""
    import solvers
    from kiwi_jax.apply import check_order
    from kiwi_jax.choose import parse_recipes
    from kiwi_jax.cluster import Cluster, MeshSpec, parse_bytes
    from kiwi_jax.problem import check_memory_model

    try:
        MeshSpec.parse(args.mesh)
        Cluster.parse(args.cluster)
        check_memory_model(args.memory_model)
        check_order(args.order)
        budget = getattr(args, "budget", None)
        if budget is not None and not budget.strip().endswith("%"):
            parse_bytes(budget)
        if args.command == "verify":
            parse_recipes(_verify_recipes(args))
    except ValueError as error:
        raise UsageError(str(error)) from error
    solver = getattr(args, "solver", None)
    if solver is not None and solver not in solvers.SOLVERS:
        raise UsageError(f"unknown solver {solver!r}; expected one of "
                         f"{', '.join(solvers.SOLVERS)}")
    backend = getattr(args, "backend", None)
    if backend is not None and backend not in solvers.BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; expected one of "
                         f"{', '.join(solvers.BACKENDS)}")


def _cmd_problem(args) -> dict:
    from kiwi_jax.frontend import problem_for_step

    ref = _reference(args)
    build, timings = problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                                      mesh=args.mesh, cluster=args.cluster,
                                      merge=not args.no_merge, memory_model=args.memory_model,
                                      order=args.order)
    summary = build.problem.summary()
    summary.update(model=args.model, cluster=build.cluster.name,
                   unsupported_opcodes=build.unsupported,
                   ideal_compute_seconds=build.problem.ideal_compute_seconds(),
                   **{k: round(v, 3) for k, v in timings.items()})
    print(f"{args.model}: {summary['nodes']} operators ({summary['forward_nodes']} forward, "
          f"{summary['backward_nodes']} backward, {summary['optimizer_nodes']} optimizer, "
          f"{summary['param_nodes']} inputs), {summary['edges']} edges")
    print(f"mesh {summary['mesh']} on {build.cluster.name}: {summary['strategies_total']} "
          f"strategies, {summary['nodes_after_merge']} strategy variables after merging, "
          f"{summary['recomputable_nodes']} forward values read by the backward pass")
    print(f"lowered in {timings['lower_seconds']:.2f} s, built in "
          f"{timings['build_seconds']:.2f} s")
    return summary


def _cmd_plan(args) -> dict:
    import solvers
    from kiwi_jax.frontend import problem_for_step
    from kiwi_jax.plan import resolve_budget, solve_plan

    ref = _reference(args)
    build, timings = problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                                      mesh=args.mesh, cluster=args.cluster,
                                      memory_model=args.memory_model, order=args.order)
    problem = build.problem
    options = {"backend": args.backend, "time_limit": args.time_limit, "mip_gap": args.gap,
               "seed": args.seed, "threads": args.threads, "reuse_layers": args.reuse_layers}
    budget = resolve_budget(args.budget, problem, **options)
    out = {"solver": args.solver, "backend": args.backend, "model": args.model,
           "mesh": args.mesh, "cluster": build.cluster.name, "budget_bytes": budget,
           "reuse_layers": args.reuse_layers, "operators": problem.num_nodes,
           "ideal_compute_seconds": problem.ideal_compute_seconds(),
           **{k: round(v, 3) for k, v in timings.items()}}
    start = time.perf_counter()
    try:
        plan = solve_plan(build, budget, args.solver, **options)
    except solvers.InfeasibleBudgetError as err:
        print(f"kiwi-jax plan: {err}", file=sys.stderr)
        out.update(status="infeasible", feasible=False,
                   min_feasible_budget_bytes=err.min_feasible_bytes)
        return out
    except (solvers.SolverTimeoutError, solvers.SolverUnavailableError,
            solvers.SolverError) as err:
        print(f"kiwi-jax plan: {err}", file=sys.stderr)
        out.update(status="error", feasible=False, error=str(err))
        return out
    wall = time.perf_counter() - start
    out.update(plan.summary(), feasible=True, solve_wall_seconds=wall)
    print(f"{args.solver} on {args.model} ({problem.num_nodes} operators), mesh {args.mesh}, "
          f"{build.cluster.name}: {plan.status} in {wall:.2f} s, warm start included "
          f"({plan.solution.num_vars} variables, {plan.solution.num_constraints} constraints)")
    print(f"step {plan.predicted_step_seconds * 1e3:.3f} ms (ideal compute "
          f"{plan.ideal_compute_seconds * 1e3:.3f} ms, recomputation "
          f"{plan.simulation.recompute_seconds * 1e3:.3f} ms, {len(plan.recomputed)} values "
          f"recomputed); peak {plan.predicted_peak_bytes / 2**30:.3f} GiB of a "
          f"{budget / 2**30:.3f} GiB budget per device")
    return out


def _cmd_pipeline(args) -> dict:
    from kiwi_jax.cluster import parse_bytes
    from kiwi_jax.pipeline import model_profile
    from solvers.pipeline import partition

    config = {f: getattr(args, f) for f in ("hidden", "heads", "seq", "vocab")
              if getattr(args, f) is not None}
    start = time.perf_counter()
    profile = model_profile(args.model, layers=args.layers or 32, mesh=args.mesh,
                            cluster=args.cluster, micro_batch=args.batch,
                            time_limit=args.time_limit, **config)
    profile_seconds = time.perf_counter() - start
    budget = parse_bytes(args.budget)
    result = partition(profile, args.stages, args.micro_batches, budget, method=args.method,
                       policy=args.policy, backend=args.backend)
    out = {"model": args.model, "layers": profile.layers, "mesh": args.mesh,
           "cluster": args.cluster, "budget_bytes": budget, "stages": args.stages,
           "micro_batch": profile.micro_batch, "profile_seconds": profile_seconds,
           "feasible": result.fits, **result.summary()}
    print(f"{args.model}, {profile.layers} layers, micro-batch {profile.micro_batch} x "
          f"{args.micro_batches}, {args.stages} stages of mesh {args.mesh} ({args.cluster}); "
          f"{args.method} partition, {args.policy} recomputation, searched in "
          f"{result.search_seconds:.2f} s ({result.policies_solved} stage policies)")
    for plan in result.stages:
        state = f"{plan.step_seconds * 1e3:9.2f} ms" if plan.fits else "does not fit"
        print(f"  stage {plan.index}: {plan.layers:3d} layers, {plan.in_flight} in flight, "
              f"{state}, peak {plan.peak_bytes / 2**30:6.2f} GiB, recompute on demand "
              f"{plan.on_demand_seconds * 1e3:.2f} ms / hidden {plan.overlapped_seconds * 1e3:.2f}"
              " ms per micro-batch")
    if result.fits:
        print(f"1F1B step {result.step_seconds:.3f} s: {result.throughput:.3f} samples/s")
    else:
        print(f"a stage does not fit the {budget / 2**30:.2f} GiB budget: raise the budget, "
              "add stages or micro-batches, or use the lynx policy", file=sys.stderr)
    return out


def _initialize_distributed(args) -> None:
    """Join a multi-process run (``--coordinator``): CPU collectives through gloo, this
    process's devices, then ``jax.distributed.initialize``."""
    if args.coordinator is None:
        return
    import jax

    if args.process_id is None or args.num_processes is None:
        raise UsageError("--coordinator needs --num-processes and --process-id")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)


def _verify_recipes(args):
    """``verify``'s ``recipes`` option for the decorator: False (``--no-recipes``), the names
    given, or True (all)."""
    return False if args.no_recipes else tuple(args.recipes) if args.recipes else True


def _cmd_verify(args) -> dict:
    import jax

    import solvers
    from hlo_tools.compiled import device_memory
    from kiwi_jax.cluster import MeshSpec
    from kiwi_jax.optimize import optimize
    from kiwi_jax.step import functionalize

    if args.fit_seconds is not None and args.fit_seconds < 0:
        raise UsageError(f"--fit-seconds: expected seconds >= 0, got {args.fit_seconds:g}")
    ref = _reference(args)
    shape = MeshSpec.parse(args.mesh).shape
    _initialize_distributed(args)
    if jax.device_count() < shape[0] * shape[1]:
        raise UsageError(f"mesh {args.mesh} needs {shape[0] * shape[1]} devices, this process has "
                         f"{jax.device_count()}; on CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={shape[0] * shape[1]}")
    mesh = jax.make_mesh(shape, ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    step = optimize(ref.train_step, mesh=mesh, memory_budget=args.budget, cluster=args.cluster,
                    solver=args.solver, backend=args.backend, time_limit=args.time_limit,
                    mip_gap=args.gap, reuse_layers=args.reuse_layers,
                    cache_dir=False if args.no_cache else args.cache_dir,
                    memory_model=args.memory_model, order=args.order,
                    fit_compiles=args.fit_compiles, fit_seconds=args.fit_seconds,
                    recipes=_verify_recipes(args))
    concrete = (*ref.init(0), ref.batch(0))
    out = {"model": args.model, "mesh": args.mesh, "solver": args.solver,
           "cluster": args.cluster, "process_id": jax.process_index(),
           "process_count": jax.process_count()}
    start = time.perf_counter()
    try:
        report = step.verify(*concrete, steps=args.steps)
    except solvers.InfeasibleBudgetError as err:
        print(f"kiwi-jax verify: {err}", file=sys.stderr)
        out.update(status="infeasible", feasible=False,
                   min_feasible_budget_bytes=err.min_feasible_bytes)
        return out
    prepared = step.prepared
    pure = functionalize(ref.train_step, (*ref.abstract_init(), ref.abstract_batch()))
    plain = device_memory(jax.jit(pure.fn).lower(*pure.args).compile()).peak_bytes
    plan, choice = prepared.plan, prepared.choice
    out.update(plan.summary() if plan is not None else {}, **report.to_dict(), feasible=True,
               plain_compiled_peak_bytes=plain, plain_fits=plain <= report.budget_bytes,
               plan_seconds=prepared.plan_seconds, compile_seconds=prepared.compile_seconds,
               plan_cached=prepared.cached, plan_received=prepared.received,
               choice=None if choice is None else choice.to_dict(),
               verify_seconds=time.perf_counter() - start)
    if plan is not None:
        print(f"{args.solver} plan for {args.model} on a {args.mesh} mesh ({args.cluster}): "
              f"{plan.status}, {len(plan.recomputed)} forward values recomputed, predicted step "
              f"{plan.predicted_step_seconds * 1e3:.3f} ms; planned in "
              f"{prepared.plan_seconds:.1f} s{' (cached)' if prepared.cached else ''}, "
              f"compiled in {prepared.compile_seconds:.1f} s")
    if choice is not None:
        print(f"{choice.describe()}; {len(choice.recipes)} recipes compiled in "
              f"{choice.compile_seconds:.1f} s")
    print(f"plain step (one device, no plan): {plain / 2**20:.3f} MiB compiled, "
          f"{'fits' if plain <= report.budget_bytes else 'does not fit'} the "
          f"{report.budget_bytes / 2**20:.3f} MiB budget")
    print(report.table())
    if args.explain:
        step.explain()
    if args.png and plan is not None:
        from kiwi_jax.explain import plot_memory_timeline

        plot_memory_timeline(prepared.build, plan, args.png,
                             prepared.applied.memory.peak_bytes)
        print(f"memory timeline: {args.png}")
        out["png"] = args.png
    return out


def _mesh(args):
    """The ``data x model`` mesh of ``--mesh`` on this process's devices."""
    import jax

    from kiwi_jax.cluster import MeshSpec

    shape = MeshSpec.parse(args.mesh).shape
    if jax.device_count() < shape[0] * shape[1]:
        raise UsageError(f"mesh {args.mesh} needs {shape[0] * shape[1]} devices, this process has "
                         f"{jax.device_count()}; on CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={shape[0] * shape[1]}")
    return jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:shape[0] * shape[1]],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _compare_options(args) -> tuple[list, list | None]:
    """``--recipes`` and ``--budgets`` parsed, or a usage error naming the bad value."""
    from kiwi_jax.cluster import parse_bytes
    from kiwi_jax.recipes import Recipe

    try:
        recipes = [Recipe.parse(r) for r in args.recipes] if args.recipes else None
        budgets = [parse_bytes(b) for b in args.budgets] if args.budgets else None
    except ValueError as error:
        raise UsageError(f"{error} (recipes are SHARDING or SHARDING/POLICY, e.g. fsdp or "
                         "tp/nothing_saveable; budgets are sizes such as 6MiB)") from error
    if args.fit_compiles < 0:
        raise UsageError(f"--fit-compiles: expected a count >= 0, got {args.fit_compiles}")
    return recipes, budgets


def _cmd_compare(args) -> dict:
    from kiwi_jax.compare import compare

    recipes, budgets = _compare_options(args)
    ref = _reference(args)
    mesh = _mesh(args)

    def progress(row):
        state = row.error.splitlines()[0][:80] if row.error else \
            f"{row.compiled_bytes / 2**20:.3f} MiB, {row.step_seconds * 1e3:.4f} ms"
        print(f"  {row.name}: {state} ({row.seconds:.1f} s)", file=sys.stderr, flush=True)

    start = time.perf_counter()
    result = compare(ref.train_step, (*ref.abstract_init(), ref.abstract_batch()), mesh,
                     recipes=recipes, budgets=budgets, cluster=args.cluster,
                     fit_compiles=args.fit_compiles, time_limit=args.time_limit,
                     solver=args.solver, memory_model=args.memory_model, order=args.order,
                     progress=progress)
    print(f"{args.model} on a {args.mesh} mesh ({args.cluster}): compiled per-device memory and "
          "estimated step (compute + collectives of the compiled step)")
    print(result.table())
    out = {"model": args.model, "mesh": args.mesh, **result.to_dict(),
           "seconds": time.perf_counter() - start}
    if args.png:
        from kiwi_jax.compare import plot

        plot(result, args.png, f"{args.model}, mesh {args.mesh}")
        print(f"figure: {args.png}")
        out["png"] = args.png
    return out


def main(argv=None) -> int:
    from kiwi_jax.fit import FIT_COMPILES
    from solvers.options import SolverOptions

    defaults = SolverOptions()          # the solver defaults of solvers.solve and the decorator
    parser = argparse.ArgumentParser(prog="kiwi-jax", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    problem = sub.add_parser("problem", help="build and summarise the sharding problem")
    _model_args(problem)
    problem.add_argument("--no-merge", action="store_true", help="skip follower merging")
    problem.set_defaults(run=_cmd_problem)
    plan = sub.add_parser("plan", help="solve the problem under a memory budget")
    _model_args(plan)
    plan.add_argument("--budget", default="80%", help="per-device budget: bytes (6GiB) or a "
                      "percentage of the fastest no-limit alpa plan's predicted peak (80%%)")
    plan.add_argument("--solver", default=defaults.solver, help="alpa, alpa+dots, "
                      "alpa+megatron, alpa+full, kiwi, kiwi-full, lynx-heu, lynx-opt (the Lynx "
                      "solvers keep the reference plan's sharding); default %(default)s")
    plan.add_argument("--backend", default=defaults.backend,
                      help="highs (embedded), cpsat, gurobi; default %(default)s")
    plan.add_argument("--time-limit", type=float, default=defaults.time_limit,
                      help="solver seconds (default %(default)s)")
    plan.add_argument("--gap", type=float, default=defaults.mip_gap,
                      help="relative optimality gap (default %(default)s)")
    plan.add_argument("--seed", type=int, default=defaults.seed)
    plan.add_argument("--threads", type=int, default=defaults.threads)
    plan.add_argument("--reuse-layers", action=argparse.BooleanOptionalAction,
                      default=defaults.reuse_layers,
                      help="one decision per operator of identical layers (faster solves; "
                      "default %(default)s); --no-reuse-layers gives every operator its own "
                      "(lynx-heu needs reuse)")
    plan.set_defaults(run=_cmd_plan)
    pipe = sub.add_parser("pipeline", help="partition a deep model into pipeline stages")
    _model_args(pipe)
    pipe.set_defaults(model="gpt", mesh="1x4", cluster="a100-nvlink")
    pipe.add_argument("--stages", type=int, default=4, help="pipeline stages")
    pipe.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step "
                      "(--batch is the micro-batch size)")
    pipe.add_argument("--budget", default="40GiB", help="per-device budget in bytes (40GiB)")
    pipe.add_argument("--method", default="lynx", help="even, lynx, dawnpiper")
    pipe.add_argument("--policy", default="lynx", help="recomputation in every stage: lynx "
                      "(Lynx-HEU), full, selective, none")
    pipe.add_argument("--backend", default=defaults.backend,
                      help="highs (embedded), cpsat, gurobi; default %(default)s")
    pipe.add_argument("--time-limit", type=float, default=defaults.time_limit,
                      help="seconds for the sharding plan of the profiled layer")
    pipe.set_defaults(run=_cmd_pipeline)
    verify = sub.add_parser("verify", help="plan, apply, compile and check the step")
    _model_args(verify)
    verify.add_argument("--budget", default="60%", help="per-device budget: bytes (6GiB) or a "
                        "percentage of the fastest no-limit alpa plan's compiled memory (60%%)")
    verify.add_argument("--solver", default=defaults.solver, help="alpa, alpa+dots, "
                        "alpa+megatron, alpa+full, kiwi; default %(default)s")
    verify.add_argument("--backend", default=defaults.backend,
                        help="highs (embedded), cpsat, gurobi; default %(default)s")
    verify.add_argument("--time-limit", type=float, default=defaults.time_limit,
                        help="solver seconds (default %(default)s)")
    verify.add_argument("--gap", type=float, default=defaults.mip_gap,
                        help="relative optimality gap (default %(default)s)")
    verify.add_argument("--reuse-layers", action=argparse.BooleanOptionalAction,
                        default=defaults.reuse_layers,
                        help="one decision per operator of identical layers (faster solves; "
                        "default %(default)s)")
    verify.add_argument("--fit-compiles", type=int, default=FIT_COMPILES,
                        help="most compiles spent searching the solver's budget against the "
                        "compiled step (0: none; default %(default)s)")
    verify.add_argument("--fit-seconds", type=float, default=None,
                        help="seconds that search may run before it stops at the fastest plan "
                        "that fits once compiled (default: no deadline)")
    verify.add_argument("--recipes", nargs="+", default=None, metavar="RECIPE",
                        help="recipes compiled and set against kiwi's compiled plan, the "
                        "faster that fits the budget runs (default: all twelve)")
    verify.add_argument("--no-recipes", action="store_true",
                        help="run kiwi's plan without comparing the recipes")
    verify.add_argument("--steps", type=int, default=3, help="steps compared with the plain step")
    verify.add_argument("--explain", action="store_true", help="print the plan per layer")
    verify.add_argument("--png", default=None, help="write the memory timeline to this PNG")
    verify.add_argument("--cache-dir", default=None, help="plan cache (default "
                        "$KIWI_JAX_CACHE_DIR or ~/.cache/kiwi-jax)")
    verify.add_argument("--no-cache", action="store_true", help="always solve")
    verify.add_argument("--coordinator", default=None, help="several processes: "
                        "jax.distributed's coordinator address (host:port of process 0); "
                        "process 0 plans and the others receive its plan (docs/multi_host.md)")
    verify.add_argument("--num-processes", type=int, default=None,
                        help="with --coordinator: how many processes")
    verify.add_argument("--process-id", type=int, default=None,
                        help="with --coordinator: this process's index (0 plans)")
    verify.add_argument("--local-devices", type=int, default=None,
                        help="simulated CPU devices of this process (default 8; with several "
                        "processes, mesh devices / processes)")
    verify.set_defaults(run=_cmd_verify)
    compare = sub.add_parser("compare", help="compile the hand-written recipes and kiwi's "
                             "plans; compiled memory and estimated step of each")
    _model_args(compare)
    compare.add_argument("--recipes", nargs="+", default=None, metavar="RECIPE",
                         help="recipes to compile, SHARDING[/POLICY] (dp, fsdp, tp, fsdp+tp; "
                         "none, dots_saveable, nothing_saveable); default all twelve")
    compare.add_argument("--budgets", nargs="+", default=None, metavar="SIZE",
                         help="kiwi's per-device budgets (e.g. 6MiB 8MiB); default the "
                         "recipes' compiled memories (one plan each: the slow part)")
    compare.add_argument("--solver", default=defaults.solver,
                         help="kiwi's solver (default %(default)s)")
    compare.add_argument("--time-limit", type=float, default=defaults.time_limit,
                         help="solver seconds per plan (default %(default)s)")
    compare.add_argument("--fit-compiles", type=int, default=2,
                         help="most compiles per kiwi plan spent fitting the compiled step to "
                         "its budget (default %(default)s)")
    compare.add_argument("--png", default=None, help="write memory vs estimated step here")
    compare.set_defaults(run=_cmd_compare)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    local = getattr(args, "local_devices", None) or 8
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={local}")
    try:
        _check_args(args)
        result = args.run(args)
    except UsageError as err:
        print(f"kiwi-jax {args.command}: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str))
    return 0 if result.get("feasible", True) else 1


if __name__ == "__main__":
    sys.exit(main())

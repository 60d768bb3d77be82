"""Plans on disk, keyed by what they depend on: the step's HLO, the mesh, the budget, the cluster,
the solver and the cost model's version. A missing, unreadable or mismatched entry is a miss
(with a warning), never an error: the plan is then solved again and the entry rewritten."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
import warnings

from kiwi_jax.plan import Plan

__all__ = ["PlanCache", "default_cache_dir", "MODEL_VERSION"]

MODEL_VERSION = 4
"""The costs and memory plans are solved against; a change that moves plans bumps it, so a
cached plan of an earlier model is solved again (2: the carried state's resharding priced; 3:
the operand copies resharding makes held, convolutions sharded; 4: ``memory_model="auto"``
on a mesh chosen against the compiled reference plan)."""


def default_cache_dir() -> pathlib.Path:
    """``$KIWI_JAX_CACHE_DIR``, else ``~/.cache/kiwi-jax``."""
    return pathlib.Path(os.environ.get("KIWI_JAX_CACHE_DIR")
                        or pathlib.Path.home() / ".cache" / "kiwi-jax")


class PlanCache:
    """A directory of plans, one JSON file per key."""

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)

    @staticmethod
    def key(**fields) -> str:
        """A stable hash of the fields (strings, numbers, tuples) and :data:`MODEL_VERSION`."""
        fields = {**fields, "model_version": MODEL_VERSION}
        text = json.dumps({k: fields[k] for k in sorted(fields)}, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, key: str) -> pathlib.Path:
        return self.directory / f"plan-{key}.json"

    def load(self, key: str, node_names: tuple[str, ...]) -> Plan | None:
        """The cached plan, or None when there is none or it cannot be used."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            plan = Plan.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError) as error:
            warnings.warn(f"ignoring unreadable plan cache entry {path} ({error}); solving again",
                          stacklevel=3)
            return None
        if plan.node_names != tuple(node_names):
            warnings.warn(f"ignoring plan cache entry {path}: it is for a different graph; "
                          "solving again", stacklevel=3)
            return None
        return plan

    def store(self, key: str, plan: Plan) -> None:
        """Write atomically (a reader never sees half a file); a failure only warns."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.directory, delete=False,
                                             suffix=".tmp") as f:
                f.write(plan.to_json())
            os.replace(f.name, self.path(key))
        except OSError as error:
            warnings.warn(f"could not write the plan cache in {self.directory}: {error}",
                          stacklevel=3)

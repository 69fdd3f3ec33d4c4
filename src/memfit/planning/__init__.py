"""memfit.planning: the fastest configuration that fits a memory budget.

``space`` enumerates candidates, ``cost`` models step time, ``search`` ranks them (``plan()``,
``fallbacks()``), ``gpus`` reads the GPU table, ``table`` renders a result. The package is named
``planning`` (not ``plan``) so that it never shadows the public function ``memfit.plan``.
Submodules are imported lazily so ``import memfit.planning.gpus`` stays light.
"""

from __future__ import annotations

__all__ = ["plan", "fallbacks", "Constraints", "Plan", "PlanResult"]


def __getattr__(name: str):
    if name in ("plan", "fallbacks", "Plan", "PlanResult"):
        from memfit.planning import search

        return getattr(search, name)
    if name == "Constraints":
        from memfit.planning.space import Constraints

        return Constraints
    raise AttributeError(f"module 'memfit.planning' has no attribute {name!r}")

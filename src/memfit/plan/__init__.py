"""memfit.plan: the fastest configuration that fits a memory budget.

``space`` enumerates candidates, ``cost`` models step time, ``search`` ranks them (``plan()``,
``fallbacks()``), ``gpus`` reads the GPU table, ``table`` renders a result.

``memfit.plan(...)`` is the public function and ``memfit.plan`` is also this package: once any
``memfit.plan.*`` module is imported, the package shadows the function on the ``memfit`` module. So
the package is made callable and calling it calls ``search.plan``: both spellings keep working.
Submodules are imported lazily so ``import memfit.plan.gpus`` stays light.
"""

from __future__ import annotations

import sys
import types

__all__ = ["plan", "fallbacks", "Constraints", "Plan", "PlanResult"]


def __getattr__(name: str):
    if name in ("plan", "fallbacks", "Plan", "PlanResult"):
        from memfit.plan import search

        return getattr(search, name)
    if name == "Constraints":
        from memfit.plan.space import Constraints

        return Constraints
    raise AttributeError(f"module 'memfit.plan' has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from memfit.plan.search import plan

        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

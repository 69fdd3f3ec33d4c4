"""ZeRO-3's parameter coordinator settings, as a DeepSpeed config gives them: how long a gathered parameter stays.

DeepSpeed's ``PartitionedParameterCoordinator`` (``deepspeed/runtime/zero/partitioned_param_coordinator.py``)
gathers each module's parameters as it runs, prefetches the next ones and releases a module's parameters after
use unless the trace shows them used again within ``stage3_max_reuse_distance`` elements; what a step holds
gathered is priced from these three numbers (``memory.deepspeed_layout.coordinator_gathered``). A file's
``zero_optimization`` block sets them (``memfit.interop.common.deepspeed``); memfit's own runs keep DeepSpeed's
defaults, with Accelerate's ``"auto"`` prefetch (``training.deepspeed_engine.ds_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import UserError

#: DeepSpeed's defaults (``runtime/zero/config.py`` L245 ``max_live_parameters``, L251 ``max_reuse_distance``: 1e9;
#: L222 ``prefetch_bucket_size``: 5e7 where a config omits it).
DEFAULT_LIVE = DEFAULT_REUSE = 1_000_000_000
DEFAULT_PREFETCH = 50_000_000
KEYS = {"stage3_max_reuse_distance": "max_reuse_distance", "stage3_max_live_parameters": "max_live_parameters",
        "stage3_prefetch_bucket_size": "prefetch_bucket_size"}


@dataclass(frozen=True)
class Coordinator:
    """The ``zero_optimization`` settings of ZeRO-3's parameter coordinator, in elements."""

    max_reuse_distance: int = DEFAULT_REUSE
    """``stage3_max_reuse_distance``: a module's parameters stay gathered after use when the trace uses them again
    before this many elements of other modules' parameters (``__params_to_release``, L634-664)."""
    max_live_parameters: int = DEFAULT_LIVE
    """``stage3_max_live_parameters``: the prefetch stops where this many elements are gathered (L452-454)."""
    prefetch_bucket_size: int | None = None
    """``stage3_prefetch_bucket_size``: elements fetched ahead of the module computing (L452-484); None: ``"auto"``,
    which transformers and Accelerate fill with ``0.9 h^2`` (``integrations/deepspeed.py`` L236-240)."""

    @classmethod
    def of(cls, zero: dict) -> Coordinator:
        """From a DeepSpeed config's ``zero_optimization`` mapping (``"auto"``: what transformers fills in; a key
        left out: DeepSpeed's default)."""
        values: dict[str, int | None] = {"prefetch_bucket_size": DEFAULT_PREFETCH}
        for key, name in KEYS.items():
            value = zero.get(key)
            if value is None:
                continue
            if value == "auto":
                values[name] = None if name == "prefetch_bucket_size" else getattr(cls, name)
                continue
            try:
                number = int(float(value))
            except (TypeError, ValueError):
                raise UserError(f"zero_optimization.{key} must be a number of elements or 'auto', not {value!r}.") \
                    from None
            if number < 0:
                raise UserError(f"zero_optimization.{key} must be 0 or more, not {value!r}.")
            values[name] = number
        return cls(**values)

    def as_dict(self) -> dict[str, int | str]:
        """The settings under DeepSpeed's names, as ``of`` reads them back (``Stack.of``'s ``zero3``)."""
        return {key: "auto" if getattr(self, name) is None else getattr(self, name) for key, name in KEYS.items()}

    def describe(self) -> str:
        """``stage3_max_reuse_distance 100,000, stage3_max_live_parameters 1,000,000,000, ...``."""
        return ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in self.as_dict().items())

"""The router's balance, logged with each step of a mixture-of-experts run (``metrics.jsonl``).

A forward pre-hook on each experts module (transformers' ``use_experts_implementation`` modules,
``modelspec.expert_modules``) counts the experts its ``top_k_index`` argument routes to. At each log
the counts since the last one give, per MoE layer, the busiest expert's load over the balanced load
(tokens x k / E): 1.0 is perfectly balanced, E/k means one expert got every token. ``router_max_load``
is the worst layer's, ``router_mean_max_load`` the mean over layers. The estimate's activations assume
the balanced routing and its notes state the worst case (``memory/moe.py``): these say where a run is.
"""

from __future__ import annotations

import torch

from memfit.spec.model import expert_modules


class RouterBalance:
    """Counts of routed tokens per expert per MoE layer since the last ``take()``."""

    def __init__(self, model) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.counts: dict[int, object] = {}
        self.handles = [m.register_forward_pre_hook(self._counter(i)) for i, m in enumerate(expert_modules(base))]

    def _counter(self, layer: int):
        def count(module, args, kwargs=None) -> None:
            index = args[1] if len(args) > 1 else None
            if not isinstance(index, torch.Tensor):
                return
            hits = torch.bincount(index.detach().reshape(-1).cpu(), minlength=module.num_experts)
            self.counts[layer] = hits if layer not in self.counts else self.counts[layer] + hits

        return count

    def take(self) -> dict[str, float]:
        """``router_max_load`` and ``router_mean_max_load`` since the last call (empty when nothing was routed)."""
        loads = []
        for hits in self.counts.values():
            total = float(hits.sum())
            if total:
                loads.append(float(hits.max()) / (total / hits.numel()))
        self.counts.clear()
        if not loads:
            return {}
        return {"router_max_load": round(max(loads), 4), "router_mean_max_load": round(sum(loads) / len(loads), 4)}


def router_balance(model) -> RouterBalance | None:
    """A ``RouterBalance`` for a model with MoE layers, else None."""

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return RouterBalance(model) if expert_modules(base) else None

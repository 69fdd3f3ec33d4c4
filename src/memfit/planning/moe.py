"""What ``memfit plan`` says about a mixture-of-experts model: the routing margin its fit check added, which
parts LoRA adapts (and the price of attention only), and how FSDP2 splits the experts. Empty for a dense model.

The numbers are the planner's own (``search.plan`` passes its pricing of a configuration, ``search.evaluate``,
so this module does not import the search that calls it); the terms behind them are the estimate's
(``memory/moe.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from memfit.settings.config import RunConfig, Sharding
from memfit.units import fmt_bytes, fmt_gib

#: Projection names of a decoder layer's MLP side (dense MLPs, shared experts, their gates) across the
#: families memfit has met; every other projection of ``ModelSpec.linears`` is the attention's. A name not
#: listed here is counted as attention, so "attention only" can only over-count what it adapts.
MLP_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj", "shared_expert_gate", "w1", "w2", "w3",
                       "fc1", "fc2", "c_fc", "c_proj_mlp", "dense_h_to_4h", "dense_4h_to_h", "gate", "router"})


def attention_targets(spec) -> tuple[str, ...]:
    """The LoRA targets that adapt the attention only: ``spec.linears`` without the MLP side (``MLP_NAMES``)."""
    return tuple(lin.name for lin in spec.linears if lin.name not in MLP_NAMES and "expert" not in lin.name)


def moe_plan_lines(result, price: Callable[[RunConfig], object]) -> list[str]:
    """``memfit plan``'s lines for the chosen plan of ``result`` (a ``search.PlanResult``) of a mixture-of-experts
    model (none for a dense one); ``price``: a run's ``search.Plan`` on the same device and budget."""
    spec, best = result.spec, result.best
    if spec is None or not getattr(spec, "num_experts", 0):
        return []
    lines = [_routing_line(spec, best)]
    lora = _lora_line(result, price)
    if lora:
        lines.append(lora)
    run = best.config
    if run.num_processes > 1 and run.sharding is not Sharding.DDP:
        per_rank = -(-spec.num_experts // run.num_processes)  # FSDP2 splits dim 0 of (E, out, in), padding the last
        lines.append(f"Experts: {run.sharding} shards each stacked expert weight by expert over {run.num_processes} "
                     f"processes: {per_rank} of {spec.num_experts} experts per MoE layer on each rank, with their "
                     "gradients and optimizer state; a layer's experts are gathered whole while it computes.")
    return lines


def _routing_line(spec, best) -> str:
    run = best.config
    tokens = run.micro_batch * run.seq_len
    if not best.routing_bytes:
        return (f"Routing: {spec.num_experts} experts, {spec.experts_per_token} per token; the grouped kernel runs "
                "every token-expert pair at once, so routing moves no bytes (no margin added).")
    return (f"Routing: the estimate assumes balanced routing ({-(-tokens * spec.experts_per_token // spec.num_experts):,} "
            f"of {tokens:,} tokens per expert); the worst case (all {tokens:,} in one expert) adds "
            f"{fmt_bytes(best.routing_bytes)}, counted in the fit check: {fmt_gib(best.peak_bytes + best.routing_bytes)}.")


def _lora_line(result, price: Callable[[RunConfig], object]) -> str | None:
    """A LoRA plan's targets, trainable parameters and peak, beside attention only's where they differ, and
    whether PEFT adapts the stacked expert weights (its count differs from the projections' ``r (in + out)``
    where it wraps them: ``ModelSpec.trainable_params``); None for a full fine-tune (every expert trains)."""
    spec, best = result.spec, result.best
    run = best.config
    if not run.is_lora():
        return None
    chosen = spec.trainable_params(run)
    projections = sum(run.lora.r * (lin.in_features + lin.out_features) * lin.count
                      for lin in spec.lora_linears(run.lora.targets))
    experts = (f"PEFT also wraps the stacked expert weights ({spec.expert_params:,} parameters)" if chosen != projections
               else f"the {spec.expert_params:,} expert parameters stay frozen")
    attn = attention_targets(spec)
    alt_run = run.replace(lora_targets=attn)
    alt = spec.trainable_params(alt_run)
    head = (f"LoRA r{run.lora.r} on {','.join(run.lora.targets)}: {chosen:,} trainable, peak "
            f"{fmt_gib(best.peak_bytes)}")
    if alt == chosen:
        return f"{head}, the attention only ({','.join(attn)}); {experts}."
    other = price(alt_run)
    return (f"{head} ({experts}); attention only ({','.join(attn)}): {alt:,} trainable, peak "
            f"{fmt_gib(other.peak_bytes)}, {other.tokens_per_s:,.0f} tokens/s.")



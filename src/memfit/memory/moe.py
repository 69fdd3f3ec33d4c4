"""What a mixture-of-experts step holds that a dense one does not, term by term (notes of the estimate).

The bytes themselves are in the estimate's categories already (model states from the parameter counts,
activations from the traced recipe, ``memory/derive.py``); these lines say which part is the experts':

- every expert's weights, gradients and optimizer state (all ``E`` of every MoE layer, though each token
  visits ``k``): ``ModelSpec.expert_params`` at the run's bytes per parameter;
- the router: its logits (tokens x E, fp32 for the softmax) and top-k weights and indices per MoE layer;
  the load-balancing loss only when the config sets ``output_router_logits`` (then all layers' logits
  are concatenated: layers x tokens x E x 4 bytes);
- the dispatch: S = tokens x k token-expert pairs per layer; the experts' buffers are S rows of the
  hidden and expert widths whatever the routing (transformers' experts drop no token: there is no
  capacity factor), so routing changes only how they are split: balanced S/E pairs per expert, worst
  case every token in one expert (the per-expert loop's largest slice: tokens instead of S/E rows;
  grouped_mm runs all S rows at once, the same bytes either way);
- shared experts: dense MLPs on every token, counted with the layer's activations.

Known error: the worst-case margin counts one expert's up-projection output and activation (3 I wide
per row) at the compute bytes; the eager loop's other per-expert tensors are saved either way.
"""

from __future__ import annotations

from memfit.spec.resolved import experts
from memfit.units import fmt_bytes


def compute_bytes_of(run) -> int:
    """Bytes of an activation element: 2 under autocast or half weights, else 4."""
    return 2 if str(run.mixed_precision) != "no" or str(run.dtype) != "fp32" else 4


def routing_margin(spec, run, compute_bytes: int | None = None) -> int:
    """Bytes the worst routing adds over the balanced one the estimate assumes, per MoE layer's backward
    (0 for a dense model or the grouped kernel): every token of the micro-batch in one expert instead of
    ``tokens x k / E``, one expert's up-projection output and activation (3 x expert width per row) at the
    compute bytes, under the kernel ``run`` resolves to (``spec.resolved.experts``).

    Source: transformers' eager experts loop (``MixtralExperts.forward``: one slice of routed rows per
    expert, nothing dropped). Known error: the loop's other per-expert tensors are saved either way."""

    if not spec.num_experts or experts(spec, str(run.experts_implementation), str(run.dtype)) != "eager":
        return 0
    tokens = run.micro_batch * run.seq_len
    balanced = -(-tokens * spec.experts_per_token // spec.num_experts)
    width = 3 * spec.expert_intermediate * (compute_bytes or compute_bytes_of(run))
    return (tokens - balanced) * width


def moe_notes(spec, run, bytes_per_param: float, compute_bytes: int) -> list[str]:
    """The estimate's MoE lines for ``spec`` under ``run`` (empty for a dense model).

    ``bytes_per_param``: weights + gradients + optimizer state per trainable parameter of the run
    (frozen experts under LoRA: weights only); ``compute_bytes``: bytes of an activation element.
    """
    if not spec.num_experts:
        return []
    e, k, layers = spec.num_experts, spec.experts_per_token, spec.moe_layers
    tokens = run.micro_batch * run.seq_len
    pairs = tokens * k
    share = spec.expert_params / spec.params if spec.params else 0.0
    frozen = run.is_lora()
    states = spec.expert_params * (2 if str(run.dtype) != "fp32" else 4) if frozen else \
        spec.expert_params * bytes_per_param
    lines = [
        f"MoE: {e} experts per layer x {layers} layers, {k} per token; all of them are held: "
        f"{spec.expert_params:,} parameters ({share:.0%} of the model), "
        f"{fmt_bytes(int(states))} of {'frozen weights' if frozen else 'weights, gradients and optimizer state'}.",
        f"router: logits of {tokens:,} tokens x {e} experts per layer (fp32 for the softmax: "
        f"{fmt_bytes(tokens * e * 4 * layers)} over {layers} layers) plus top-{k} weights and indices; "
        + ("the load-balancing loss concatenates all layers' logits."
           if getattr(spec.hf_config, "output_router_logits", False)
           else "no load-balancing loss (output_router_logits is off)."),
    ]
    balanced = -(-pairs // e)
    margin = routing_margin(spec, run, compute_bytes)
    lines.append(
        f"dispatch: {pairs:,} token-expert pairs per layer ({tokens:,} tokens x {k}), no capacity limit "
        f"(no token dropped): balanced {balanced:,} per expert, worst case {tokens:,} in one expert; "
        + (f"routing margin (worst case over balanced, one expert's slice): +{fmt_bytes(margin)}, not in the peak."
           if margin else "grouped_mm runs all pairs at once: no routing margin."))
    if spec.shared_expert_params:
        lines.append(f"shared experts: {spec.shared_expert_params:,} parameters, run on every token "
                     "(activations as a dense MLP's).")
    return lines

"""The eager experts loop, as fake tensors can run it (``--exact`` and derived recipes of MoE models).

transformers' eager experts forward (``MixtralExperts.forward`` and its twins) asks which experts the
router hit (``nonzero``) and which tokens each got (``torch.where``): shapes that depend on the data,
which a fake tensor has none of (``DynamicOutputShapeException``). ``balanced_eager_forward`` runs the
same operators per expert, in the same order and under the same autocast (``F.linear``/``@`` on one
expert's weight slice: under AMP a bf16 copy of the slice, saved for backward; ``index_add_`` into the
output), on a routing whose shapes are known: the token-expert pairs sorted by expert (as grouped_mm
sorts them) and cut into ``num_experts`` equal slices, the **balanced** routing the load-balancing loss
trains towards.

Known error: exact for balanced routing; a skewed one moves tokens between experts without changing the
sum of their per-token tensors, so the saved bytes are the same and only a transient (one expert's
largest slice) grows; an expert that gets no token skips its weight copy under AMP (the stand-in counts
every expert's). The per-expert index tensors are int64 pairs as in eager (``torch.where``'s outputs).
"""

# Inside a function, in a try: transformers.integrations.moe (a transformers without MoE kernels has nothing to replace).
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _linear(x, weight, bias, transposed: bool):
    """One expert's projection as the eager loops write it: ``x @ W`` for (in, out) weights, else ``F.linear``."""

    out = x @ weight if transposed else F.linear(x, weight)
    return out + bias if bias is not None else out


def balanced_eager_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts loop over a balanced routing (module docstring). ``self``: a module
    built by transformers' ``use_experts_implementation`` (its ``has_gate``/``has_bias``/``is_transposed``
    flags and ``_apply_gate`` say how its stacked weights are applied)."""

    num_experts = self.num_experts
    num_top_k = top_k_index.size(-1)
    final = torch.zeros_like(hidden_states)  # (N, H)
    with torch.no_grad():  # eager's expert mask: (E + 1, k, N) int64, freed after the loop starts
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        _, perm = torch.sort(top_k_index.reshape(-1))  # (S,) token-expert pairs by expert
    pairs = perm.numel()
    del mask
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    for e in range(num_experts):
        chosen = perm[pairs * e // num_experts: pairs * (e + 1) // num_experts]
        top_k_pos, token_idx = chosen % num_top_k, chosen // num_top_k  # torch.where's two int64 tensors
        current = hidden_states[token_idx]  # (n_e, H)
        out = _linear(current, up[e], up_bias[e] if up_bias is not None else None, self.is_transposed)
        out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
        out = _linear(out, self.down_proj[e], self.down_proj_bias[e] if self.has_bias else None, self.is_transposed)
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


@contextlib.contextmanager
def traceable_experts():
    """While tracing: transformers' ``eager`` experts kernel runs ``balanced_eager_forward`` (a local entry
    of its experts interface, removed on exit; other kernels are traced as they are)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without MoE kernels: nothing to replace
        yield
        return
    ALL_EXPERTS_FUNCTIONS["eager"] = balanced_eager_forward
    try:
        yield
    finally:
        del ALL_EXPERTS_FUNCTIONS["eager"]

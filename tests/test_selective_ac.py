"""torchtitan's per-op selective checkpointing and FSDP2's MixedPrecisionPolicy, priced against real tensors.

The checkpointing is measured, not re-derived: a 3-layer transformers Llama in bf16 (what FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16)`` computes with: no autocast), each decoder layer run under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=False,
context_fn=create_selective_checkpoint_contexts(policy))`` with torchtitan's policy as its source writes it
(pytorch/torchtitan 9dec370 ``torchtitan/parallelisms/parallelize_llama.py`` L213-276, copied below), counted by
memfit's tensor counter (``memory.measure.counted``). Shape: B 2 x T 256 = 512 tokens, H 64, 4 heads of 32
(Q 128), 2 kv heads (K 64), I 176; every number compared is a sum of whole storages on the CPU, where nothing
allocates outside tensors, so the tolerance is zero bytes.

On the CPU, SDPA lowers to ``aten._scaled_dot_product_flash_attention_for_cpu``, which torchtitan's list does not
name (its CUDA kernels are ``_scaled_dot_product_flash_attention`` / ``_efficient_attention``): run as written, the
policy recomputes attention (memfit's rule for the CPU); with the CPU op added to the list it stands in for CUDA's
flash kernel (the same outputs kept: the attention output and the fp32 log-sum-exp), memfit's rule for CUDA.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.memory.activations import Precisions, layer_activations
from memfit.memory.autocast import autocast_weight_copies
from memfit.memory.measure import counted
from memfit.memory.stack_terms import gathered_in_compute_dtype, precisions, root_unit_kept
from memfit.memory.states import model_states
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack
from memfit.spec.model import load_spec, spec_from_config

B, T, H, MLP, LAYERS, HEADS, HEAD_DIM = 2, 256, 64, 176, 3, 4, 32
TOKENS = B * T
TORCHTITAN = Stack(trainer="torchtitan")

# torchtitan 9dec370 parallelize_llama.py L214-223 (TP's reduce-scatter and Float8's amax ops never run here)
SAVE_LIST = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops.aten.abs.default,
             torch.ops.aten.max.default}
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _torchtitan_context(save_list):
    """torchtitan's ``selective_checkpointing_context_fn`` (L250-270): a fresh count per checkpointed call."""
    def context_fn():
        meta = defaultdict(int)

        def _custom_policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count_key = f"{mode}_mm_count"
            if func == torch.ops.aten.mm.default:
                meta[mm_count_key] += 1
            to_save = func in save_list and not (func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(_custom_policy)
    return context_fn


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=128, hidden_size=H, intermediate_size=MLP, num_attention_heads=HEADS,
                         num_key_value_heads=2, head_dim=HEAD_DIM, num_hidden_layers=LAYERS,
                         max_position_embeddings=T, attn_implementation="sdpa")
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).to(torch.bfloat16)


def _measure(model, save_list) -> tuple[int, int]:
    """(bytes the layers keep after forward, bytes above that at backward's peak) of transformers' layers."""
    _, lm = model
    x = torch.randn(B, T, H, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(T).unsqueeze(0)
    cos, sin = lm.model.rotary_emb(x, positions)
    return _counted(lm.model.layers, x, [cos, sin], save_list, attention_mask=None, position_ids=positions,
                    position_embeddings=(cos, sin))


def _counted(layers, x, inputs: list, save_list, **kwargs) -> tuple[int, int]:
    """Each of ``layers`` run under torchtitan's policy on ``x`` (``inputs``: other tensors the caller holds): the
    bytes the layers keep after forward and the bytes above that at backward's peak, of the second of two runs."""
    params = [p for layer in layers for p in layer.parameters()]
    grad_out = torch.randn(B, T, H, dtype=torch.bfloat16)
    for _ in range(2):  # the second run: every parameter's .grad exists from the first (set to None again here)
        for p in params:
            p.grad = None
        with counted([params, x, inputs, grad_out]) as live:
            start = live.current
            h = x
            for layer in layers:
                h = checkpoint(layer, h, **kwargs, use_reentrant=False, preserve_rng_state=False,
                               context_fn=_torchtitan_context(save_list))
            after_forward = live.current
            live.peak = after_forward
            torch.autograd.backward(h, grad_out)
        kept = after_forward - start - h.untyped_storage().nbytes()  # the last layer's output is not kept by it
    return kept, live.peak - after_forward


class _TitanBlock(torch.nn.Module):
    """torchtitan's own Llama block (9dec370 ``torchtitan/models/llama/model.py``: RoPE in complex fp32 L107-113,
    ``repeat_kv`` L116-126, ``Attention.forward`` L189-214, ``FeedForward`` L253, ``TransformerBlock`` L311-313;
    ``models/norms.py`` L96-101 ``RMSNorm``), at the test's shape."""

    def __init__(self):
        super().__init__()
        linear = torch.nn.Linear
        self.wq, self.wk = linear(H, HEADS * HEAD_DIM, bias=False), linear(H, 2 * HEAD_DIM, bias=False)
        self.wv, self.wo = linear(H, 2 * HEAD_DIM, bias=False), linear(HEADS * HEAD_DIM, H, bias=False)
        self.w1, self.w2, self.w3 = linear(H, MLP, bias=False), linear(MLP, H, bias=False), linear(H, MLP, bias=False)
        self.attention_norm, self.ffn_norm = torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.ones(H))

    @staticmethod
    def _norm(x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight

    def _attention(self, x, freqs_cis):
        xq = self.wq(x).view(B, T, -1, HEAD_DIM)
        xk, xv = self.wk(x).view(B, T, -1, HEAD_DIM), self.wv(x).view(B, T, -1, HEAD_DIM)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
        freqs = freqs_cis.view(1, T, 1, HEAD_DIM // 2)
        xq = torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq)
        xk = torch.view_as_real(xk_ * freqs).flatten(3).type_as(xk)
        rep = HEADS // 2
        keys = xk.unsqueeze(3).expand(B, T, 2, rep, HEAD_DIM).reshape(B, T, HEADS, HEAD_DIM)
        values = xv.unsqueeze(3).expand(B, T, 2, rep, HEAD_DIM).reshape(B, T, HEADS, HEAD_DIM)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(B, T, -1))

    def forward(self, x, freqs_cis):
        h = x + self._attention(self._norm(x, self.attention_norm), freqs_cis)
        hn = self._norm(h, self.ffn_norm)
        return h + self.w2(F.silu(self.w1(hn)) * self.w3(hn))


def _layer(model, device: str):
    config, _ = model
    run = RunConfig.of(seq_len=T, micro_batch=B, dtype="bf16", mixed_precision="no", grad_checkpointing=True,
                       attn_implementation="sdpa", packing="concat", optimizer="adamw")
    return layer_activations(spec_from_config(config, "tiny-sac"), run, Precisions.of(run), device, TORCHTITAN)


@pytest.mark.parametrize("save_list, rule", [(SAVE_LIST, "cpu"), (SAVE_LIST | {CPU_FLASH}, "cuda")],
                         ids=["as-written-cpu", "cpu-flash-for-cuda-flash"])
def test_what_each_layer_keeps_under_torchtitans_policy(model, save_list, rule):
    """Kept per layer (bf16, per token): the 1st, 3rd, 5th and 7th mm's outputs, q (Q 2 = 256 B), v (K 2 = 128),
    gate (I 2 = 352) and down (H 2 = 128): 864 B; with attention kept, SDPA's output (Q 2 = 256) and log-sum-exp
    (4 heads x 4 B = 16) too: 1,136 B; and its input (H 2 = 128; the first layer's is x, held by the caller).
    Three layers, 512 tokens: 3 x 864 x 512 + 2 x 128 x 512 = 1,458,176 B; with attention 1,875,968 B.
    Whole-layer checkpointing keeps the two inputs only (131,072 B)."""
    kept, _ = _measure(model, save_list)
    assert kept == _layer(model, rule).all_layers - H * 2 * TOKENS
    assert kept == {"cpu": 1_458_176, "cuda": 1_875_968}[rule]


@pytest.mark.parametrize("save_list, rule", [(SAVE_LIST, "cpu"), (SAVE_LIST | {CPU_FLASH}, "cuda")],
                         ids=["as-written-cpu", "cpu-flash-for-cuda-flash"])
def test_torchtitans_own_block_keeps_what_transformers_layer_keeps(model, save_list, rule):
    """memfit prices torchtitan's runs with transformers' Llama layer: its own block (k and v repeated to every head,
    RoPE in complex fp32, its RMSNorm) runs the same seven mm in the same order and the same SDPA, so it keeps the
    same bytes (1,458,176 B; 1,875,968 B with attention kept); only its recompute differs (``Trainer.unpriced``)."""
    torch.manual_seed(0)
    blocks = [_TitanBlock().to(torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(B, T, H, dtype=torch.bfloat16, requires_grad=True)
    freqs_cis = torch.polar(torch.ones(T, HEAD_DIM // 2), torch.outer(torch.arange(T).float(),
                                                                       torch.rand(HEAD_DIM // 2)))
    kept, _ = _counted(blocks, x, [freqs_cis], save_list, freqs_cis=freqs_cis)
    assert kept == _layer(model, rule).all_layers - H * 2 * TOKENS


@pytest.mark.parametrize("save_list, rule", [(SAVE_LIST, "cpu"), (SAVE_LIST | {CPU_FLASH}, "cuda")],
                         ids=["as-written-cpu", "cpu-flash-for-cuda-flash"])
def test_the_recompute_of_one_layer_takes_back_what_it_kept(model, save_list, rule):
    """The backward peak is in the top layer's MLP (the other layers' kept tensors outweigh their weight
    gradients): everything kept, plus the top layer's recompute and gradients (``backward_transient``), plus the
    down projection's weight gradient (I H 2 = 22,528 B, memfit counts it with the model's head gradients), less the
    output's gradient, which the caller holds here (H 2 x 512 = 65,536 B, counted in the transient's moment)."""
    _, peak = _measure(model, save_list)
    layer = _layer(model, rule)
    assert peak == layer.backward_transient + MLP * H * 2 - H * 2 * TOKENS


def test_mixed_precision_policy_gathers_half_parameters():
    """torchtitan shards with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 shards, no
    autocast. tiny preset (H 256, I 768, q 256, k/v 128), FSDP on 2 ranks, bf16 mixed precision: one layer's
    parameters are 256 x (256 + 128 + 128 + 256) + 3 x 256 x 768 + 2 x 256 = 786,944, + 32 (memfit spreads the
    final norm's 256 over the 8 layers); two layers gathered while one computes: 1,573,952 parameters, 3,147,904 B
    at bf16 against 6,295,808 at fp32. The stream is bf16 (``Precisions.w`` 2) and autocast keeps no weight copies;
    the shards' bytes are unchanged; unsharded, memfit's autocast pricing stays. The layer above's reduce-scatter
    input, in flight while a layer computes its backward, stays fp32 (``reduce_dtype``): 786,976 x 4 = 3,147,904 B,
    not the 1,573,952 B of bf16."""
    spec = load_spec("tiny")
    run = RunConfig.of(seq_len=64, micro_batch=2, num_processes=2, sharding="fsdp", mixed_precision="bf16",
                       optimizer="adamw", grad_checkpointing=True)
    own = model_states(spec, run)
    titan = gathered_in_compute_dtype(spec, run, own, TORCHTITAN, "cuda", "fsdp2", None)
    assert own.gathered_layer == 6_295_808 and titan.gathered_layer == 3_147_904
    assert (titan.weights, titan.gradients, titan.optimizer) == (own.weights, own.gradients, own.optimizer)
    assert titan.reducing == 3_147_904
    prec = precisions(Precisions.of(run), run, TORCHTITAN)
    assert (prec.w, prec.c, prec.amp) == (2, 2, False)
    assert autocast_weight_copies(spec, run, prec) == 0 < autocast_weight_copies(spec, run, Precisions.of(run))
    assert precisions(Precisions.of(run), run.replace(num_processes=1), TORCHTITAN) == Precisions.of(run)


def test_torchtitans_root_unit_stays_gathered_from_forward_to_backwards_end():
    """torchtitan wraps each block, then the model as the root unit (9dec370 ``parallelize_llama.py`` L329-339), and
    FSDP2 of its time never resharded the root after forward (pytorch/pytorch#154655): the embedding, the final norm
    and the head stay gathered through the step. tiny preset (V 384, H 256, untied), FSDP on 2 ranks, bf16 gathered:
    the root is 384 x 256 + 384 x 256 + 256 = 196,864 parameters, R = 393,728 B; the embedding alone 196,608 B.

    - while forward and backward compute, at backward's start: Accelerate's units hold the tail ([norm, head]),
      torchtitan's the embedding too: + 196,608 B;
    - while a layer computes, as the last layer enters its forward: the tail is not held there by Accelerate's units,
      so the whole root, + 393,728 B;
    - as the first layer enters: the root (393,728) and its all-gather output (393,728) in place of the embedding
      unit's all-gather output (196,608): + 590,848 B;
    - at backward's end: R + the root's bf16 gradients and fp32 reduce-scatter input, 393,728 + 196,864 x 6 =
      1,574,912 B, below the late layer's moment already priced (4,721,856 B): unchanged."""
    spec = load_spec("tiny")
    run = RunConfig.of(seq_len=64, micro_batch=2, num_processes=2, sharding="fsdp", mixed_precision="bf16",
                       optimizer="adamw", grad_checkpointing=True)
    half = gathered_in_compute_dtype(spec, run, model_states(spec, run), TORCHTITAN, "cuda", "fsdp2", None)
    root = root_unit_kept(spec, run, half, TORCHTITAN, "fsdp2")
    assert root.gathered - half.gathered == 196_608 and root.gathered_start - half.gathered_start == 196_608
    assert root.gathered_layer - half.gathered_layer == 393_728
    assert root.gathered_entry - half.gathered_entry == 393_728
    assert root.gathered_first_entry - half.gathered_first_entry == 590_848
    assert root.gathered_end == half.gathered_end == 4_721_856
    # Accelerate's units (memfit's own stack), one process, or a tied embedding (already in the kept tail): as they were
    assert root_unit_kept(spec, run, half, Stack(), "fsdp2") == half
    one = run.replace(num_processes=1, sharding="ddp")
    assert root_unit_kept(spec, one, model_states(spec, one), TORCHTITAN, "fsdp2") == model_states(spec, one)
    tied = load_spec("smollm2-135m")
    assert tied.tie_word_embeddings
    assert root_unit_kept(tied, run, model_states(tied, run), TORCHTITAN, "fsdp2") == model_states(tied, run)

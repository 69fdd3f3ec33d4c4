"""Per-rank prediction of sharded training against the measured tensor peak (issue 13: within 3%).

Each case launches ``bench/sharding_memory.py`` on 2 CPU processes (gloo, torchrun): every rank builds
the tiny preset with memfit's own builders, runs 3 real training steps inside torch's memory tracker
(``MemTracker``; ``FSDPMemTracker`` for FSDP2) and rank 0 prints the analytic per-rank prediction
(``estimate(..., device="cpu")``) next to every rank's measured peak of the bytes tensors hold. The
terms these cases hold the estimator to: DDP's gradient buckets, FSDP2's units kept gathered (the tail
[norm, head, tied embedding], every layer under ZeRO-2) and the reduce-scatter at the end of backward,
and the single-tensor AdamW torch runs on CPU. ~20-40 s per launch on 2 shared cores; the cases here are
cases of the suite's shared launch (``tests/_gloo_cases.py``: ``memory-*``, the same bench arguments).
"""

from __future__ import annotations

import pytest

from _launch_helpers import case_json
from memfit.memory.estimate import estimate
from memfit.memory.states import model_states
from memfit.settings.config import RunConfig
from memfit.spec.model import load_spec

TOLERANCE = 0.03
# ZeRO-2 is held closer: each of its two FSDP2 terms alone moves tiny's prediction by more than 2%.
# Without the forward's two layer-sized all-gather buffers (fsdp2_gathered) the prediction falls to
# backward's 111,538,560 B against 114,653,300 B measured (-2.7%); without the layers' reshard after their
# backward (released_after_backward) the first layer's moment rises to 117,475,904 B (+2.5%). With both:
# 116,195,328 B, the forward's peak, +1.3% (measured at the last layer's forward, as predicted). Those
# predictions priced packed documents' attention mask; the bench feeds whole, unpadded rows and predicts
# them as such (packing concat: no mask): 294,912 B less at each moment, 115,900,416 B (+1.1%).
ZERO2_TOLERANCE = 0.02



# 3 steps: the steady state. The rollback snapshot's buffers for the optimizer state are allocated in the
# first step that has state (the second), so with 2 steps forward and backward never see the whole
# snapshot: zero2's peak (forward/backward, every layer gathered) then measured 21% under the prediction,
# while ddp's and fsdp's (the optimizer step) did not move.
@pytest.mark.launch_cases("memory-ddp", "memory-fsdp", "memory-zero2")
@pytest.mark.parametrize("sharding", ["ddp", "fsdp", "zero2"])
def test_per_rank_prediction_is_within_3_percent_of_the_measured_tensor_peak(sharding, gloo_runs):
    got = case_json(gloo_runs, f"memory-{sharding}")  # tiny, --sharding SHARDING
    assert got["processes"] == 2 and got["sharding"] == sharding
    # Throughput counts each token once: 3 steps x 1 x 32 tokens on each of 2 ranks (train_step's count is
    # already all-reduced; round 2's table multiplied it by the process count a second time).
    assert got["tokens"] == 3 * 32 * 2
    assert got["tokens_per_s"] == pytest.approx(got["tokens"] / got["seconds"])
    predicted = got["predicted_peak_bytes"]
    for measured in got["measured_peak_bytes_per_rank"]:
        error = (predicted - measured) / measured
        assert abs(error) <= (ZERO2_TOLERANCE if sharding == "zero2" else TOLERANCE), (f"{sharding}: predicted {predicted:,} B vs measured {measured:,} B "
                                         f"({error:+.1%}); at rank 0's peak: {got['measured_at_peak_rank0']}")


@pytest.mark.launch_cases("memory-lora", "memory-qlora")
@pytest.mark.parametrize("quantize", ["none", "4bit"])
def test_lora_and_qlora_under_fsdp_are_predicted_per_rank(quantize, gloo_runs):
    # LoRA r8 on the tiny preset (8 layers, fp32), 2 ranks. The terms this holds:
    # - LoRA (none): its peak is a layer's entry into forward, where FSDPMemTracker shows the layer's unsharded
    #   parameters beside two layer-sized all-gather outputs (fsdp2_gathered's ``gathered_entry``, 3 x 3.30 MB);
    #   without that moment the prediction is the backward's, -7.0% (run once: the test failed).
    # - QLoRA (4bit): the packed NF4 weights are sharded and gathered as they are stored (0.5 byte per weight,
    #   gathered_layer_bytes: 0.55 MB a layer; priced at fp32 sizes, +56.0%: the test failed), the quantization state
    #   is whole on every rank (the bench adds it to FSDPMemTracker's total, which files it nowhere), and a
    #   layer's backward holds two layers gathered, not the tail (+3.1% with it).
    pytest.importorskip("bitsandbytes") if quantize != "none" else None
    got = case_json(gloo_runs, {"none": "memory-lora", "4bit": "memory-qlora"}[quantize])  # fsdp --lora-r 8 --quantize Q
    assert got["lora_r"] == 8 and got["quantize"] == quantize
    predicted = got["predicted_peak_bytes"]
    for measured in got["measured_peak_bytes_per_rank"]:
        error = (predicted - measured) / measured
        assert abs(error) <= TOLERANCE, (f"{quantize}: predicted {predicted:,} B vs measured {measured:,} B "
                                         f"({error:+.1%}); at rank 0's peak: {got['measured_at_peak_rank0']}")


def test_ddp_gradients_live_in_its_buckets_one_copy_all_run():
    # memfit builds DDP with gradient_as_bucket_view=True: param.grad are views into the buckets. Hand
    # check: tiny's trainable parameters x 4 bytes (fp32) of buckets on each of 2 DDP ranks and no
    # separate gradients; none on one process or under FSDP (which reduce-scatters into sharded grads).
    spec = load_spec("tiny")
    run = RunConfig.of(seq_len=32, micro_batch=1, grad_accum=1, optimizer="adamw", sharding="ddp", num_processes=2)
    states = model_states(spec, run)
    assert (states.buckets, states.gradients) == (spec.trainable_params(run) * 4, 0)
    assert model_states(spec, run.replace(num_processes=1)).buckets == 0
    assert model_states(spec, run.replace(sharding="fsdp")).buckets == 0
    # One copy: at the optimizer step 2 DDP ranks hold what 1 process holds; in forward (grad_accum 1,
    # where 1 process holds no gradients) the buckets are the difference.
    one = estimate(spec, run.replace(num_processes=1), device="cpu").phase_peaks
    two = estimate(spec, run, device="cpu").phase_peaks
    assert two["optimizer"] == one["optimizer"]
    assert two["forward"] - one["forward"] == states.buckets
    from accelerate.utils import DistributedDataParallelKwargs

    from memfit.training.sharding import accelerator_kwargs

    (handler,) = accelerator_kwargs(run, cuda=False)["kwargs_handlers"]
    assert isinstance(handler, DistributedDataParallelKwargs) and handler.to_kwargs() == {"gradient_as_bucket_view": True}


def test_adamw_on_cpu_charges_the_single_tensor_loop_not_the_foreach_group():
    # torch's default AdamW is foreach on CUDA (one temporary the size of a parameter group: train's first,
    # every parameter but the 17 norms of 256) and the single-tensor loop on CPU: per parameter its sqrt
    # and quotient next to the previous one's quotient; tiny's largest pair is up_proj after gate_proj
    # (768 x 256 = 196,608 elements each): 3 x 196,608, fp32.
    spec = load_spec("tiny")
    run = RunConfig.of(seq_len=32, micro_batch=1, grad_accum=1, optimizer="adamw")
    cuda = model_states(spec, run, "cuda").step_temporary
    cpu = model_states(spec, run, "cpu").step_temporary
    assert cuda == (spec.trainable_params(run) - 17 * 256) * 4
    assert cpu == 3 * 196_608 * 4
    assert estimate(spec, run, device="cpu").phase_peaks["optimizer"] < estimate(
        spec, run, device="cuda").phase_peaks["optimizer"]


@pytest.mark.launch_cases("memory-qwen3")
def test_a_derived_family_with_a_large_untied_embedding_is_predicted_per_rank(gloo_runs):
    # Qwen3 has no hand-written recipe (its activations are derived from traces: memory/derive.py), and a
    # 32,768 x 256 untied embedding (33.5 MB fp32) makes the end of backward the peak under FSDP2: the
    # embedding's unsharded gradient, the autograd temporary and the reduce-scatter input (3 x 33.5 MB)
    # beside its output shard, which already exists there (16.8 MB, 4-5% of the peak: the -2.7% of a
    # Llama of this shape before fsdp2_gathered's untied end counted it). The derived path reads the
    # same FSDP2 terms as the hand-written one (sharded gradients above the first layer, gathered_end at
    # backward's end), which it once lacked: +4.9% on fsdp, +10.9% on zero2, DDP's buckets missing (-6.6%).
    # The Qwen3 config (hidden 256, intermediate 768, 2 layers, 4 heads / 2 KV heads of 64, vocab 32,768,
    # untied): _gloo_cases._qwen3, launched with --sharding fsdp.
    got = case_json(gloo_runs, "memory-qwen3")
    assert load_spec(got["model"]).family == "generic"  # derived, not a hand-written recipe
    predicted = got["predicted_peak_bytes"]
    for measured in got["measured_peak_bytes_per_rank"]:
        error = (predicted - measured) / measured
        assert abs(error) <= TOLERANCE, (f"predicted {predicted:,} B vs measured {measured:,} B ({error:+.1%}); "
                                         f"at rank 0's peak: {got['measured_at_peak_rank0']}")

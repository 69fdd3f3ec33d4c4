"""FSDP (1)'s flat parameters (``memory.flat_params``): the estimate of a ``Stack(fsdp=1)`` run against what torch's
``FullyShardedDataParallel`` holds.

The measured cases launch ``bench/fsdp1_memory.py`` on 2 CPU processes (gloo) in the suite's shared launch
(``tests/_gloo_cases.py``: ``fsdp1-*``): every rank wraps a small untied Llama (H 128, I 344, 4 heads, 2 KV heads;
one unit per decoder layer, the root with the embedding, final norm and head) with FSDP (1)'s defaults (FULL_SHARD;
``fsdp1-noshard*``: NO_SHARD), runs 6 steps (fp32, AdamW, 2 x 32 tokens; 2 x 256 where named; full fine-tuning
unless named) and counts each steady step's tensor peak with memfit's own counter (``memory.measure.counted``); the
smallest of the four steady steps is compared: gloo's worker thread sometimes frees a reduce-scatter input late (one
step of the fsdp1-layers model read 2.8% above the others on one rank, and with two steady steps the case failed once).
The rest are hand-worked figures of the formulas.
"""

from __future__ import annotations

import pytest

from _launch_helpers import case_json
from memfit.memory import flat_params
from memfit.memory.estimate import estimate
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack
from memfit.spec.model import load_spec

# 1% of the peak: smaller than each FSDP (1) term the cases hold (the smallest, one layer's flat gradient, is
# 726,016 B, 4.7% of the 4-layer case's 15.5 MB peak), larger than what they leave unexplained (seen: -0.2% and
# +0.3%, 0.0%). Without the top layer's concatenated flat gradient (the "flat gradient" moment) the 4-layer case was
# predicted -1.2%; with one root gradient copy at backward's end instead of two, the root case -20.4% (each run once:
# the test failed); priced as FSDP2 (no stack): -8.1%, -20.4%, -15.3%. NO_SHARD (whole flat parameters): seen 0.0%
# on both cases; priced as memfit's DDP, -14.6% and +10.2%.
TOLERANCE = 0.01



@pytest.mark.launch_cases("fsdp1-layers", "fsdp1-root", "fsdp1-lora", "fsdp1-noshard", "fsdp1-noshard-backward",
                          "fsdp1-accumulate", "fsdp1-lora-in-units")
@pytest.mark.parametrize("case", ["fsdp1-layers", "fsdp1-root", "fsdp1-lora", "fsdp1-noshard",
                                  "fsdp1-noshard-backward", "fsdp1-accumulate", "fsdp1-lora-in-units"])
def test_fsdp1_estimate_is_within_1_percent_of_the_measured_tensor_peak(case, gloo_runs):
    # fsdp1-layers: 4 layers, V 2,048: the peak is the top layer's backward, where its views' gradients are
    # concatenated (2 x 726,016 B) beside the root (2,097,664 B) and two layers unsharded (the one prefetched).
    # fsdp1-root: 2 layers, V 8,192: the root (8,389,120 B) outweighs the layers; the peak is backward's end, the
    # root's gradients and their concatenation beside it.
    # fsdp1-lora: the same model, LoRA r 8 under PEFT's fsdp_auto_wrap_policy (each LoRA matrix its own unit, the
    # frozen root and layers without gradients): the peak is backward's start, the logits' gradients beside the root
    # unsharded (8,389,120 B, since its forward) and the last layer its pre-backward hook prefetched; FSDP2's terms
    # hold the [norm, head] tail and two layers there (-15.3%); with the root left out of that moment, -12.8% (run
    # once: the test failed).
    # fsdp1-noshard: the fsdp1-root model under NO_SHARD (--sharding ddp): the flat parameters whole on each rank,
    # no all-gather. The peak is the optimizer step (56,144,012 B measured, 56,142,976 predicted): weights,
    # flat gradients and AdamW's moments of 2,460,288 elements, and the single-tensor step's temporaries over
    # whole flat parameters, the root (2,097,280 elements) the largest. Priced as memfit's own DDP (the "FSDP2"
    # figure here) it was -14.6%; with the root's flat parameter taken as halved (as if sharded over 2), -22.4%
    # (run once: the test failed).
    # fsdp1-noshard-backward: the fsdp1-layers model under NO_SHARD at 256 tokens a row: the peak is backward's start
    # (49,208,988 B measured, 49,208,960 predicted), the logits' gradients beside every activation and no gradient yet:
    # the flat gradients are made unit by unit in backward (set to None by zero_grad), where memfit's DDP keeps its
    # buckets (5,001,728 B) from forward on (+10.2%); with those buckets kept here too, +10.2% (run once: the test
    # failed).
    # fsdp1-accumulate: the fsdp1-layers model, 3 micro-batches a step, the first two under no_sync: every unit's
    # unsharded flat gradient (5,001,728 B, the whole model in fp32) is kept from the first micro-batch's backward
    # to the last one's reduce-scatter (measured 20,545,436 B, predicted 20,509,504: -0.2%); with the sharded
    # gradients priced as the accumulated ones (2,500,864 B), -12.3%.
    # fsdp1-lora-in-units: the same model, LoRA r 8 on every projection inside each layer's unit under
    # use_orig_params=True (Lightning Fabric's FSDP, litgpt): each layer's whole flat parameter (200,000 elements,
    # 800,000 B) gets a gradient, every layer saves what a full fine-tune saves (its norms' normalised input), and
    # no_sync keeps the four layers' unsharded gradients (3,200,000 B; the frozen root none). Measured 13,376,264 B
    # on rank 0 and 13,509,352 B on rank 1 (the adapters' AdamW state follows which adapters fall in each rank's
    # shard: 229,376 B and 362,496 B around the even 295,936 priced), predicted 13,406,784 (+0.2%, -0.8%). Against
    # the same two peaks (rank 0, rank 1): priced with the PEFT policy's units (fsdp1-lora's terms) -25.0%, -25.7%;
    # without the full-fine-tune saved set -1.2%, -2.2%; without no_sync's unsharded gradients -11.7%, -12.6%.
    got = case_json(gloo_runs, case)
    assert got["processes"] == 2
    predicted = got["predicted_peak_bytes"]
    for measured in got["measured_peak_bytes_per_rank"]:
        error = (predicted - measured) / measured
        assert abs(error) <= TOLERANCE, (f"{case}: predicted {predicted:,} B vs measured {measured:,} B ({error:+.1%}); "
                                         f"every steady step per rank: {got['measured_step_peaks_per_rank']}")
    # the FSDP2 terms (memfit's own runs) do not describe this run: the stack is what moved the figure
    assert abs(got["fsdp2_predicted_peak_bytes"] - predicted) > TOLERANCE * predicted


def _llama(tmp_path, vocab: int = 2048, layers: int = 4):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False).save_pretrained(tmp_path)
    return load_spec(str(tmp_path))


def test_no_sync_keeps_every_trainable_units_unsharded_gradient(tmp_path):
    """Under gradient accumulation a micro-batch before the last keeps each trainable unit's whole flat gradient
    (``no_sync``). The test_flat_units model below (layer 181,504 elements, root 524,416), fp32, over 2 ranks:

    - full fine-tune: 4 x 181,504 + 524,416 = 1,250,432 elements, 5,001,728 B (the sharded gradients: half);
    - LoRA r 8 on every projection under PEFT's policy (adapters as their own units): the adapters whole, per layer
      q 8 x (128 + 128) = 2,048, k and v 8 x (128 + 64) = 1,536, o 2,048, gate, up, down 8 x (128 + 344) = 3,776:
      18,496; 4 layers x 4 B = 295,936 B;
    - the same adapters inside the layers' units (litgpt): each layer's whole flat parameter, 181,504 + 18,496 =
      200,000 elements, 4 layers x 800,000 B = 3,200,000 B; the frozen root none;
    - fsdp_qlora, whose loop reduce-scatters every micro-batch without --no_sync: None (the sharded gradients)."""
    spec = _llama(tmp_path)
    full = RunConfig.of(sharding="fsdp", num_processes=2, dtype="fp32", grad_accum=3)
    lora = RunConfig.of(sharding="fsdp", num_processes=2, dtype="fp32", grad_accum=3, lora_r=8)

    def accumulated(run, stack):
        return estimate_states(spec, run, stack).accumulated

    assert accumulated(full, Stack(fsdp=1)) == 5_001_728
    assert accumulated(lora, Stack(fsdp=1)) == 295_936
    assert accumulated(lora, Stack(fsdp=1, lora_in_layer_units=True)) == 3_200_000
    assert accumulated(lora, Stack(trainer="answerai-fsdp-qlora", fsdp=1)) is None
    assert accumulated(full.replace(grad_accum=1), Stack(fsdp=1)) is None


def estimate_states(spec, run, stack):
    from memfit.memory.activations import Precisions
    from memfit.memory.resident import resident_states
    from memfit.memory.stack_terms import precisions

    prec = precisions(Precisions.of(run), run, stack)
    return resident_states(spec, run, prec, "cpu", "fsdp2", None, stack)[0]


def test_flat_units_pad_each_unit_to_the_world_size(tmp_path):
    spec = _llama(tmp_path)
    # a layer: q, o 128 x 128 (16,384 each), k, v 128 x 64 (8,192 each), gate, up, down 128 x 344 (44,032 each),
    # two norms of 128: 181,504 elements; the root: embedding and head 2,048 x 128 (262,144 each) + the final norm
    # (128): 524,416. fp32. Over 2 ranks both are even: no padding.
    two = flat_params.flat_units(spec, RunConfig.of(sharding="fsdp", num_processes=2, dtype="fp32"))
    assert (two.layer, two.root) == (181_504 * 4, 524_416 * 4)
    assert (two.layer_shard, two.root_shard) == (90_752 * 4, 262_208 * 4)
    # over 3 ranks: 181,504 = 3 x 60,501 + 1, so each shard holds 60,502 elements and the unsharded buffer
    # 181,506 (``_get_shard``'s F.pad); 524,416 = 3 x 174,805 + 1: 174,806 and 524,418
    three = flat_params.flat_units(spec, RunConfig.of(sharding="fsdp", num_processes=3, dtype="fp32"))
    assert (three.layer, three.layer_shard) == (181_506 * 4, 60_502 * 4)
    assert (three.root, three.root_shard) == (524_418 * 4, 174_806 * 4)


def test_mixed_precision_gathers_in_the_compute_dtype_beside_an_mp_shard(tmp_path):
    spec = _llama(tmp_path)
    # fp32 weights, --mixed-precision bf16: Accelerate's MixedPrecision(param_dtype=bf16) all-gathers 2-byte
    # elements (181,504 x 2) after copying the 4-byte shard (90,752 elements) to a bf16 _mp_shard (90,752 x 2)
    units = flat_params.flat_units(spec, RunConfig.of(sharding="fsdp", num_processes=2, dtype="fp32",
                                                     mixed_precision="bf16"))
    assert (units.layer, units.root, units.layer_shard, units.mp_shard) == (363_008, 1_048_832, 363_008, 181_504)


def test_unshard_stream_blocks_add_to_reserved_memory(tmp_path):
    spec = _llama(tmp_path)
    run = RunConfig.of(sharding="fsdp", num_processes=2, dtype="fp32")
    # the root (2,097,664 B) and three layers (3 x 726,016 B: computing, prefetched, freed but waiting for its
    # record_stream event), no _mp_shard without a param dtype
    assert flat_params.unshard_stream_bytes(spec, run) == 2_097_664 + 3 * 726_016
    # after wrapping reserved 10 MB on the compute stream, a step whose compute stream needs 8 MB reserves
    # max(8, 10) MB there, and the unshard stream's blocks on top
    pool = 2_097_664 + 3 * 726_016
    assert flat_params.after_earlier_phases(spec, run, 8_000_000 + pool, 10_000_000) == 10_000_000 + pool
    fsdp1 = estimate(spec, run, stack=Stack(fsdp=1))
    assert fsdp1.reserved == flat_params.step_reserved(spec, run, fsdp1.peak_bytes - fsdp1.other)
    assert any("memory/flat_params.py" in note for note in fsdp1.notes)
    # CPU offload: pre_unshard copies the host shard to the device on its own stream, one block of the largest
    # unit's shard (the root's, 262,208 x 4 = 1,048,832 B) that every unshard reuses; with a param dtype the
    # _mp_shard is that copy (two blocks of 181,504 B), no more
    offload = run.replace(offload="params")
    assert flat_params.unshard_stream_bytes(spec, offload) == pool + 1_048_832
    mixed = offload.replace(mixed_precision="bf16")
    assert flat_params.unshard_stream_bytes(spec, mixed) == flat_params.unshard_stream_bytes(
        spec, mixed.replace(offload="none"))


def test_only_a_sharded_fsdp1_stack_changes_the_estimate(tmp_path):
    spec = _llama(tmp_path)
    run = RunConfig.of(sharding="fsdp", num_processes=2, dtype="fp32")
    mine = estimate(spec, run)  # memfit's own (FSDP2)
    assert estimate(spec, run, stack=Stack()).to_dict() == mine.to_dict()
    assert estimate(spec, run, stack=Stack(fsdp=1)).peak_bytes != mine.peak_bytes
    ddp = run.replace(sharding="ddp")  # FSDP (1) NO_SHARD (flat gradients), not memfit's DDP (buckets)
    assert estimate(spec, ddp, stack=Stack(fsdp=1)).peak_bytes != estimate(spec, ddp).peak_bytes
    assert not flat_params.applies(run.replace(num_processes=1), Stack(fsdp=1))
    assert not flat_params.applies(ddp, Stack())  # memfit's own DDP is unchanged


def test_no_shard_keeps_each_unit_whole(tmp_path):
    spec = _llama(tmp_path)
    # NO_SHARD: no padding, the whole unit on each rank (181,504 and 524,416 fp32 elements, as above, over 3 ranks
    # too), and nothing unsharded beside it without a param dtype
    three = flat_params.flat_units(spec, RunConfig.of(sharding="ddp", num_processes=3, dtype="fp32"))
    assert (three.layer_shard, three.root_shard, three.layer, three.root) == (181_504 * 4, 524_416 * 4, 0, 0)
    # with --mixed-precision bf16 each unit computes from its full-size bf16 _mp_shard (181,504 x 2, 524,416 x 2)
    mixed = flat_params.flat_units(spec, RunConfig.of(sharding="ddp", num_processes=2, dtype="fp32",
                                                     mixed_precision="bf16"))
    assert (mixed.layer, mixed.root, mixed.mp_shard) == (363_008, 1_048_832, 0)
    run = RunConfig.of(sharding="ddp", num_processes=2, dtype="fp32")
    assert flat_params.unshard_stream_bytes(spec, run) == 0  # no all-gather: no unshard stream blocks
    assert any("NO_SHARD" in note for note in estimate(spec, run, stack=Stack(fsdp=1)).notes)

"""The analytic estimator: golden numbers by hand, the textbook 7B case, monotonicity, CLI."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from memfit.cli import cli
from memfit.memory.activations import Precisions
from memfit.memory.autocast import autocast_weight_copies
from memfit.memory.estimate import estimate
from memfit.settings.config import RunConfig
from memfit.spec.model import load_spec, spec_from_config
from memfit.units import MiB

# The goldens count the unmasked attention path (--packing concat); the packed-rows mask adds a term
# of its own, golden in tests/test_packing.py.
RUN = dict(seq_len=16, micro_batch=2, packing="concat")


@pytest.fixture
def tiny(tiny_llama_config):
    return spec_from_config(tiny_llama_config, "tiny-test")


def test_golden_fp32_full(tiny):
    """tiny_llama_config (H 64, I 128, 4 heads, 2 kv heads, head_dim 16, V 384, 2 layers), B=2, T=16, fp32."""
    b = estimate(tiny, RunConfig.of(**RUN), device="cpu")
    p = tiny.params
    assert p == 123_200  # 2 layers x 36,864 projection weights + embedding and head 2 x 24,576 + 5 norms x 64
    # weights: p x 4 + rotary inv_freq and original_inv_freq buffers (2 x 8 fp32) = 459,776 + 64
    # Per layer, bytes per token (fp32: every saved tensor 4 bytes):
    #   x, x2 (residual inputs of the two RMSNorms)       2 x 64 x 4   = 512
    #   two norms: rsqrt (1) + normalised h (64)          2 x 65 x 4   = 520
    #   q/k/v input (one shared tensor)                   64 x 4       = 256
    #   SDPA: q (64) + k (32) + v (32) + out (64) + lse 4 heads  = 192 x 4 + 16 = 784
    #   gate/up input (shared)                            64 x 4       = 256
    #   gate out, silu out, up out                        3 x 128 x 4  = 1536
    #   down input (gate*up)                              128 x 4      = 512
    #   total 4,376 bytes/token x 32 tokens = 140,032 bytes per layer
    assert b.activations_per_layer == 140_032
    # logits: N = 32 x 384 = 12,288; backward start holds log_softmax out + its grad + logits grad, fp32: 12 N
    # optimizer step: on CPU torch's default AdamW is the single-tensor loop (foreach only on CUDA):
    # weights + grads + 2 moments + the head's sqrt and quotient (384 x 64 each) next to the quotient of the
    # matrix before it in train's first parameter group (matrices; norms are the second group), the last
    # layer's down_proj (128 x 64), still bound to the loop variable: (8,192 + 2 x 24,576) x 4
    assert b.phase_peaks["optimizer"] == (4 * p + 64) + 4 * p + 8 * p + (8_192 + 2 * 24_576) * 4
    # backward start: weights + moments + 2 layers + outside (ids 256 + targets 256 + cos/sin 2x16x16x4=2048
    #   + final norm x, rsqrt, h 32 x 516 + head input 32 x 256 = 16,512 + 8,192) + logits 12 N
    outside = 256 + 256 + 2048 + 16_512 + 8_192
    start = (4 * p + 64) + 8 * p + 2 * 140_032 + outside + 12 * 12_288
    # backward end: every gradient exists (4 p) while only the outside-layer tensors are left
    end = (4 * p + 64) + 8 * p + 4 * p + outside
    assert b.phase_peaks["backward"] == max(start, end) == end == 1_998_528
    assert b.peak_bytes == max(b.phase_peaks.values())
    assert b.other == 0  # device="cpu": no CUDA context/reserve


def test_golden_amp_bf16(tiny):
    """Same model under AMP bf16: half-precision saves, one bf16 copy of the input per projection."""
    b = estimate(tiny, RunConfig.of(mixed_precision="bf16", **RUN), device="cpu")
    # per token: x, x2 fp32 512 + norms 520 + q/k/v inputs 3 x 64 x 2 = 384 + SDPA 192 x 2 + 16 = 400
    #   + gate/up inputs 2 x 64 x 2 = 256 + 3 x 128 x 2 = 768 + down input 128 x 2 = 256 -> 3,096 x 32
    assert b.activations_per_layer == 3_096 * 32
    # autocast's bf16 weight copies of every projection + the head (saved for backward): 2 x (2 x 36,864 + 24,576)
    assert autocast_weight_copies(tiny, RunConfig.of(mixed_precision="bf16"), Precisions.of(
        RunConfig.of(mixed_precision="bf16"))) == 2 * (2 * 36_864 + 24_576)
    # the peak is the optimizer step; on CPU torch's AdamW is the single-tensor loop, whose temporaries are
    # the head's fp32 sqrt(v) and quotient (384 x 64) next to the quotient of the matrix before it in train's
    # first parameter group, the last layer's down_proj (128 x 64): (8,192 + 2 x 24,576) x 4
    assert b.phase == "optimizer" and b.temporary == (8_192 + 2 * 24_576) * 4
    # on CUDA the same run gets foreach AdamW: one fp32 sqrt(v) for every parameter of a group at once, the
    # larger group being the matrices (all but the 5 norms of 64): 4 x (params - 320)
    assert estimate(tiny, RunConfig.of(mixed_precision="bf16", **RUN), device="cuda").temporary == 4 * (tiny.params - 320)


def test_golden_lora_fp32_first_layer(tiny):
    """LoRA r=4 on all linears, fp32: frozen norms save no h, and the first layer's input needs no grad."""
    from memfit.memory.activations import layer_activations, outside_layer_activations

    run = RunConfig.of(lora_r=4, **RUN)
    prec = Precisions.of(run)
    acts = layer_activations(tiny, run, prec, "cpu")
    # Per token, a layer whose input needs a gradient (fp32: adapters share the one fp32 input tensor):
    #   norm1: x (64 x 4) + rsqrt 4 (frozen weight: no h)                = 260
    #   q/k/v: shared input 256 + 3 lora_A outputs (r=4 x 4 B) 3 x 16     = 304
    #   SDPA: q 64 + k 32 + v 32 + out 64 (x 4 B) + lse 4 heads x 4        = 784
    #   o_proj: input is SDPA's out (saved) + lora_A output 16             = 16
    #   norm2 260, gate/up shared input 256 + 2 x 16 = 288, 3 x 128 x 4 = 1536, down input 512 + 16 = 528
    #   total 3,976 bytes/token x 32 tokens = 127,232
    assert acts.saved == 127_232
    # the first layer's norm1 saves nothing (its input comes from the frozen embedding): 3,716 x 32
    assert acts.all_layers == 127_232 + (3_976 - 260) * 32 == 246_144
    # outside: loss targets 8 x 32 (no ids: the embedding is frozen) + cos/sin 2 x 16 x 16 x 4
    #   + final norm 260 x 32 (no head input: the head is frozen) = 256 + 2,048 + 8,320
    assert outside_layer_activations(tiny, run, prec, "cpu") == 10_624
    b = estimate(tiny, run, device="cpu")
    assert b.activations == 246_144 + 10_624


def test_gpt2_attention_dropout_cpu_math_vs_cuda_flash():
    """GPT-2 trains with attention dropout: CPU SDPA falls back to the math kernel (fp32 T x T matrices),
    CUDA's flash kernel keeps no T x T matrix and a 1-byte dropout mask."""
    spec = load_spec("gpt2")
    run = RunConfig.of(seq_len=1024, micro_batch=1)
    cpu, cuda = estimate(spec, run, device="cpu"), estimate(spec, run, device="cuda")
    # per layer the math path adds 3 fp32 (12 heads x 1024 x 1024) matrices = 144 MiB
    assert cpu.activations_per_layer - cuda.activations_per_layer > 3 * 4 * 12 * 1024 * 1024


def test_textbook_llama2_7b_to_the_byte():
    spec = load_spec("llama-2-7b")
    b = estimate(spec, RunConfig.of(mixed_precision="no", seq_len=512, micro_batch=1))
    assert b.weights - spec.buffer_bytes == 6_738_415_616 * 4 == 26_953_662_464  # 26.95 GB
    assert b.gradients == 6_738_415_616 * 4
    assert b.optimizer == 6_738_415_616 * 8
    assert (b.model_states - spec.buffer_bytes) / spec.params == 16
    assert any("AMP" in n and "16 B/param" in n for n in b.notes)


@pytest.mark.parametrize("field,values", [("micro_batch", (1, 2, 4, 8)), ("seq_len", (64, 128, 256, 512)),
                                          ("lora_r", (4, 8, 16, 64))])
def test_monotonic(tiny, field, values):
    base = RunConfig.of(mixed_precision="bf16", seq_len=128, micro_batch=2)
    peaks = [estimate(tiny, base.replace(**{field: v})).peak_bytes for v in values]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


@pytest.mark.parametrize("kw", [{}, {"mixed_precision": "bf16"}, {"dtype": "bf16"}, {"lora_r": 8},
                                {"lora_r": 8, "quantize": "4bit", "dtype": "bf16"}])
def test_checkpointing_never_raises_activations(kw):
    spec = load_spec("llama-3.2-1b")
    run = RunConfig.of(seq_len=1024, micro_batch=2, **kw)
    off, on = estimate(spec, run), estimate(spec, run.replace(grad_checkpointing=True))
    assert on.activations_per_layer < off.activations_per_layer
    assert on.peak_bytes <= off.peak_bytes


def test_sharding_divides_model_states():
    spec = load_spec("llama-2-7b")
    one = estimate(spec, RunConfig.of(seq_len=512, micro_batch=1, mixed_precision="bf16"))
    fsdp = estimate(spec, RunConfig.of(seq_len=512, micro_batch=1, mixed_precision="bf16", num_processes=8,
                                    sharding="fsdp"))
    assert fsdp.optimizer == one.optimizer // 8
    assert fsdp.peak_bytes < one.peak_bytes


def test_offloaded_fsdp_keeps_no_sharded_gradient_on_the_gpu():
    # FSDP2's CPUOffloadPolicy copies each reduce-scattered gradient shard to the host. tiny: 6,492,416
    # parameters, bf16 weights, fsdp over 2: 6,492,416 x 2 B / 2 = 6,492,416 B of sharded gradients per
    # rank without offload, none with it (the unsharded ones of the unit being reduced are temporaries).
    from memfit.memory.states import model_states

    spec = load_spec("tiny")
    run = RunConfig.of(seq_len=64, micro_batch=1, dtype="bf16", mixed_precision="no", num_processes=2, sharding="fsdp")
    assert model_states(spec, run).gradients == 6_492_416
    offloaded = model_states(spec, run.replace(offload="params"))
    assert offloaded.gradients == 0 and offloaded.weights == 0 and offloaded.optimizer == 0


def test_qlora_weights_are_nf4():
    spec = load_spec("llama-2-7b")
    b = estimate(spec, RunConfig.of(lora_r=16, quantize="4bit", dtype="bf16"))
    # By hand (memory.quantized): NF4 with double quantization per projection = numel/2 packed + numel/64
    # uint8 absmax + 4 x ceil(numel/64/256) nested fp32 absmax + 1,092 B of code tables and offset.
    #   q/k/v/o 4096 x 4096 = 16,777,216: 8,388,608 + 262,144 + 4,096 + 1,092 = 8,655,940
    #   gate/up/down 4096 x 11008 = 45,088,768: 22,544,384 + 704,512 + 11,008 + 1,092 = 23,260,996
    #   32 layers x (4 x 8,655,940 + 3 x 23,260,996) = 3,341,015,936
    # The other 262,410,240 parameters (embedding, head, norms) in --dtype (lean QLoRA, the default):
    # 524,820,480; in fp32 under --qlora-upcast full (PEFT's prepare_model_for_kbit_training casts them):
    # 1,049,640,960. Adapters r16 on the 7 projections, fp32: 32 x 16 x (4 x 8,192 + 3 x 15,104) x 4 =
    # 159,907,840. Buffers (rotary inv_freq and its original): 512.
    assert b.weights == 3_341_015_936 + 524_820_480 + 159_907_840 + 512
    full = estimate(spec, RunConfig.of(lora_r=16, quantize="4bit", dtype="bf16", qlora_upcast="full"))
    assert full.weights == 3_341_015_936 + 1_049_640_960 + 159_907_840 + 512


def test_speed_under_5ms():
    spec = load_spec("llama-3-8b")
    run = RunConfig.of(mixed_precision="bf16", lora_r=16)
    estimate(spec, run)  # once per model: asks transformers which attention it runs (a meta build, cached)
    start = time.process_time()  # CPU time: wall time on a loaded shared machine says more about the machine
    for _ in range(200):
        estimate(spec, run)
    assert (time.process_time() - start) / 200 < 5e-3


# ---------------------------------------------------------------------------------------------- CLI
def _run(*args):
    return CliRunner().invoke(cli, ["estimate", *args])


def test_cli_json_schema():
    res = _run("tiny", "--json", "--seq-len", "64", "--micro-batch", "2")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert {"model", "config", "params", "trainable_params", "peak_bytes", "phase", "breakdown", "method"} <= set(data)
    assert set(data["breakdown"]) == {"weights", "gradients", "optimizer", "activations", "logits", "temporary", "other"}
    assert data["method"] == "analytic" and data["peak_bytes"] == sum(data["breakdown"].values())


def test_cli_table_textbook():
    res = _run("llama-2-7b", "--mixed-precision", "no", "--seq-len", "512", "--micro-batch", "1")
    assert res.exit_code == 0, res.output
    assert "26,953,662,976" in res.output and "26.95" in res.output and "16.0 bytes/param" in res.output


def test_cli_compare_and_plot(tmp_path):
    png = tmp_path / "cmp.png"
    res = _run("smollm2-135m", "--compare", "--plot", str(png), "--seq-len", "512", "--micro-batch", "2")
    assert res.exit_code == 0, res.output
    for regime in ("fp32", "AMP fp16", "AMP bf16", "pure bf16", "LoRA", "QLoRA", "ckpt", "24 GiB"):
        assert regime in res.output
    assert png.stat().st_size > 1000
    data = json.loads(_run("smollm2-135m", "--compare", "--json").output)
    assert len(data["regimes"]) == 12 and all(r["peak_bytes"] > 0 for r in data["regimes"])


@pytest.mark.parametrize("args,message", [
    (["llama-2-7"], "Did you mean llama-2-7b"),
    (["tiny", "--micro-batch", "0"], "must be a positive whole number"),
    (["tiny", "--seq-len", "-5"], "must be a positive whole number"),
    (["tiny", "--lora-r", "8", "--lora-targets", "nope"], "matches no projection of tiny; its projections are: down_proj"),
    (["tiny", "--timeline", "x.png"], "add --exact"),
    # train refuses these, so estimate must not answer for them (analytic, --compare and --exact alike)
    (["tiny", "--seq-len", "1025"], "--seq-len 1025 is beyond the model's 1024 positions"),
    (["tiny", "--seq-len", "4096", "--compare"], "--seq-len 4096 is beyond the model's 1024 positions"),
    (["gpt2", "--seq-len", "2048", "--micro-batch", "1", "--exact"], "beyond the model's 1024 positions"),
])
def test_cli_bad_input(args, message):
    res = _run(*args)
    assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("content,message", [
    ('{"model_type": "nosuchtype", "hidden_size": 64}', "has model_type 'nosuchtype', which this transformers does not know"),
    ('{"model_type": "llama", "hidden_size": "abc"}', "has hidden_size = 'abc'; it must be a positive whole number"),
    ('"model_type"', "has no model_type"),
])
def test_cli_unreadable_config_json_is_one_sentence(tmp_path, content, message):
    (tmp_path / "config.json").write_text(content)
    res = _run(str(tmp_path / "config.json"))
    assert res.exit_code == 1 and res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    assert message in res.output
    res = _run(str(tmp_path))  # the folder holding it: one sentence too
    assert res.exit_code == 1 and res.output.startswith("error: ") and res.output.count("\n") == 1, res.output


def test_cli_unknown_optimizer_is_usage_error():
    res = _run("tiny", "--optimizer", "adam")
    assert res.exit_code == 2 and "adamw" in res.output


def test_cli_not_a_causal_lm(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "intermediate_size": 128}))
    res = _run(str(cfg))
    # BERT has a causal-LM head in transformers (BertLMHeadModel), but without is_decoder=true it
    # attends to the tokens it predicts: refused, with the fix named.
    assert res.exit_code == 1 and "is_decoder" in res.output and res.output.count("\n") == 1, res.output
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "is_decoder": True}))
    assert _run(str(cfg), "--device", "cpu").exit_code == 0
    # A vision config has no causal-LM class at all.
    cfg = tmp_path / "vit.json"
    cfg.write_text(json.dumps({"model_type": "vit"}))
    res = _run(str(cfg))
    assert res.exit_code == 1 and "causal language model" in res.output


def test_breakdown_units_are_mib_scale_for_tiny():
    b = estimate("tiny", RunConfig())
    assert b.other > 500 * MiB  # CUDA context on top by default


def test_checkpointed_recompute_counts_its_input_once():
    """A checkpointed layer's backward transient (the recompute's saved set + gradients) leaves out the input
    the checkpoint already keeps, where the recompute's first norm saves it uncast (fp32 stream), and keeps
    it where the norm saves a new fp32 copy (bf16 stream). Read off the trace's timeline: in fp32 the
    recompute's ``pow`` allocates nothing for its input. Golden numbers by hand for the test Llama
    (H 256, I 688, 4 heads of 64, 2 KV heads; B 2 x T 256 = 512 tokens, packed documents), bytes per token:
    fp32: norm 4H + 4 + 4H = 2,052 twice; q/k/v input 1,024 and gate/up input 1,024 (shared); SDPA with the
    packed mask (k, v repeated to 4 heads; the additive mask): 4 x 4 x 256 + 4 x 4 = 3,088 + 2 x 128 x 4 + 256 x 4 = 2,048;
    MLP 3 x 4 x 688 = 8,256 + down input 2,752: 22,296; gradients at the MLP-backward moment (the output's
    H and three I-wide ones, less the freed down input: ``activations._recompute_grads``) 4 x 256 + 2 x 4 x 688
    = 6,528; less the input 4 x 256: 27,800 x 512. bf16: norms 1,540 twice, inputs 512 twice, SDPA 1,552 +
    1,024, MLP 4,128 + 1,376: 12,184, gradients 2 x 256 + 2 x 2 x 688 = 3,264, nothing shared: 15,448 x 512."""
    from _trace_helpers import family_config
    from memfit.memory.activations import layer_activations
    from memfit.spec.resolved import resolve

    spec = spec_from_config(family_config("llama"), "llama")
    fp32 = resolve(spec, RunConfig.of(seq_len=256, micro_batch=2, grad_checkpointing=True), "cpu").run  # SDPA
    bf16 = fp32.replace(dtype="bf16")
    assert layer_activations(spec, fp32, Precisions.of(fp32), "cpu").backward_transient == 27_800 * 512
    assert layer_activations(spec, bf16, Precisions.of(bf16), "cpu").backward_transient == 15_448 * 512

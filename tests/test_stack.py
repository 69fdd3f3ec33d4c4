"""The stack (trainer + versions) is a setting of the prediction: what each trait adds or removes, to the byte.

Model: the ``tiny`` preset (Llama family, 8 layers, hidden H = 256, MLP I = 768, vocabulary 384, untied head),
micro-batch 2 x 64 tokens = 128 tokens, pure bf16, no checkpointing, on the CUDA target. Each golden number is
computed by hand next to its test from the source fact the trait models.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from memfit.errors import UserError
from memfit.interop import read
from memfit.memory.estimate import estimate
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack
from memfit.spec.model import load_spec

DATA = Path(__file__).parent / "data" / "interop"
LAYERS, H, MLP, TOKENS = 8, 256, 768, 2 * 64


def _run(**changes) -> RunConfig:
    base = dict(seq_len=64, micro_batch=2, dtype="bf16", mixed_precision="no", lora_r=8,
                lora_targets="q_proj,v_proj", optimizer="adamw", attn_implementation="sdpa", packing="concat")
    return RunConfig.of(**{**base, **changes})


def _forward(run: RunConfig, stack: Stack):
    return estimate("tiny", run, device="cuda", stack=stack).phase_peaks["forward"]


def test_bitsandbytes_before_0_43_2_keeps_each_4bit_layers_input():
    """bitsandbytes 0.42.0's ``MatMul4Bit`` keeps ``ctx.tensors = (A, B)``; 0.43.2 keeps only B. Per layer the new
    tensors it keeps are the second norm's output (read by gate and up: H bf16 = 512 B per token) and the MLP
    product (down's input: I bf16 = 1,536 B); q/k/v's input is the one LoRA's lora_A already saves (no dropout)
    and o_proj's the SDPA output. 8 layers x 128 tokens x 2,048 B = 2,097,152 B more at forward's end."""
    run = _run(quantize="4bit")
    old = _forward(run, Stack(bitsandbytes="0.42.0"))
    new = _forward(run, Stack(bitsandbytes="0.43.2"))
    assert old - new == LAYERS * TOKENS * (2 * H + 2 * MLP) == 2_097_152


def test_adapters_in_the_compute_dtype_halve_their_states():
    """torchtune builds LoRA in the model's bf16; PEFT keeps fp32 adapters. q (8 x (256 + 256)) and v
    (8 x (256 + 128)) adapters: 7,168 parameters per layer, 57,344 in all; AdamW's two moments in the
    parameter's dtype: 8 B each under PEFT (458,752 B), 4 B under torchtune (229,376 B); weights 2 B less each."""
    run = _run()
    peft = estimate("tiny", run, device="cuda", stack=Stack(trainer="hf", bitsandbytes="0.50.2"))
    torchtune = estimate("tiny", run, device="cuda", stack=Stack(trainer="torchtune"))
    assert peft.optimizer == 458_752 and torchtune.optimizer == 229_376
    assert peft.weights - torchtune.weights == 57_344 * 2


def test_litgpt_drops_the_fused_qkv_input_once():
    """LoRA with dropout on q, k and v: torchtune drops the input once per projection, litgpt once for its fused
    qkv (``lora.py`` L426). Each dropout keeps a bf16 dropped copy (2 H) and a bool mask (H): 768 B per token;
    two fewer per layer: 8 x 128 x 1,536 = 1,572,864 B less at forward's end (both keep bf16 adapters). litgpt's
    forward peaks at Fabric's output conversion, where its loop still holds the previous micro-batch's fp32 chunks:
    10 N (``memory.litgpt_loop``; N = 49,152), as transformers' loss holds 10 N, but without the decoder's last hidden
    state that transformers' loss keeps alive (H bf16 = 512 B a token: 65,536 B). 1,638,400 B in all."""
    run = _run(lora_targets="q_proj,k_proj,v_proj", lora_dropout=0.1)
    assert _forward(run, Stack(trainer="torchtune")) - _forward(run, Stack(trainer="litgpt")) == 1_572_864 + 65_536


def test_litgpts_4bit_base_quantizes_the_head():
    """Fabric's bitsandbytes plugin quantizes the head too: 384 x 256 = 98,304 weights in NF4 with double
    quantization are 49,152 (packed) + 1,536 (absmax) + 24 (nested absmax) + 1,092 (tables) = 51,804 B instead
    of 196,608 B in bf16: 144,804 B less resident."""
    run = _run(quantize="4bit")
    litgpt = estimate("tiny", run, device="cuda", stack=Stack(trainer="litgpt"))
    torchtune = estimate("tiny", run, device="cuda", stack=Stack(trainer="torchtune"))
    assert torchtune.weights - litgpt.weights == 144_804


@pytest.mark.parametrize(("version", "keeps"), [("0.42.0", True), ("0.43.1", True), ("0.43.2", False),
                                                ("0.50.2", False), (None, False)])
def test_which_bitsandbytes_keeps_the_input(version, keeps):
    assert Stack(bitsandbytes=version).keeps_4bit_input() is keeps


def test_a_stack_is_checked_in_one_sentence():
    with pytest.raises(UserError, match="Unknown trainer 'deepspeed-chat'"):
        Stack(trainer="deepspeed-chat")
    with pytest.raises(UserError, match="not a version"):
        Stack(bitsandbytes="latest")
    with pytest.raises(UserError, match="not pinned"):
        Stack.of({"trainer": "litgpt", "pinned": "yes"})
    assert Stack.of(None) == Stack() and Stack().is_memfit()
    assert Stack.of({"trainer": "litgpt", "bitsandbytes": "0.42.0"}).describe() == "litgpt, bitsandbytes 0.42.0"


def test_from_sets_the_stack_from_the_file():
    """The tool runs the file (torchtune: bf16 adapters, its chunked-output loss); Axolotl's FSDP without ``fsdp_version: 2`` is
    Accelerate's FSDP (1), priced by its flat parameters (memory.flat_params) with PEFT's policy (each LoRA matrix a
    unit): nothing left unpriced. With the adapters inside the layers' units (litgpt's Fabric) the per-rank split of
    their AdamW state is said."""
    torchtune = Stack(trainer="torchtune", chunked_output_loss=True)  # the file's loss: CEWithChunkedOutputLoss
    assert read(DATA / "torchtune_1B_lora_single_device.yaml").stack == torchtune
    axolotl = read(DATA / "axolotl_qlora_fsdp_llama2.yml").stack
    assert axolotl.trainer == "axolotl" and axolotl.fsdp == 1
    assert axolotl.unpriced() == ()
    assert any("FSDP (1)" in s for s in Stack(trainer="litgpt", fsdp=1).unpriced())


def test_litgpts_nf4_keeps_fp32_absmax():
    """``quantize: bnb.nf4`` is Fabric's ``_NF4Linear`` (``compress_statistics=False``): one fp32 absmax per 64
    weights and the NF4 code (64 B), against one uint8 absmax per 64, an fp32 one per 256 of those and 1,092 B of
    tables: 3 b - 4 ceil(b / 256) - 1,028 B more per weight of b blocks. q, o (b 1,024): 2,028; k, v (512): 500;
    gate, up, down (3,072): 8,140; per layer 29,476, 8 layers 235,808; the 4-bit head (1,536): 3,556. 239,364 B."""
    run = _run(quantize="4bit")
    single = estimate("tiny", run, device="cuda", stack=Stack(trainer="litgpt", double_quant=False))
    double = estimate("tiny", run, device="cuda", stack=Stack(trainer="litgpt"))
    assert single.weights - double.weights == 239_364


def test_the_planner_prices_a_tools_candidates_on_its_stack():
    """``plan --from`` a torchtune file prices its candidates as torchtune runs them, the number ``estimate --from``
    reads back from the emitted file."""
    import memfit
    from memfit.planning.gpus import load_gpus
    from memfit.planning.search import evaluate

    run, stack = _run(), Stack(trainer="torchtune")
    gpu = next(iter(load_gpus().values()))
    plan = evaluate(memfit.load_spec("tiny"), run, gpu, 2**34, stack=stack)
    assert plan.breakdown.peak_bytes == estimate("tiny", run, device="cuda", stack=stack).peak_bytes
    assert plan.breakdown.peak_bytes != estimate("tiny", run, device="cuda").peak_bytes
    assert memfit.config_stack("torchtune", read(DATA / "torchtune_1B_lora_single_device.yaml")) == Stack(
        trainer="torchtune", chunked_output_loss=True)  # the file's CEWithChunkedOutputLoss (memory.stack_terms)
    assert memfit.config_stack("axolotl") == Stack(trainer="axolotl")


@pytest.mark.slow  # traces the model on fake tensors
def test_a_derived_recipe_says_it_prices_memfits_stack():
    """A family priced by a derived recipe (traced on memfit's own stack) says that a stack's terms are not in it."""
    breakdown = estimate("tiny", _run(), device="cuda", derived=True, stack=Stack(trainer="litgpt"))
    assert any("hand-written recipes only" in n for n in breakdown.notes)


def test_litgpts_lora_loss_holds_fp32_chunks():
    """litgpt's LoRA loop runs the head in 128-token chunks, Fabric hands them back in fp32, and the loss is
    ``F.cross_entropy`` per chunk: N = 2 x 64 x 384 = 49,152 logits (one chunk here: T is 64 < 128). Forward's
    end: fp32 logits + fp32 log_softmax output = 8 N = 393,216 B; backward's start: + one chunk's two fp32
    gradients and its bf16 cast (10 N) = 884,736 B; the loop's ``logits`` still holds 4 N = 196,608 B after."""
    from memfit.memory.activations import LogitsTerms, Precisions
    from memfit.memory.stack_terms import logits
    from memfit.spec.model import load_spec

    spec, prec = load_spec("tiny"), Precisions.of(_run())
    assert logits(spec, _run(), prec, Stack(trainer="litgpt")) == LogitsTerms(393_216, 884_736, 196_608)
    assert logits(spec, _run(lora_r=0), prec, Stack(trainer="litgpt")) is None  # finetune/full.py: the whole head
    assert logits(spec, _run(), prec, Stack(trainer="torchtune")) is None


def test_a_trainer_that_runs_as_memfit_adds_no_note():
    """Axolotl runs transformers' Trainer with PEFT: its estimate says nothing about a stack; litgpt's names it."""
    assert not any("stack:" in n for n in estimate("tiny", _run(), stack=Stack(trainer="axolotl")).notes)
    assert any("stack: litgpt" in n for n in estimate("tiny", _run(), stack=Stack(trainer="litgpt")).notes)


@pytest.mark.slow  # traces the model on fake tensors
def test_the_exact_trace_says_it_runs_memfits_stack():
    """``estimate --from FILE --exact`` traces memfit's own stack (transformers, PEFT); a file run by litgpt says so."""
    from memfit.memory.trace import trace

    run = _run(seq_len=16, micro_batch=1)
    traced = trace("tiny", run, device="cpu", stack=Stack(trainer="litgpt"))
    assert any("the exact trace runs memfit's own stack" in n for n in traced.notes)
    assert not any("stack:" in n for n in trace("tiny", run, device="cpu", stack=Stack(trainer="trl")).notes)


@pytest.mark.slow  # traces the model on fake tensors
def test_peft_keeps_one_dropped_copy_per_adapted_projection():
    """memfit's own stack (PEFT), fp32 weights, LoRA dropout on q and v: each adapter's ``lora_A`` saves its own
    dropped copy of the input (q's and v's: two H-wide fp32 tensors per token), not the shared input once. The
    analytic estimate matches the exact trace's backward within 0.1% on the CPU (counting the input once, as
    before issue 35, was 2.3% under the trace)."""
    from memfit.memory.trace import trace

    run = _run(dtype="fp32", lora_dropout=0.1)
    analytic = estimate("tiny", run, device="cpu", derived=False).phase_peaks["backward"]
    traced = trace("tiny", run, device="cpu").phase_peaks["backward"]
    assert abs(analytic - traced) / traced < 0.001


def test_axolotl_fsdp1_with_cpu_ram_efficient_loading_loads_low_memory(tmp_path):
    """Accelerate's ``fsdp_cpu_ram_efficient_loading: true`` under FSDP (1) makes transformers load rank 0's base into
    host memory and the others' on meta: the stack read from the file says so; without it, every rank loads it."""
    from memfit.interop import read

    base = "base_model: tiny\nmicro_batch_size: 1\nfsdp: [full_shard, auto_wrap]\nfsdp_config:\n"
    lean, whole = tmp_path / "lean.yml", tmp_path / "whole.yml"
    lean.write_text(base + "  fsdp_cpu_ram_efficient_loading: true\n")
    whole.write_text(base + "  fsdp_offload_params: false\n")
    assert read(lean).stack.loads_low_memory() and read(lean).stack.fsdp == 1
    assert not read(whole).stack.loads_low_memory()


def test_axolotl_fsdp1_no_shard_is_priced_as_its_whole_flat_parameters(tmp_path):
    """Accelerate's ``fsdp_sharding_strategy: NO_SHARD`` under FSDP (1) keeps every flat parameter whole: memfit spells
    it ``--sharding ddp`` under ``Stack(fsdp=1)`` (``memory.flat_params``), not ``fsdp``."""
    from memfit.interop import read

    path = tmp_path / "noshard.yml"
    path.write_text("base_model: tiny\nmicro_batch_size: 1\nfsdp: [auto_wrap]\nfsdp_config:\n"
                    "  fsdp_sharding_strategy: NO_SHARD\n")
    got = read(path)
    assert (got.run.sharding.value, got.stack.fsdp) == ("ddp", 1)


def test_torchaos_nf4_shards_its_scalers_with_its_weights(monkeypatch):
    """torchtune's 4-bit base is torchao's ``NF4Tensor``, which FSDP2 splits, pads and all-gathers with its scalers
    (``_INNER_TENSOR_NAMES_FOR_SHARDING``); bitsandbytes' quantization state is a module attribute, whole on every rank.
    Per layer of ``tiny`` the state of each projection is one uint8 absmax per 64 weights, one fp32 nested absmax per
    256 of those and 1,092 B of tables (NF4 code 64 B + dynamic map 1,024 B + offset 4 B):
    q, o (65,536 weights): 1,024 + 16 + 1,092 = 2,132 B each; k, v (32,768): 512 + 8 + 1,092 = 1,612 B each;
    gate, up, down (196,608): 3,072 + 48 + 1,092 = 4,212 B each: 2 x 2,132 + 2 x 1,612 + 3 x 4,212 = 20,124 B per
    layer, 160,992 B for 8 layers. Sharded over 2 ranks each holds half: 80,496 B less per rank."""
    import dataclasses

    from memfit.settings.stack import TRAINERS

    monkeypatch.setitem(TRAINERS, "torchtune-replicated",
                        dataclasses.replace(TRAINERS["torchtune"], shards_quant_state=False))
    run = _run(quantize="4bit", num_processes=2, sharding="fsdp")
    sharded = estimate("tiny", run, device="cuda", stack=Stack(trainer="torchtune")).weights
    whole = estimate("tiny", run, device="cuda", stack=Stack(trainer="torchtune-replicated")).weights
    assert whole - sharded == 80_496
    one = _run(quantize="4bit")  # one process: nothing to shard
    assert (estimate("tiny", one, device="cuda", stack=Stack(trainer="torchtune")).weights
            == estimate("tiny", one, device="cuda", stack=Stack(trainer="torchtune-replicated")).weights)


def test_reentrant_checkpointing_keeps_a_quantized_layers_ctx_tensors_for_one_layer():
    """transformers before 5 checkpoints reentrantly when the trainer passes no kwargs (``Stack.checkpoints_reentrant``):
    each layer's forward runs under ``no_grad``, so bitsandbytes 0.42.0's ``ctx.tensors`` (a 4-bit layer's input) are
    made only while a layer recomputes. Non-reentrant, every layer keeps them through the step: the attention norm's
    output (q, k, v's input), the attention output (o's), the MLP norm's output (gate and up's) and the MLP product
    (down's), (3 x 256 + 768) x 2 B = 3,072 B a token, x 128 tokens x 8 layers = 3,145,728 B more saved at the peak."""
    run = _run(quantize="4bit", grad_checkpointing=True)

    def held(stack: Stack):
        b = estimate("tiny", run, device="cuda", stack=stack)
        return b.activations, b.peak_bytes - b.other

    every = held(Stack(trainer="hf", bitsandbytes="0.42.0"))  # transformers 5 (unnamed): non-reentrant
    one = held(Stack(trainer="hf", bitsandbytes="0.42.0", transformers="4.41.0"))
    assert every[0] - one[0] == 3_145_728
    # the recomputed layer still holds them during its backward: above the bitsandbytes that keeps none
    assert held(Stack(trainer="hf"))[1] < one[1] < every[1]
    # the file's own setting wins over the version's default, and transformers 5 is non-reentrant
    assert held(Stack(trainer="hf", bitsandbytes="0.42.0", transformers="4.41.0", reentrant_checkpointing=False)) == every
    assert held(Stack(trainer="hf", bitsandbytes="0.42.0", transformers="5.1.0")) == every
    assert Stack(trainer="hf", transformers="4.41.0", reentrant_checkpointing=False).describe() == \
        "hf, transformers 4.41.0, non-reentrant checkpointing"


def test_reentrant_checkpointing_is_read_from_the_file(tmp_path):
    """LLaMA-Factory checkpoints reentrantly unless ``use_reentrant_gc: false`` (model_args.py L149-151); a TRL file says
    it in ``gradient_checkpointing_kwargs``."""
    base = {"model_name_or_path": "tiny", "stage": "sft", "do_train": True, "finetuning_type": "lora",
            "quantization_bit": 8}
    factory = tmp_path / "factory.yaml"
    factory.write_text(yaml.safe_dump(base))
    assert read(str(factory)).stack.checkpoints_reentrant()
    factory.write_text(yaml.safe_dump({**base, "use_reentrant_gc": False}))
    assert not read(str(factory)).stack.checkpoints_reentrant()
    trl = tmp_path / "sft.yaml"
    trl.write_text(yaml.safe_dump({"model_name_or_path": "tiny", "max_length": 64, "gradient_checkpointing": True,
                                   "gradient_checkpointing_kwargs": {"use_reentrant": True}}))
    assert read(str(trl)).stack.checkpoints_reentrant()


def test_axolotl_fsdp1_accumulation_keeps_the_adapters_whole_gradients_on_the_device():
    """axolotl's examples/llama-2/qlora-fsdp.yml: FSDP (1) with fsdp_offload_params, 4 micro-batches a step. The three
    before the last run under no_sync (transformers' Trainer through Accelerate), which keeps each LoRA unit's
    unsharded gradient on the device, offload or not. LoRA r 32 on every linear of Llama 2 7B, per layer: q, k, v, o
    32 x (4,096 + 4,096) = 262,144 each; gate, up, down 32 x (4,096 + 11,008) = 483,328 each: 2,498,560; 32 layers:
    79,953,920 fp32 gradients, 319,815,680 B (305.0 MiB), said under the estimate."""
    from memfit.interop import read

    got = read(DATA / "axolotl_qlora_fsdp_llama2.yml")
    assert (got.run.grad_accum, got.run.offload.value, got.stack.fsdp) == (4, "params", 1)
    # the file names no process count (a launch does): priced on 2
    notes = estimate(got.model, got.run.replace(num_processes=2), stack=got.stack).notes
    assert any("(no_sync): 305.0 MiB." in n for n in notes), notes


def test_an_older_transformers_keeps_each_layers_rotary_caches():
    """transformers 4.31-4.40 give every Llama attention layer cos and sin caches of (max_position_embeddings,
    head_dim) (4.37.2 ``modeling_llama.py`` L134-146; gone in 4.41.0), whole on every rank. Llama-2 7B, hand-derived:
    32 layers x 2 tables x 4,096 positions x 128 = 33,554,432 elements; fsdp_qlora builds its 4-bit model with no
    torch_dtype (train.py L577), so fp32: 134,217,728 B; its LoRA model under bf16: 67,108,864 B. The loss is the same
    in 4.37.2 and 4.40.0 (fp32 logits, a shifted copy), so the estimates differ by the caches alone, in the step and in
    the wrapping phase."""
    from memfit.memory.phases import device_phases

    spec = load_spec("llama-2-7b")
    qlora = RunConfig.of(seq_len=512, micro_batch=1, dtype="bf16", mixed_precision="no", lora_r=8, quantize="4bit",
                         num_processes=2, sharding="fsdp", grad_checkpointing=True)
    lora = qlora.replace(quantize="none")

    def stack(release):
        return Stack(trainer="answerai-fsdp-qlora", transformers=release, fsdp=1)

    for run, caches in ((qlora, 134_217_728), (lora, 67_108_864)):
        old, new = (estimate(spec, run, device="cuda", stack=stack(r)) for r in ("4.40.0", "4.41.0"))
        assert old.weights - new.weights == caches
        wrapped = [device_phases(spec, run, b, stack=stack(r)).phases[1] for b, r in ((old, "4.40.0"), (new, "4.41.0"))]
        assert wrapped[0].name == "wrapping" and wrapped[0].tensors - wrapped[1].tensors == caches
    assert stack("4.37.2").keeps_rope_caches() and stack("4.31.0").keeps_rope_caches()
    assert not stack("4.30.2").keeps_rope_caches() and not stack(None).keeps_rope_caches()
    assert not Stack(trainer="torchtune", transformers="4.37.2").keeps_rope_caches()  # torchtune's own model code
    # a model type whose caches are not dated: not priced
    mistral = estimate(load_spec("mistral-7b"), qlora, device="cuda", stack=stack("4.37.2")).weights
    assert mistral == estimate(load_spec("mistral-7b"), qlora, device="cuda", stack=stack("4.41.0")).weights

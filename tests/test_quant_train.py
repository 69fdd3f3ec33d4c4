"""QLoRA (4-bit and 8-bit bases) and 8-bit AdamW trained on the CPU through bitsandbytes (>= 0.50 runs there):
the 2-layer hidden-64 Llama of ``_train_helpers`` (random init from a config.json, quantized by a save and
``from_pretrained``), byte tokenizer, fp32 compute (memfit's CPU default). Each run takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _train_helpers import crash_after_first_checkpoint_then_resume, metrics, tiny_config, write_text
from memfit.errors import UserError
from memfit.integrations import quant_support
from memfit.settings.config import RunConfig
from memfit.training.loop import run_training
from memfit.training.setup import preflight

bnb = pytest.importorskip("bitsandbytes")  # installed by scripts/setup.sh (the quant extra): runs in CI


def _qlora(tmp_path, quantize="4bit", **overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = {"lora_r": 8, "quantize": quantize, "optimizer": "adamw", "seq_len": 64, **overrides.pop("run", {})}
    return tiny_config(tmp_path, data=write_text(tmp_path), packing=True, lr=1e-2, run=run, **overrides)


def test_capability_rule_and_its_sentences():
    assert quant_support.refusal("cpu", "--quantize 4bit", "0.50.2") is None
    assert quant_support.refusal("cuda", "--quantize 4bit", "0.45.0", probe=False) is None
    old = quant_support.refusal("cpu", "--quantize 4bit", "0.45.0")
    assert old == ("--quantize 4bit on the CPU needs bitsandbytes >= 0.50 (installed: 0.45.0); upgrade it with "
                   "pip install -U 'memfit[quant]'.")
    assert "pip install 'memfit[quant]'" in quant_support.refusal("cpu", "--optimizer adamw-8bit", "")


def test_preflight_refuses_without_bitsandbytes(monkeypatch):
    preflight(RunConfig.of(lora_r=4, quantize="4bit"))  # installed here: runs on this CPU
    preflight(RunConfig.of(optimizer="adamw-8bit"))
    monkeypatch.setattr(quant_support, "installed_version", lambda: "")
    for run, flag in ((RunConfig.of(lora_r=4, quantize="8bit"), "--quantize 8bit"),
                      (RunConfig.of(optimizer="adamw-8bit"), "--optimizer adamw-8bit")):
        with pytest.raises(UserError, match=rf"^{flag} needs bitsandbytes, which is not installed"):
            preflight(run)


def test_compute_dtype_follows_the_run():
    assert quant_support.bnb_config(RunConfig.of(lora_r=4, quantize="4bit")).bnb_4bit_compute_dtype == torch.float32
    bf16 = RunConfig.of(lora_r=4, quantize="4bit", mixed_precision="bf16")
    assert quant_support.bnb_config(bf16).bnb_4bit_compute_dtype == torch.bfloat16
    assert quant_support.compute_bytes(bf16) == 2 and quant_support.compute_bytes(RunConfig.of(dtype="bf16")) == 2


def test_qlora_4bit_trains_and_merge_keeps_a_4bit_base(tmp_path):
    cfg = _qlora(tmp_path, max_steps=10, merge=True)
    res = run_training(cfg, show=False)
    packed = [m for m in res.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(packed) == 14  # 7 projections x 2 layers, each NF4
    assert all(m.weight.dtype == torch.uint8 and m.compute_dtype == torch.float32 for m in packed)
    # Parameters counted as the model's, not as packed bytes: the unquantized tiny Llama has 123,200 (embedding
    # and head 384 x 64 each, 2 layers x (q 4,096 + k 2,048 + v 2,048 + o 4,096 + 3 x 8,192 + 2 norms x 64), final
    # norm 64), plus the adapters.
    assert res.summary.params == 123_200 + res.summary.trainable_params
    losses = [m["loss"] for m in metrics(cfg.folder.output)]
    assert losses[-1] < losses[0] - 0.3  # 5.96 (about ln 384) falls to ~5.5 in 10 steps at lr 1e-2
    # --merge on a 4-bit base: PEFT dequantizes, adds the adapter and quantizes again, so the merged model
    # is itself a 4-bit checkpoint (its config says so) that loads back through bitsandbytes.
    merged = Path(cfg.folder.output) / "merged"
    assert json.loads((merged / "config.json").read_text())["quantization_config"]["load_in_4bit"] is True
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(merged, device_map="cpu")
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in reloaded.modules()) == 14


@pytest.mark.parametrize("quantize", ["4bit", "8bit"])
def test_qlora_resume_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch, quantize):
    # 4-bit: the checkpoint's quantization state goes back through quant_support.accept_own_quant_state.
    full = run_training(_qlora(tmp_path / "a", quantize, max_steps=4, warmup_steps=2), show=False)
    cfg = _qlora(tmp_path / "b", quantize, max_steps=4, save_every=2, warmup_steps=2)
    resumed = crash_after_first_checkpoint_then_resume(cfg, monkeypatch)
    assert resumed.summary.steps == 4
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and any("lora_A" in k for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name  # adapters and the packed base, bit for bit


def test_8bit_base_with_8bit_adamw_trains(tmp_path):
    cfg = _qlora(tmp_path, "8bit", max_steps=8, run={"optimizer": "adamw-8bit"})
    res = run_training(cfg, show=False)
    assert sum(isinstance(m, bnb.nn.Linear8bitLt) for m in res.model.modules()) == 14
    losses = [m["loss"] for m in metrics(cfg.folder.output)]
    assert losses[-1] < losses[0] - 0.2


def test_8bit_adamw_trains_a_full_finetune_on_cpu(tmp_path, monkeypatch):
    steps = []
    real_step = bnb.optim.AdamW8bit.step
    monkeypatch.setattr(bnb.optim.AdamW8bit, "step", lambda self, *a, **k: steps.append(1) or real_step(self, *a, **k))
    cfg = tiny_config(tmp_path, data=write_text(tmp_path), packing=True, max_steps=6, lr=1e-2,
                      run={"optimizer": "adamw-8bit", "seq_len": 64})
    run_training(cfg, show=False)
    assert len(steps) == 6  # bitsandbytes' 8-bit AdamW took every step
    losses = [m["loss"] for m in metrics(cfg.folder.output)]
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.heavy
def test_budget_on_cpu_plans_qlora_and_trains_it(tmp_path):
    # A Llama whose projections dominate (hidden 512, intermediate 2048, 2 layers, vocab 512: 7.9 M of its
    # 8.4 M parameters are projections). With --lora-r 8, the smallest LoRA plan on this CPU needs ~23.1 MB
    # (bf16 base) and the smallest QLoRA one ~15.8 MB (NF4 base): a 17 MiB budget (17.8 MB, 5% margin kept)
    # holds only QLoRA, so the planner must choose it (bitsandbytes runs here) and memfit train must run it.
    import torch
    from click.testing import CliRunner
    from transformers import LlamaConfig, LlamaForCausalLM

    from _train_helpers import write_qa
    from memfit.cli import cli

    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "wide")
    result = CliRunner().invoke(cli, ["train", "--model", str(tmp_path / "wide"), "--tokenizer", "byte",
                                      "--data", write_qa(tmp_path), "--seq-len", "64", "--batch", "4", "--lora-r", "8",
                                      "--budget", "17MiB", "--max-steps", "2", "--eval-every", "0", "--samples", "0",
                                      "--output", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["run"]["quantize"] == "4bit" and summary["run"]["lora_r"] == 8
    assert summary["steps"] == 2 and summary["fallbacks"] == []


def test_qlora_on_a_shape_the_cpu_inference_kernel_cannot_pack_evaluates_and_exports(tmp_path, monkeypatch):
    """intermediate_size 176 (not a multiple of 32): on a CPU with AVX512-BF16, bitsandbytes' Linear4bit repacks
    its weight for a fused inference kernel at the first forward outside training and asserts "N must be
    divisible by block_n", so the run used to die at its first evaluation after training. memfit keeps every
    layer on training's path (quant_support.keep_training_path). This machine may lack AVX512-BF16, so the
    layers are built as on one that has it."""
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    cfg = _qlora(tmp_path, max_steps=4, eval_every=2, eval_fraction=0.1, samples=1)
    model = json.loads(Path(cfg.source.model).read_text())
    Path(cfg.source.model).write_text(json.dumps({**model, "intermediate_size": 176}))
    res = run_training(cfg, show=False)
    assert res.summary.steps == 4 and res.summary.final_eval_loss is not None
    layers = [m for m in res.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert {m.out_features for m in layers} >= {176}
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    assert (Path(cfg.folder.output) / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_lean_and_full_upcast_train_the_same_curve(tmp_path):
    # A bf16 base: lean keeps its norms, embeddings and head (and the residual stream) in bf16, full is PEFT's
    # fp32 cast. The adapters (fp32 in both) must follow the same loss curve: within 1% relative per step
    # (bench/README.md "Lean QLoRA": 0.10% over 15 steps of the demo).
    curves = {}
    for upcast in ("lean", "full"):
        cfg = _qlora(tmp_path / upcast, max_steps=6, warmup_steps=2,
                     run={"dtype": "bf16", "qlora_upcast": upcast, "lora_r": 8})
        run_training(cfg, show=False)
        curves[upcast] = [m["loss"] for m in metrics(cfg.folder.output) if "loss" in m]
    assert len(curves["lean"]) == len(curves["full"]) == 6
    assert curves["lean"][-1] < curves["lean"][0]  # it trains
    for lean, full in zip(curves["lean"], curves["full"], strict=True):
        assert abs(lean / full - 1) < 0.01, curves

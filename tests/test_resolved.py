"""One resolved run: the optimizer table, the LoRA matcher and the attention transformers runs, read
alike by estimate, trace, plan and train; versions outside the verified range are said."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from _train_helpers import TINY_LLAMA, write_qa
from memfit.cli import cli
from memfit.errors import UserError
from memfit.integrations import versions
from memfit.memory.estimate import estimate
from memfit.settings.config import Optimizer, RunConfig, TrainConfig
from memfit.spec import optimizers
from memfit.spec.model import load_spec, spec_from_config
from memfit.spec.resolved import attention, lora_targets, resolve

TINY_GEMMA2 = {
    "model_type": "gemma2", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "sliding_window": 32, "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 384, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256,
             "bos_token_id": 1, "eos_token_id": 2}


def _config_file(tmp_path: Path, data: dict, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder / "config.json")


@pytest.fixture
def tiny(tiny_llama_config):
    return spec_from_config(tiny_llama_config, "tiny-test")


# ------------------------------------------------------------------------------------------ optimizer table
@pytest.mark.parametrize("member", list(Optimizer))
def test_every_optimizer_has_a_row(member):
    r = optimizers.row(member)
    assert r.member is member and callable(r.build) and r.devices and r.step_temporary in ("group", "largest-x2", "none")


@pytest.mark.parametrize("member", list(Optimizer))
def test_a_row_change_is_seen_by_estimate_cost_trace_and_train(member, tiny, monkeypatch):
    """Replace the member's row by a made-up optimizer; every consumer must answer with the made-up numbers."""
    from memfit.memory import trace
    from memfit.planning.cost import optimizer_bytes
    from memfit.training.setup import build_optimizer

    built = []

    def spy(groups, lr, cuda_like=False):
        built.append(cuda_like)
        return "built by the row"

    fake = dataclasses.replace(optimizers.row(member), moments=5, fixed_state_bytes=0.0, factored=False,
                               step_temporary="none", single_tensor_temporary="none", traffic=lambda p: 77.0 * p, devices=("cuda", "cpu"),
                               traceable=True, build=spy)
    monkeypatch.setitem(optimizers.OPTIMIZERS, member, fake)
    run = RunConfig.of(seq_len=16, micro_batch=2, optimizer=member)
    # fp32 full fine-tune: 5 state tensors of 4 bytes per trainable parameter, no step temporary
    b = estimate(tiny, run, device="cpu")
    weights = 4 * tiny.params + tiny.buffer_bytes
    assert b.phase_peaks["optimizer"] == weights + 4 * tiny.params + 5 * 4 * tiny.params
    assert optimizer_bytes(run) == 77.0 * 4
    model = _TinyModel()
    assert build_optimizer(model, run, TrainConfig()) == "built by the row"
    assert trace._build_optimizer(model, run) == "built by the row"
    assert built == [False, True]  # training on this machine's default; the trace as torch picks on CUDA


class _TinyModel:
    def parameters(self):
        import torch

        return iter([torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))])


def test_optimizer_the_device_cannot_run(monkeypatch):
    # bitsandbytes' 8-bit AdamW runs on both (on the CPU from bitsandbytes 0.50: memfit.integrations.quant_support decides
    # whether this machine's install can); a row limited to CUDA is refused on the CPU in one sentence.
    optimizers.check_device("adamw-8bit", "cpu")
    optimizers.check_device("adamw-8bit", "cuda")
    cuda_only = dataclasses.replace(optimizers.OPTIMIZERS[Optimizer.ADAMW_8BIT], devices=("cuda",))
    monkeypatch.setitem(optimizers.OPTIMIZERS, Optimizer.ADAMW_8BIT, cuda_only)
    with pytest.raises(UserError, match="--optimizer adamw-8bit runs on CUDA only, not on CPU"):
        optimizers.check_device("adamw-8bit", "cpu")


# ------------------------------------------------------------------------------------------ LoRA targets
def test_lora_targets_one_matcher(tiny):
    all_linear = lora_targets(tiny, ("all-linear",))
    # 7 projections x 2 layers; combinations and case do not change the set, a module is wrapped once
    assert len(all_linear.shapes) == 14
    for same in (("all-linear", "q_proj"), ("ALL-LINEAR",), ("All-Linear", "Q_PROJ", "v_proj")):
        assert lora_targets(tiny, same).shapes == all_linear.shapes
    assert lora_targets(tiny, ("Q_PROJ", "v_proj")).names == ("q_proj", "v_proj")
    assert lora_targets(tiny, ("layers.1.self_attn.q_proj",)).shapes == (("model.layers.1.self_attn.q_proj", 64, 64),)
    with pytest.raises(UserError, match=r"--lora-targets nope matches no projection of tiny-test; its projections "
                                        r"are: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        lora_targets(tiny, ("q_proj", "nope"))
    with pytest.raises(UserError, match="matches no projection"):
        lora_targets(tiny, ("lm_head",))  # the output head is not a projection LoRA targets (as all-linear)


@pytest.mark.parametrize("data", [TINY_LLAMA, TINY_GPT2], ids=["llama", "gpt2"])
def test_all_linear_is_what_peft_expands(data):
    """memfit's all-linear must be PEFT's own expansion (not a copy that may drift)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(data)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    spec = spec_from_config(config, "t")
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    wrapped = {name.removeprefix("base_model.model.") for name, m in model.named_modules() if hasattr(m, "lora_A")
               and not name.endswith(("lora_A", "lora_B"))}
    assert {name for name, _, _ in lora_targets(spec, ("all-linear",)).shapes} == wrapped


# ------------------------------------------------------------------------------------------ attention
def test_attention_is_asked_of_transformers(tmp_path, tiny):
    gemma = load_spec(_config_file(tmp_path, TINY_GEMMA2, "gemma2"))
    assert attention(gemma, "auto") == "eager"  # Gemma 2: soft-capping, transformers refuses SDPA
    assert attention(tiny, "auto") == "sdpa"
    assert attention(tiny, "eager") == "eager"
    with pytest.raises(UserError, match=r"cannot run --attn-implementation sdpa \(Gemma2ForCausalLM does not support"):
        attention(gemma, "sdpa")
    # The estimate prices what runs: auto on Gemma 2 is the eager estimate, on Llama the SDPA one.
    run = RunConfig.of(seq_len=32, micro_batch=2)
    assert estimate(gemma, run, device="cpu") .activations == estimate(gemma, run.replace(attn_implementation="eager"),
                                                                      device="cpu").activations
    assert estimate(tiny, run, device="cpu").activations == estimate(tiny, run.replace(attn_implementation="sdpa"),
                                                                     device="cpu").activations
    assert estimate(tiny, run, device="cpu").activations != estimate(tiny, run.replace(attn_implementation="eager"),
                                                                     device="cpu").activations


def test_flash_attention_without_its_package_is_one_sentence(tiny):
    pytest.importorskip("torch")
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    # the same sentence as memfit train's preflight (validate.check_attention_available): said in one place
    with pytest.raises(UserError, match="flash_attention_2 needs the flash-attn package, which is not installed"):
        attention(tiny, "flash_attention_2")


def test_gemma_2_2b_preset_resolves_to_eager():
    resolved = resolve(load_spec("gemma-2-2b"), RunConfig())
    assert resolved.attention == "eager"
    assert "attention: eager, chosen by transformers." in estimate("gemma-2-2b", RunConfig()).notes


# ------------------------------------------------------------------------------------------ the three paths agree
@pytest.mark.parametrize("model,targets", [
    (TINY_LLAMA, "all-linear,q_proj"), (TINY_LLAMA, "ALL-LINEAR"), (TINY_LLAMA, "Q_PROJ,v_proj"),
    (TINY_GPT2, "attn.c_proj"), (TINY_GEMMA2, "all-linear"), (TINY_GEMMA2, None)])
def test_estimate_trace_and_train_build_the_same_run(tmp_path, model, targets):
    """Same flags: the same trainable parameters and the same attention in estimate, trace and train."""
    from memfit.memory.trace import trace
    from memfit.training.setup import build_model

    path = _config_file(tmp_path, model, model["model_type"])
    run = RunConfig.of(seq_len=16, micro_batch=1, optimizer="sgd",
                    **({"lora_r": 4, "lora_targets": targets} if targets else {}))
    est = estimate(path, run, device="cpu")
    exact = trace(path, run, device="cpu")
    bundle = build_model(TrainConfig.of(model=path, tokenizer="byte", run=run), run)
    assert est.trainable_params == exact.trainable_params == bundle.trainable_params
    assert est.attn_implementation == exact.attn_implementation == bundle.attention
    assert est.lora_targets == exact.lora_targets == bundle.lora_targets
    if targets == "attn.c_proj":  # GPT-2's attention output only, not the MLP's c_proj of the same name
        assert est.trainable_params == 2 * 4 * (64 + 64)


def test_tiny_gemma2_trains(tmp_path):
    """Gemma 2 used to crash in train (SDPA requested); two steps at a small sequence length run."""
    res = CliRunner().invoke(cli, [
        "train", "--model", _config_file(tmp_path, TINY_GEMMA2, "gemma2"), "--tokenizer", "byte",
        "--data", write_qa(tmp_path), "--seq-len", "32", "--micro-batch", "1", "--max-steps", "2",
        "--eval-every", "0", "--samples", "0", "--output", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["steps"] == 2 and summary["attn_implementation"] == "eager"


# ------------------------------------------------------------------------------------------ versions
def test_versions_outside_the_verified_range_are_noted(tiny, monkeypatch):
    assert versions.notes({"transformers": "5.24.0", "torch": "2.13.0+cpu"}) == []
    monkeypatch.setattr(versions, "installed_version", {"transformers": "4.46.3", "torch": "2.13.0"}.get)
    b = estimate(tiny, RunConfig.of(seq_len=16, micro_batch=2), device="cpu")
    said = [line for line in b.notes if "outside the range" in line]
    low, high = versions.VERIFIED["transformers"]
    assert said == ["transformers 4.46.3 is outside the range memfit's estimator is verified on (transformers "
                    f">={low},<{high}); its modeling code may save other tensors, so check with --exact."]


def test_pyproject_declares_the_verified_range():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["memfit"]["verified"]
    assert declared == {name: f">={low},<{high}" for name, (low, high) in versions.VERIFIED.items()}


# ------------------------------------------------------------------------------------------ bad input, via the CLI
def _bad_cases(tmp_path):
    gemma = _config_file(tmp_path, TINY_GEMMA2, "gemma2")
    llama = _config_file(tmp_path, TINY_LLAMA, "llama")
    t5 = _config_file(tmp_path, {"model_type": "t5"}, "t5")
    return {
        "not a causal LM": ([t5], "cannot build as a causal language model"),
        "attention it cannot run": ([gemma, "--attn-implementation", "sdpa"],
                                    "cannot run --attn-implementation sdpa (Gemma2ForCausalLM does not support"),
        "LoRA target matching nothing": ([llama, "--lora-r", "4", "--lora-targets", "q_proj,qkv"],
                                         "--lora-targets qkv matches no projection of"),
    }


@pytest.mark.parametrize("case", ["not a causal LM", "attention it cannot run", "LoRA target matching nothing"])
def test_bad_input_is_one_sentence_and_writes_nothing(tmp_path, case):
    args, message = _bad_cases(tmp_path)[case]
    out = tmp_path / "out"
    results = {
        "estimate": CliRunner().invoke(cli, ["estimate", *args, "--device", "cpu"]),
        "train": CliRunner().invoke(cli, ["train", "--model", args[0], *args[1:], "--tokenizer", "byte",
                                          "--data", write_qa(tmp_path), "--max-steps", "1", "--output", str(out)]),
    }
    for command, res in results.items():
        assert res.exit_code == 1, (command, res.output)
        assert "Traceback" not in res.output
        errors = [line for line in res.output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], (command, res.output)
    assert not out.exists()


@pytest.mark.slow
def test_gemma_2_2b_preset_traces():
    """The full-size preset through --exact (minutes on 2 cores: slow). It used to end in transformers'
    "does not support scaled_dot_product_attention" traceback."""
    res = CliRunner().invoke(cli, ["estimate", "gemma-2-2b", "--exact", "--seq-len", "16", "--micro-batch", "1",
                                   "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["attn_implementation"] == "eager" and data["method"] == "exact"


def test_lora_on_gpt2s_conv1d_projections_is_wrapped_without_peft_warning():
    """gpt2's projections are transformers' ``Conv1D`` (weights stored (in, out)): memfit's ``LoraConfig`` says
    ``fan_in_fan_out=True`` there, which PEFT otherwise sets itself with a ``UserWarning`` (shown on every gpt2 LoRA
    ``--exact`` and training run before); a Llama's ``nn.Linear`` projections keep PEFT's default (False)."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.spec.lora import wrap_lora

    def wrapped(model_type, **fields):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
        run = RunConfig.of(lora_r=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return wrap_lora(model, run, ("c_attn", "c_proj", "c_fc") if model_type == "gpt2" else ("q_proj", "v_proj"))

    gpt2 = wrapped("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=300)
    assert gpt2.peft_config["default"].fan_in_fan_out is True
    llama = wrapped("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300)
    assert llama.peft_config["default"].fan_in_fan_out is False

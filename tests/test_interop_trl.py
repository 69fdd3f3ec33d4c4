"""TRL's SFTTrainer with memfit's callback (CPU, tiny model): predicted vs measured tensor peak, and the TRL
kernel facts ``memory.trl_head`` prices."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")


def _sft_trainer(tmp_path, config, mode, **extra):
    import torch
    from datasets import Dataset

    from memfit.data.dataset import byte_tokenizer

    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    peft = None
    if mode == "lora":
        from peft import LoraConfig

        peft = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    rows = [torch.randint(3, config.vocab_size, (64,)).tolist() for _ in range(24)]
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_steps=3, report_to=[], logging_steps=100, save_strategy="no", use_cpu=True,
                         bf16=mode == "bf16", gradient_checkpointing=mode == "gc", max_length=64, **extra)
    return trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"input_ids": r} for r in rows]),
                          processing_class=byte_tokenizer(), peft_config=peft)


# bf16: CPU autocast, the buffer in bf16. Each is an SFTTrainer run of 3 steps (2-8 s on 2 cores).
@pytest.mark.parametrize("mode", ["full", "lora", "gc", "bf16"])
def test_sft_trainer_prediction_within_3_percent_of_measured_tensor_peak(tmp_path, tiny_llama_config, mode):
    from memfit.interop.callback import attach

    trainer = _sft_trainer(tmp_path, tiny_llama_config, mode)
    callback = attach(trainer)  # the rows' length: SFTConfig's max_length
    trainer.train()
    logged = next(e for e in trainer.state.log_history if "memfit/measured_peak_bytes" in e)
    predicted, measured = logged["memfit/predicted_peak_bytes"], logged["memfit/measured_peak_bytes"]
    assert str(callback.run.loss) == "trl" and callback.run.lora.r == (8 if mode == "lora" else 0)
    assert callback.run.grad_checkpointing == (mode == "gc")
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)


def test_trl_kernel_tiles_are_the_installed_trls():
    """The tile sizes memfit prices are those of the TRL installed here (a TRL that changes them fails this)."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    from memfit.memory import trl_head

    assert trl_head.TOKEN_TILE == chunked_logprob.TOKEN_CHUNK_SIZE
    assert trl_head.VOCAB_TILE == utils._CHUNKED_LOGPROB_CHUNK_SIZE


def test_the_trl_buffer_is_priced_at_its_full_width_whatever_the_vocabulary(tiny_llama_config):
    """A 384-token vocabulary gets the 32,768-column buffer: the estimate of an SFTTrainer run holds it."""
    from memfit.memory.estimate import estimate
    from memfit.settings.config import RunConfig
    from memfit.spec.model import spec_from_config

    spec = spec_from_config(tiny_llama_config, "tiny")
    run = RunConfig.of(seq_len=64, micro_batch=4, mixed_precision="no", loss="trl", packing="concat")
    trl_peak = estimate(spec, run, device="cpu").peak_bytes
    chunked_peak = estimate(spec, run.replace(loss="chunked"), device="cpu").peak_bytes
    assert trl_peak - chunked_peak > 4 * 63 * 4 * 32768 * 0.9  # B (T-1) rows x 32,768 fp32 columns


def test_memfit_train_and_exact_mode_refuse_trls_head_in_one_sentence():
    """TRL's head is priced analytically; memfit's own step (train, the exact trace) does not run it."""
    from click.testing import CliRunner

    from _train_helpers import assert_one_sentence
    from memfit.cli import cli
    from memfit.errors import UserError
    from memfit.settings.config import RunConfig
    from memfit.spec.losses import check_loss_runnable

    with pytest.raises(UserError, match="memfit train does not run"):
        check_loss_runnable(RunConfig.of(loss="trl"), cuda=False)
    result = CliRunner().invoke(cli, ["estimate", "tiny", "--loss", "trl", "--exact", "--device", "cpu"])
    assert_one_sentence(result, "--loss trl prices TRL's SFTTrainer")


def test_a_plan_of_trls_loss_names_no_memfit_train_command_that_would_be_refused(tmp_path):
    """``plan --loss trl`` prices TRL's SFTTrainer; ``memfit train`` refuses that loss, so the plan must not
    tell the user to run it with memfit (neither the launch line nor the written plan's hint)."""
    from click.testing import CliRunner

    from memfit.cli import cli

    out = tmp_path / "plan.yaml"
    result = CliRunner().invoke(cli, ["plan", "tiny", "--budget", "2GiB", "--seq-len", "64", "--batch", "4",
                                      "--loss", "trl", "--output", str(out), "--gpu", "a100-80gb"])
    assert result.exit_code == 0, result.output
    assert "memfit train" not in result.output
    assert "Launch: with TRL's SFTTrainer" in result.output
    assert out.is_file()


def test_zero_argument_callback_on_a_dpo_trainer_prices_memfits_dpo(tmp_path, tiny_llama_config):
    """``DPOTrainer(..., callbacks=[MemfitCallback()])``: the pairs' length from the first batch, priced as memfit's
    --method dpo (a full fine-tune: a frozen reference copy), and the run trains."""
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    from memfit.data.dataset import byte_tokenizer
    from memfit.interop.callback import MemfitCallback

    torch.manual_seed(0)
    rows = [{"prompt": "ab" * 8, "chosen": "cd" * (4 + i % 3), "rejected": "ef" * 6} for i in range(8)]
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, bf16=False, gradient_checkpointing=False, max_length=64)
    callback = MemfitCallback()
    model = LlamaForCausalLM(tiny_llama_config)
    reference = LlamaForCausalLM(tiny_llama_config)  # a model built here has no Hub id for TRL to load it from
    reference.load_state_dict(model.state_dict())
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=byte_tokenizer(), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 1
    assert str(callback.run.method) == "dpo" and str(callback.run.loss) == "standard"
    assert 16 < callback.run.seq_len < 64  # the first batch's padded pairs, not max_length

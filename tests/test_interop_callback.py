"""memfit.interop.callback on a real transformers.Trainer (CPU, tiny model): predicted vs measured tensor peak."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def _trainer(tmp_path, config, mode, **extra):
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    rows = [torch.randint(3, config.vocab_size, (64,)).tolist() for _ in range(24)]
    data = Dataset.from_list([{"input_ids": r, "labels": r, "attention_mask": [1] * 64} for r in rows])
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=3, report_to=[], logging_steps=100, save_strategy="no", use_cpu=True,
                             gradient_checkpointing=mode == "gc", **extra)
    return Trainer(model=model, args=args, train_dataset=data)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "lora", "gc"])
def test_trainer_prediction_within_3_percent_of_measured_tensor_peak(tmp_path, tiny_llama_config, mode):
    from memfit.interop.callback import attach

    trainer = _trainer(tmp_path, tiny_llama_config, mode)
    callback = attach(trainer, seq_len=64)
    trainer.train()
    logged = next(e for e in trainer.state.log_history if "memfit/measured_peak_bytes" in e)
    predicted, measured = logged["memfit/predicted_peak_bytes"], logged["memfit/measured_peak_bytes"]
    assert measured > 0 and callback.run.lora.r == (8 if mode == "lora" else 0)
    assert callback.run.grad_checkpointing == (mode == "gc")
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)


@pytest.mark.slow  # a Trainer and a CPU plan: ~1 min on a loaded 2-core machine
def test_a_run_that_cannot_fit_stops_before_the_first_step_with_a_plan(tmp_path, tiny_llama_config):
    from memfit.interop.callback import DoesNotFit, attach

    trainer = _trainer(tmp_path, tiny_llama_config, "full")
    attach(trainer, seq_len=64, budget=4_500_000)
    with pytest.raises(DoesNotFit, match=r"more than the .* it has; this plan fits \(") as err:
        trainer.train()
    assert trainer.state.global_step == 0
    assert str(err.value).count(". ") == 0  # one sentence

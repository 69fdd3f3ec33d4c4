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


def test_zero_argument_callback_on_a_plain_trainer_reads_the_length_from_the_first_batch(tmp_path, tiny_llama_config):
    """``Trainer(..., callbacks=[MemfitCallback()])``: TrainingArguments has no sequence length, so the callback
    reads it from the first batch (64 tokens) and logs its figures into the run's history."""
    from memfit.interop.callback import MemfitCallback

    trainer = _trainer(tmp_path, tiny_llama_config, "full")
    callback = MemfitCallback()
    trainer.add_callback(callback)
    trainer.train()
    assert callback.run.seq_len == 64 and trainer.state.global_step == 3
    assert any("memfit/predicted_peak_bytes" in e for e in trainer.state.log_history)


def test_a_run_the_callback_cannot_price_trains_on_with_one_warning(tmp_path, tiny_llama_config, caplog):
    """Rows of no known length (an iterable dataset, no max_length): one logged warning, the run is not broken."""
    import logging

    import torch
    from torch.utils.data import IterableDataset
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from memfit.interop.callback import MemfitCallback

    class Rows(IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(0)
            for _ in range(24):
                row = torch.randint(3, tiny_llama_config.vocab_size, (32,), generator=generator).tolist()
                yield {"input_ids": row, "labels": row, "attention_mask": [1] * 32}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[],
                             save_strategy="no", use_cpu=True)
    trainer = Trainer(model=LlamaForCausalLM(tiny_llama_config), args=args, train_dataset=Rows(),
                      callbacks=[MemfitCallback()])
    with caplog.at_level(logging.WARNING, logger="memfit"):
        trainer.train()
    assert trainer.state.global_step == 2
    warnings = [r for r in caplog.records if r.name == "memfit"]
    assert len(warnings) == 1 and "not priced" in warnings[0].getMessage()
    assert not any("memfit/predicted_peak_bytes" in e for e in trainer.state.log_history)

"""One rank of a DeepSpeed ZeRO-3 run whose model transformers builds under ``deepspeed.zero.Init``, as
transformers' Trainer does (``tests/test_deepspeed_zero3_init.py`` launches it on 2 CPU processes).

The run: ``HfDeepSpeedConfig`` alive (what ``TrainingArguments(deepspeed=...)`` creates, transformers
``training_args.py`` L1707-1710), then ``from_pretrained`` of the checkpoint the test wrote, which builds the model
inside ``deepspeed.zero.Init`` (``modeling_utils.py`` L3829-3839): the Trainer's own path, not a copy of it; an
optional PEFT LoRA wrap, then ``deepspeed.initialize`` with torch's AdamW over the trainable parameters and memfit's
own DeepSpeed config for the run (``training.deepspeed_engine.ds_config``) with the coordinator settings the test
names. The third step's tensor peak is counted by memfit's counter (``memory.measure.StepPeak``) and written to
``OUT/rank{r}.json``.

Usage: python _zero3_init_probe.py SETTINGS_JSON (keys: model, out, hidden_size, seq_len, micro_batch, steps, and
cases: a list of {lora_r, grad_checkpointing, zero3: the ``zero_optimization`` keys to set}, run one after the
other in the same processes; ``OUT/rank{r}.json`` lists their peaks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(settings: dict) -> None:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    peaks = [case_peak(settings, case) for case in settings["cases"]]
    rank = torch.distributed.get_rank()
    Path(settings["out"], f"rank{rank}.json").write_text(json.dumps(peaks))


def case_peak(settings: dict, case: dict) -> int:
    """The tensor peak of the third step of one case (``lora_r``, ``grad_checkpointing``, ``zero3`` keys)."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from memfit.memory import measure
    from memfit.settings.config import RunConfig
    from memfit.training.deepspeed_engine import ds_config

    run = RunConfig.of(seq_len=settings["seq_len"], micro_batch=settings["micro_batch"], optimizer="adamw",
                       num_processes=torch.distributed.get_world_size(), sharding="zero3")
    config = ds_config(run, max_grad_norm=1.0, hidden_size=settings["hidden_size"])
    config["zero_optimization"].update(case["zero3"])
    alive = HfDeepSpeedConfig(config)  # noqa: F841  (transformers reads it through a weak reference)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    assert all(hasattr(p, "ds_id") for p in model.parameters()), "not built under deepspeed.zero.Init"
    if case["grad_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case["lora_r"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=case["lora_r"], lora_alpha=16, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-3),
                                                   config=config)
    engine.train()  # from_pretrained returns eval mode; the Trainer's training_step calls model.train()
    peak = measure.StepPeak("cpu", settings["steps"])
    generator = torch.Generator().manual_seed(1)
    for step in range(1, settings["steps"] + 1):
        ids = torch.randint(0, model.config.vocab_size, (settings["micro_batch"], settings["seq_len"]),
                            generator=generator)
        batch = {"input_ids": ids, "labels": ids}
        with peak.watch(step, engine.module, optimizer, [batch]):
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
    engine.destroy()
    return peak.peak_bytes


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))

"""The phases outside the step (memory/phases.py) against memfit's tensor counter on real CPU runs (issue 36,
item 3): loading a safetensors checkpoint, evaluation, the checkpoint, the export and the samples, each measured
with ``memory.measure.counted`` (live storages, never RSS) as ``memfit train`` runs them
(``training.phase_peaks``), and shown beside the prediction in train's summary. Wrapping (FSDP2 on 2 CPU ranks) is
checked in tests/test_shard_setup.py.

Tolerances, per phase (measured on a 2-layer hidden-64 Llama, vocabulary 384, where a formula error of one tensor is
at least 16 KiB, 0.5% of the smallest phase compared):

- loading, checkpoint, export: 1%. Loading creates the weights and nothing else but the rotary buffer's and the
  LoRA initialisation's temporaries (+96 B to +1,168 B measured); an unsharded checkpoint and export write the
  tensors the run holds (+168 B: the step counters Accelerate saves).
- evaluation: 1%. Beside the prediction's logits and loss: the batch's labels and masks (+10.3 KiB of 3.6 MiB).
- samples: a full-length sample's transient within 2% (+1.7 KiB of 119 KiB: one token's hidden states and the
  prompt's ids beside what is priced); in a run, a sample may end at eos, holding less, never more (+1%).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _train_helpers import TINY_LLAMA, tiny_config, write_text
from memfit.memory.measure import counted
from memfit.settings.config import RunConfig, TrainConfig

CLOSE = 0.01


def _checkpoint(folder: Path, dtype: torch.dtype) -> str:
    """The tiny Llama saved as a safetensors checkpoint in ``dtype``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
    return str(folder)


class _NoEos:
    """What ``generate_samples`` asks of a tokenizer, with an eos id outside the vocabulary: a sample runs to
    ``MAX_NEW_TOKENS``, the length the prediction is sized for."""

    bos_token_id, pad_token_id, eos_token_id = 1, 0, TINY_LLAMA["vocab_size"] + 100

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 200 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _error(measured: int, predicted: int) -> float:
    return (measured - predicted) / predicted


def test_counter_counts_a_tensor_a_module_registers_without_an_operator():
    # safetensors builds a checkpoint's tensors over the mapped file outside the dispatcher: no operator's output,
    # so only the registration as a parameter shows it (4,096 fp32 = 16,384 B)
    layer = torch.nn.Linear(1, 1)
    with counted() as live:
        mapped = torch.frombuffer(bytearray(16_384), dtype=torch.float32)
        assert live.current == 0
        layer.weight = torch.nn.Parameter(mapped, requires_grad=False)
        assert live.current == 16_384
    del layer, mapped
    assert live.current == 0 and live.peak == 16_384


@pytest.mark.parametrize(("saved", "run"), [
    (torch.float32, {"dtype": "fp32"}),
    (torch.bfloat16, {"dtype": "fp32"}),  # converted as it loads: the mapped bf16 tensor is the file's
    (torch.float32, {"dtype": "bf16", "mixed_precision": "no", "lora_r": 8}),
])
def test_loading_a_safetensors_checkpoint_peaks_at_the_loading_phase(tmp_path, saved, run):
    from memfit.memory.estimate import estimate
    from memfit.memory.phases import device_phases
    from memfit.training.setup import build_model, resolve_model

    run = RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw", **run)
    config = TrainConfig.of(model=_checkpoint(tmp_path / "ckpt", saved), tokenizer="byte", run=run)
    source = resolve_model(config, run)
    with counted() as live:
        build_model(config, run, source)
    loading = device_phases(source.spec, run, estimate(source.spec, run, device="cpu"), "cpu").phases[0]
    assert loading.name == "loading"
    assert abs(_error(live.peak, loading.tensors)) <= CLOSE, (live.peak, loading.tensors)


def test_a_full_length_sample_holds_the_predicted_cache_and_sampling_tensors():
    """One sample of ``MAX_NEW_TOKENS`` (an eos the model can never produce): what generation adds to the model it
    runs on, against ``outside_step``'s samples minus its resident bytes (unsharded: the checkpoint's figure)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.data.dataset import Example
    from memfit.memory.outside import outside_step
    from memfit.spec.model import spec_from_config
    from memfit.training.samples import generate_samples

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config)
    with counted([*model.parameters(), *model.buffers()]) as live:
        held = live.current
        generate_samples(Accelerator(cpu=True), model, _NoEos(), [Example(text="Once upon a time there was")],
                         count=1, seed=0, max_positions=TINY_LLAMA["max_position_embeddings"])
    outside = outside_step(spec_from_config(config, "tiny-llama"), RunConfig.of(dtype="fp32", optimizer="sgd"),
                           "cpu")
    predicted = outside.generation - outside.checkpoint_full[0]
    assert abs(_error(live.peak - held, predicted)) <= 2 * CLOSE, (live.peak - held, predicted)


def test_train_summary_shows_each_phase_measured_beside_its_prediction(tmp_path):
    """A CPU run from a safetensors checkpoint with evaluation (two batches: the first's logits must be gone
    before the second's forward), a checkpoint, the export and a sample: each phase's measured tensor peak is in
    run.json beside its prediction, within the module's tolerances, and in the summary table."""
    from rich.console import Console

    from memfit.report.summary import summary_table
    from memfit.training.loop import run_training
    from memfit.units import fmt_bytes

    config = tiny_config(tmp_path, run={"optimizer": "adamw", "packing": "concat"}, data=write_text(tmp_path),
                         eval_every=3, eval_fraction=0.2, samples=1, save_every=3)
    config = config.replace(model=_checkpoint(tmp_path / "ckpt", torch.float32))
    summary = run_training(config, show=False).summary.to_dict()
    measured, outside = summary["measured_phases"], summary["outside_step"]
    assert set(measured) == {"loading", "evaluation", "checkpoint", "export", "samples"}
    for phase in ("loading", "evaluation", "checkpoint", "export"):
        error = _error(measured[phase], outside[f"phase_{phase}"])
        assert abs(error) <= CLOSE, (phase, measured[phase], outside[f"phase_{phase}"])
    # a sample ends at eos or at the budget the prediction is sized for; it starts from what the checkpoint held
    assert measured["checkpoint"] < measured["samples"] <= outside["phase_samples"] * (1 + CLOSE)
    console = Console(width=400, record=True)
    console.print(summary_table(summary))
    row = next(line for line in console.export_text().splitlines() if "peak by phase (measured)" in line)
    assert f"loading {fmt_bytes(measured['loading'])} (measured" in row
    assert f"evaluation {fmt_bytes(measured['evaluation'])}" in row


def test_the_counter_leaves_out_what_another_thread_registers():
    """Module registration hooks are process-wide, the dispatch mode per thread: a model another thread builds while a
    block is counted (a web request's trace, another test's work on the same worker) is not the block's. (Once in CI,
    before this rule, the full-length sample test read 295,760 B against 120,064 B predicted on a busy worker; it
    passed alone and in three other full runs, and a registration from another thread is the one way found for the
    counter to see foreign tensors.) A model built on the counting thread is counted: 256 x 256 fp32 weights and
    256 biases."""
    import threading

    with counted() as live:
        builder = threading.Thread(target=lambda: torch.nn.Linear(256, 256))
        builder.start()
        builder.join()
    assert live.peak == 0
    with counted() as live:
        layer = torch.nn.Linear(256, 256)
    assert live.peak == (256 * 256 + 256) * 4 and layer.weight.numel() == 256 * 256

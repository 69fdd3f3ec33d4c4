"""Loading a quantized (QLoRA) base on the CPU against memfit's tensor counter (issue 36, item 3): the loading phase's
peak and what stays (``memory.host_loading``, ``memory.phases``), a ``memfit train --quantize 4bit`` run's loading,
checkpoint and export phases (``run.json``'s ``measured_phases``), and a sharded one's loading, wrapping and export.

The checkpoint model is a 2-layer hidden-256 Llama (intermediate 512, vocabulary 384) saved in several safetensors
shards: its projections outweigh the embeddings, so the tensor being quantized on top of the loaded layers is the
peak (without it, the prediction was the finished model: 10% to 27% under the counter, 3% to 14% for 8-bit).

Tolerance 0.5% (6 KB to 13 KB of 1.2 MB to 2.6 MB): below every term of the stream that decides the peak (a
projection's copy in ``--dtype`` is at least 64 KiB, its mapped storage as much, its packed payload 16 KiB) and above
what the prediction leaves out: LoRA's initialisation temporaries (+5,264 B measured in the bf16 case, where the
finished model is the peak) and a norm loaded after its layer's MLP (1 KiB).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _train_helpers import TINY_LLAMA, tiny_config, write_text
from memfit.integrations import quant_support
from memfit.memory.measure import counted
from memfit.settings.config import RunConfig, TrainConfig

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.skipif(not quant_support.runs_on("cpu"),
                                reason="the installed bitsandbytes has no CPU backend (needs >= 0.50)")

CLOSE = 0.005
LARGER = {"hidden_size": 256, "intermediate_size": 512}


def _checkpoint(folder: Path, dtype: torch.dtype) -> str:
    """The hidden-256 Llama saved in ``dtype`` as 16 to 17 safetensors shards (100 KB each at most)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, **LARGER})
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder, max_shard_size="100KB")
    return str(folder)


def _error(measured: int, predicted: int) -> float:
    return (measured - predicted) / predicted


@pytest.mark.parametrize(("saved", "run"), [
    (torch.bfloat16, {"dtype": "bf16"}),  # the mapped bf16 weight is quantized as it is
    (torch.float32, {"dtype": "bf16"}),  # fp32 mapped beside its bf16 copy: the peak
    (torch.bfloat16, {"dtype": "fp32"}),
    (torch.float32, {"dtype": "fp32"}),  # the mapped fp32 weight beside its packed payload and absmax
    (torch.float32, {"dtype": "fp32", "quantize": "8bit"}),  # the fp32 weight beside its fp16 copy and int8
])
def test_loading_a_quantized_checkpoint_peaks_and_keeps_what_is_predicted(tmp_path, saved, run):
    from memfit.memory.estimate import estimate
    from memfit.memory.phases import device_phases
    from memfit.memory.states import model_states
    from memfit.training.setup import build_model, resolve_model

    run = RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw", lora_r=8, **{"quantize": "4bit", **run})
    config = TrainConfig.of(model=_checkpoint(tmp_path / "ckpt", saved), tokenizer="byte", run=run)
    source = resolve_model(config, run)
    with counted() as live:
        model = build_model(config, run, source).model
    loading = device_phases(source.spec, run, estimate(source.spec, run, device="cpu"), "cpu",
                            loaded_from=source.loaded_from).phases[0]
    assert abs(_error(live.peak, loading.tensors)) <= CLOSE, (live.peak, loading.tensors)
    held = [*model.parameters(), *model.buffers(), *quant_support.quant_state_tensors(model)]
    kept = sum(s.nbytes() for s in {t.untyped_storage(): None for t in held})  # each storage once
    weights = model_states(source.spec, run, "cpu").weights
    assert abs(_error(kept, weights)) <= CLOSE and abs(_error(live.current, weights)) <= CLOSE, (
        kept, live.current, weights)


def test_a_qlora_train_run_measures_loading_and_saves_as_predicted(tmp_path):
    """``memfit train --quantize 4bit`` on the 2-layer hidden-64 preset-like config (random weights: memfit builds
    the fp32 model, saves it and loads it back quantized), with a checkpoint and the export: each phase's measured
    tensor peak in run.json within 1% of its prediction (tests/test_phases_measured.py's tolerance for these
    phases; before, loading read +142% with the random model held beside its quantized copy and +56% with it
    counted nowhere, the saves +2.6% without the quantization state their state dict packs, 16.7 KB)."""
    from memfit.training.loop import run_training

    config = tiny_config(tmp_path, run={"optimizer": "adamw", "packing": "concat", "lora_r": 8, "quantize": "4bit"},
                         data=write_text(tmp_path), save_every=3)
    summary = run_training(config, show=False).summary.to_dict()
    measured, outside = summary["measured_phases"], summary["outside_step"]
    for phase in ("loading", "checkpoint", "export"):
        assert abs(_error(measured[phase], outside[f"phase_{phase}"])) <= 0.01, (
            phase, measured[phase], outside[f"phase_{phase}"])


@pytest.mark.launch_cases("qlora-fsdp")
def test_a_sharded_qlora_run_loads_wraps_and_exports_as_predicted(gloo_runs):
    """FSDP2 QLoRA on 2 CPU ranks (the launch test_shard_qlora reads: the 2-layer hidden-64 Llama, random weights,
    ``--lora-r 4 --quantize 4bit --sharding fsdp --save-every 2``), rank 0's measured phases within 1% of their
    prediction. Before (measured 767,696 / 420,171 / 1,266,656 B): loading +170% (the random model held beside its
    quantized copy); wrapping -3.3% (the counter started without the base's quantization state, 14 KB, as held);
    export +58% (rank 0 rebuilds its plain copy from random weights: their fp32 model, and before the fix the
    quantized copy too, beside the gathered dict), then -1.6% (the gathered dict has no quantization state, 16 KB).
    The checkpoint is left out: the prediction is a ``--state-dict full`` one, this run saves sharded."""
    import json

    launched = gloo_runs["qlora-fsdp"]
    assert launched.returncode == 0, launched.failure()
    summary = json.loads((Path(launched.paths["output"]) / "run.json").read_text())
    measured, outside = summary["measured_phases"], summary["outside_step"]
    for phase in ("loading", "wrapping", "export"):
        assert abs(_error(measured[phase], outside[f"phase_{phase}"])) <= 0.01, (
            phase, measured[phase], outside[f"phase_{phase}"])


@pytest.mark.slow
def test_a_sharded_qlora_full_state_checkpoint_peaks_as_predicted(tmp_path):
    """The same FSDP2 QLoRA run with ``--state-dict full``: rank 0 gathers the model, then the optimizer state. With
    LoRA the optimizer state is small and the peak is the model's gather, its last tensor (the head) in flight twice
    beside the gathered weights (``memory.outside.RANK0_GATHER_COPIES``): measured 696,592 B, predicted 761,936 B
    (-8.6%) before, when the head in flight and the full optimizer state were both counted."""
    import json

    from _gloo_cases import QLORA_ARGS
    from _launch_helpers import gloo_launch
    from _train_helpers import write_qa

    data = write_qa(tmp_path, n=22)
    two = tiny_config(tmp_path / "two", data=data)
    proc = gloo_launch("-m", "memfit", "train", "--model", two.source.model, "--data", data, *QLORA_ARGS, "--lora-r",
                       "4", "--quantize", "4bit", "--sharding", "fsdp", "--save-every", "2", "--state-dict", "full",
                       "--output", two.folder.output, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((Path(two.folder.output) / "run.json").read_text())
    measured, predicted = summary["measured_phases"]["checkpoint"], summary["outside_step"]["phase_checkpoint"]
    assert abs(_error(measured, predicted)) <= 0.01, (measured, predicted)

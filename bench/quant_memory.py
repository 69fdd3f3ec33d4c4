"""Measured on CPU: the tensor peak of a QLoRA step (4-bit and 8-bit base) per phase, next to memfit's estimate.

A Llama saved to a temporary folder is loaded through bitsandbytes exactly as ``memfit train`` loads it
(``training.setup.build_model``: quantization, ``prepare_model_for_kbit_training``, PEFT LoRA), and trains
two steps; the second is counted with memfit's live-tensor counter on real tensors
(``memory.measure.counted``: every storage an operator creates, minus each one freed; the parameters, the
quantization state, gradients, optimizer state and the batch counted as held at the start), phase by phase
(forward, backward, optimizer), and compared with ``memfit.estimate(..., device="cpu")``. With
``--mixed-precision bf16`` the forward runs under the autocast Accelerate puts around it (memfit's own
``build_accelerator`` and ``prepare_model``, as ``memfit train`` does), and the quantized layers compute in
bf16 (``quant_support.bnb_config``).

    python bench/quant_memory.py --out bench/results/quant_memory.json          # hidden 1024, 4 layers
    python bench/quant_memory.py --mixed-precision bf16 --out bench/results/quant_memory_bf16.json
    python bench/quant_memory.py --quick --out /tmp/q.json                      # CI: tiny, seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import _common  # noqa: F401 - puts bench/ on sys.path for running from a checkout
from memfit.settings.config import RunConfig, TrainConfig

SIZES = {"full": dict(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8),
         "quick": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)}


def save_model(folder: Path, size: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES[size], max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def measure(model_dir: str, run: RunConfig) -> dict:
    """Phase peaks (bytes) of the second of two real training steps of ``run``."""
    import torch

    from memfit.memory.measure import counted, resident_tensors
    from memfit.training.setup import build_accelerator, build_model, build_optimizer
    from memfit.training.step import micro_loss

    config = TrainConfig.of(model=model_dir, tokenizer="byte", run=run, lr=1e-3)
    bundle = build_model(config, run)
    model = bundle.model
    if str(run.mixed_precision) != "no":
        # Accelerate's autocast wrapper around forward (and its fp32 copy of the outputs), nothing else
        model = build_accelerator(run, config).prepare_model(model)
    model.train()
    optimizer = build_optimizer(model, run, config)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (run.micro_batch, run.seq_len), generator=gen)  # (B, T)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    n = torch.tensor(ids.numel())
    peaks: dict[str, int] = {}

    def step(live=None):
        loss = micro_loss(model, batch, n, bundle.uses_model_loss, vocab, run.loss)
        _phase_end(live, peaks, "forward")
        loss.backward()
        del loss
        _phase_end(live, peaks, "backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _phase_end(live, peaks, "optimizer")

    step()  # the optimizer state exists from here on: the steady state memfit estimates
    with counted(resident_tensors(model, optimizer, list(batch.values()))) as live:
        step(live)
    return peaks


def _phase_end(live, peaks: dict, phase: str) -> None:
    if live is None:
        return
    peaks[phase] = live.peak
    live.peak = live.current  # the next phase's peak starts from what is held now


def case(model_dir: str, run: RunConfig) -> dict:
    from memfit.memory.estimate import estimate

    measured = measure(model_dir, run)
    predicted = estimate(model_dir, run, device="cpu")
    phases = {p: {"measured": m, "predicted": int(predicted.phase_peaks.get(p, 0)),
                  "error": predicted.phase_peaks.get(p, 0) / m - 1} for p, m in measured.items()}
    peak = max(measured.values())
    return {"quantize": str(run.quantize), "optimizer": str(run.optimizer), "phases": phases,
            "measured_peak": peak, "predicted_peak": int(predicted.peak_bytes),
            "error": predicted.peak_bytes / peak - 1}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                        help="autocast as memfit train runs it (Accelerate's); default: fp32 as on the CPU")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    size = "quick" if args.quick else "full"
    seq, micro = (64, 2) if args.quick else (128, 2)
    out = {"size": SIZES[size], "seq_len": seq, "micro_batch": micro, "mixed_precision": args.mixed_precision,
           "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp) / "model", size)
        for quantize, checkpointing in itertools.product(("4bit", "8bit"), (False, True)):
            run = RunConfig.of(seq_len=seq, micro_batch=micro, lora_r=16, quantize=quantize, optimizer="adamw",
                            packing="concat", grad_checkpointing=checkpointing,  # whole rows: no mask
                            mixed_precision=args.mixed_precision)
            result = case(model_dir, run)
            result["grad_checkpointing"] = checkpointing
            out["cases"].append(result)
            print(f"{quantize}{' + checkpointing' if checkpointing else ''}: measured {result['measured_peak']:,} B, predicted {result['predicted_peak']:,} B "
                  f"({result['error']:+.1%}); " + ", ".join(
                      f"{p} {v['measured']:,} vs {v['predicted']:,} ({v['error']:+.1%})"
                      for p, v in result["phases"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()

"""Loading a quantized (QLoRA) base on the CPU: the tensor peak and what stays, against memory.phases (issue 36).

A Llama of the given shape is saved in each ``--saved`` dtype as several safetensors shards (100 KB each at most),
then loaded for each ``--dtype`` as ``memfit train`` loads it (``training.setup.build_model``: transformers'
``from_pretrained`` with bitsandbytes' quantizer, then LoRA r 8) inside memfit's tensor counter
(``memory.measure.counted``). One JSON line per case: the measured peak, what the counter holds at the end and what
the model keeps (its parameters, buffers and quantization state), beside the loading phase's prediction
(``memory.phases.device_phases`` on a CPU, which reads ``memory.host_loading``) and the finished model's
(``memory.states.model_states``' weights: the loading prediction before ``memory.host_loading``).

Example (the figures in bench/README.md, "quant_loading_memory.py")::

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/quant_loading_memory.py --quantize 4bit
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/quant_loading_memory.py --quantize 8bit
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def case(folder: str, quantize: str, dtype: str) -> dict:
    """Load the checkpoint in ``folder`` quantized for ``quantize`` at ``dtype``; measured and predicted bytes."""
    from memfit.integrations.quant_support import quant_state_tensors
    from memfit.memory.estimate import estimate
    from memfit.memory.measure import counted
    from memfit.memory.phases import device_phases
    from memfit.memory.states import model_states
    from memfit.settings.config import RunConfig, TrainConfig
    from memfit.training.setup import build_model, resolve_model

    run = RunConfig.of(seq_len=64, micro_batch=2, optimizer="adamw", lora_r=8, quantize=quantize, dtype=dtype)
    config = TrainConfig.of(model=folder, tokenizer="byte", run=run)
    source = resolve_model(config, run)
    with counted() as live:
        model = build_model(config, run, source).model
    held = [*model.parameters(), *model.buffers(), *quant_state_tensors(model)]
    loading = device_phases(source.spec, run, estimate(source.spec, run, device="cpu"), "cpu",
                            loaded_from=source.loaded_from).phases[0]
    return {"measured_peak": live.peak, "measured_after": live.current,
            "model_keeps": sum(s.nbytes() for s in {t.untyped_storage(): None for t in held}),
            "predicted_loading": loading.tensors, "finished_model": model_states(source.spec, run, "cpu").weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", choices=("4bit", "8bit"), default="4bit")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--saved", default="bf16,fp32", help="checkpoint dtypes, comma-separated")
    parser.add_argument("--dtype", default="bf16,fp32", help="--dtype of the runs, comma-separated")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=384, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as root:
        for saved in args.saved.split(","):
            folder = Path(root) / saved
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPES[saved]))
            model.save_pretrained(folder, max_shard_size="100KB")
            for dtype in args.dtype.split(","):
                print(json.dumps({"quantize": args.quantize, "saved": saved, "dtype": dtype,
                                  **case(str(folder), args.quantize, dtype)}), flush=True)


if __name__ == "__main__":
    main()

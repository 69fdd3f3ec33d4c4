"""The 2-process cases the default suite runs, ONE torchrun for all of them (``conftest.gloo_runs``).

Each builder writes its case's inputs under ``root`` and returns the case for ``_launch_helpers.launch_cases``;
the test that checks the case is named beside it (it asks for it with ``@pytest.mark.launch_cases(NAME)``,
and only the cases the session's tests ask for are run). Before, each of these was its own launch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from _train_helpers import tiny_config, write_pairs, write_qa, write_text

BENCH = Path(__file__).resolve().parents[1] / "bench"

# The memfit train flags of the data-parallel and FSDP cases (test_train_dp, test_train_fsdp)
TRAIN_ARGS = ["--tokenizer", "byte", "--seq-len", "64", "--micro-batch", "1", "--grad-accum", "2", "--max-steps",
              "6", "--lr", "0.01", "--warmup-steps", "2", "--optimizer", "adamw", "--no-packing", "--eval-every",
              "0", "--eval-fraction", "0", "--samples", "0", "--log-every", "1", "--max-grad-norm", "0"]
# ... and of the QLoRA cases (test_shard_qlora)
QLORA_ARGS = ["--tokenizer", "byte", "--seq-len", "64", "--micro-batch", "1", "--grad-accum", "1", "--max-steps",
              "4", "--lr", "0.01", "--warmup-steps", "0", "--optimizer", "adamw", "--no-packing", "--eval-every",
              "0", "--eval-fraction", "0", "--samples", "0", "--log-every", "1", "--max-grad-norm", "0"]


def _train(root: Path, n: int, args: list[str]) -> dict:
    """``memfit train`` on ``n`` QA records (``root/qa.jsonl``) of the tiny Llama (``root/two/model``), into
    ``root/two/out``: the layout ``tiny_config(root / "two", data=...)`` gives, so a test can rebuild it."""
    data = write_qa(root, n=n)
    two = tiny_config(root / "two", data=data)
    return {"kind": "memfit", "argv": ["train", "--model", two.source.model, "--data", data, *args, "--output", two.folder.output],
            "paths": {"data": data, "model": two.source.model, "output": two.folder.output}}


def _train_pairs(root: Path, n: int, args: list[str]) -> dict:
    """``memfit train --method ...`` on ``n`` preference pairs (``root/pairs.jsonl``), laid out as ``_train``."""
    data = write_pairs(root / "pairs.jsonl", n=n)
    two = tiny_config(root / "two", data=data)
    return {"kind": "memfit", "argv": ["train", "--model", two.source.model, "--data", data, *args, "--output", two.folder.output],
            "paths": {"data": data, "model": two.source.model, "output": two.folder.output}}


# ... and of the mixture-of-experts cases (test_moe_dp): whole 64-token rows of text (packed), so the measured
# peak is the predicted shape; --init random: every run starts from the same seeded weights
MOE_ARGS = ["--tokenizer", "byte", "--seq-len", "64", "--max-steps", "4", "--lr", "0.01", "--warmup-steps", "1", "--optimizer", "adamw", "--packing", "concat", "--eval-every", "0",
            "--eval-fraction", "0", "--samples", "0", "--log-every", "1", "--max-grad-norm", "0", "--init", "random"]


def _train_moe(root: Path, sharding: str, micro_batch: int, grad_accum: int) -> dict:
    """``memfit train --sharding SHARDING`` of a 2-layer Mixtral (4 experts, 2 per token; fp32: the eager
    per-expert loop) on 60 short texts (``root/text.txt``), into ``root/out``; effective batch 4."""
    from _accuracy_models import moe_config

    moe_config("mixtral", layers=2).save_pretrained(root / "model")
    data, output = write_text(root, n=60), str(root / "out")
    shape = ["--micro-batch", str(micro_batch), "--grad-accum", str(grad_accum)]
    return {"kind": "memfit", "argv": ["train", "--model", str(root / "model"), "--data", data, *MOE_ARGS, *shape,
                                       "--sharding", sharding, "--output", output],
            "paths": {"data": data, "model": str(root / "model"), "output": output}}


def _bench(script: str, *args: str) -> dict:
    return {"kind": "script", "script": str(BENCH / script), "argv": list(args)}


def _qwen3(root: Path) -> str:
    """A derived family (no hand-written recipe) with a large untied embedding: test_sharding_memory."""
    from transformers import Qwen3Config

    Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=32768, tie_word_embeddings=False,
                ).save_pretrained(root)
    return str(root)


def _sharding_memory(sharding: str, model: str = "tiny", *extra: str) -> dict:
    return _bench("sharding_memory.py", "--model", model, "--seq-len", "32", "--steps", "3", "--sharding", sharding,
                  *extra)


def _fsdp1_memory(root: Path, vocab: int, layers: int, *extra: str) -> dict:
    """``bench/fsdp1_memory.py`` on a small untied Llama (H 128, I 344, 4 heads, 2 KV heads) saved under ``root``."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False).save_pretrained(root)
    return _bench("fsdp1_memory.py", "--model", str(root), "--seq-len", "32", "--micro-batch", "2", "--steps", "6",
                  *extra)


HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None

CASES = {
    # test_shard_setup, test_shard_outside: the benches that measure a sharded run's setup and outside-step peaks
    "shard-setup": lambda root: _bench("shard_setup_memory.py", "--model", "tiny"),
    "outside-fsdp": lambda root: _bench("outside_memory.py", "--model", "tiny", "--seq-len", "64", "--micro-batch",
                                        "2", "--sharding", "fsdp"),
    # test_sharding_memory: the per-rank prediction against the measured tensor peak
    "memory-ddp": lambda root: _sharding_memory("ddp"),
    "memory-fsdp": lambda root: _sharding_memory("fsdp"),
    "memory-zero2": lambda root: _sharding_memory("zero2"),
    "memory-lora": lambda root: _sharding_memory("fsdp", "tiny", "--lora-r", "8", "--quantize", "none"),
    "memory-qlora": lambda root: _sharding_memory("fsdp", "tiny", "--lora-r", "8", "--quantize", "4bit"),
    "memory-qwen3": lambda root: _sharding_memory("fsdp", _qwen3(root / "qwen3")),
    # test_flat_params: FSDP (1)'s flat parameters (torch's FullyShardedDataParallel) against Stack(fsdp=1)'s estimate
    "fsdp1-layers": lambda root: _fsdp1_memory(root / "model", vocab=2048, layers=4),
    "fsdp1-root": lambda root: _fsdp1_memory(root / "model", vocab=8192, layers=2),
    "fsdp1-lora": lambda root: _fsdp1_memory(root / "model", 8192, 2, "--lora-r", "8"),
    "fsdp1-noshard": lambda root: _fsdp1_memory(root / "model", 8192, 2, "--no-shard"),
    "fsdp1-noshard-backward": lambda root: _fsdp1_memory(root / "model", 2048, 4, "--no-shard", "--seq-len", "256"),
    "fsdp1-accumulate": lambda root: _fsdp1_memory(root / "model", 2048, 4, "--accumulate", "3"),
    "fsdp1-lora-in-units": lambda root: _fsdp1_memory(root / "model", 2048, 4, "--lora-r", "8", "--orig-params",
                                                      "--accumulate", "3"),
    # test_train_dp: DDP, 22 samples, effective batch 4 (the 6th step holds 2), a checkpoint at step 3
    "dp": lambda root: _train(root, 22, [*TRAIN_ARGS[:TRAIN_ARGS.index("--no-packing")], "--packing", "none",
                                         *TRAIN_ARGS[TRAIN_ARGS.index("--no-packing") + 1:], "--save-every", "3"]),
    # test_train_fsdp: a full fine-tune under FSDP2, and LoRA under zero2 with evaluation
    "fsdp-full": lambda root: _train(root, 22, [*TRAIN_ARGS, "--sharding", "fsdp", "--save-every", "3"]),
    "zero2-lora": lambda root: _train(root, 23, [*TRAIN_ARGS, "--sharding", "zero2", "--lora-r", "4",
                                                 "--lora-targets", "q_proj,v_proj", "--eval-every", "3",
                                                 "--eval-fraction", "0.2"]),
    # ... and the phases outside the step of an FSDP2 run that evaluates 2 batches a rank and saves its full state
    # (test_train_fsdp)
    "phases-fsdp": lambda root: _train(root, 22, [*TRAIN_ARGS, "--sharding", "fsdp", "--max-steps", "3",
                                                  "--eval-every", "3", "--eval-fraction", "0.2", "--save-every", "3",
                                                  "--state-dict", "full"]),
    # test_preference_dp: DPO (a frozen reference copy) under DDP and ORPO under FSDP2, 22 pairs, the last step
    # partial (rank 1's dummy rows carry no pair), a checkpoint at step 3
    "dpo-ddp": lambda root: _train_pairs(root, 22, [*TRAIN_ARGS[:TRAIN_ARGS.index("--no-packing")], "--packing",
                                                    "none", "--method", "dpo",
                                                    *TRAIN_ARGS[TRAIN_ARGS.index("--no-packing") + 1:],
                                                    "--save-every", "3"]),
    # ... ORPO's FSDP2 run saves full-state checkpoints at step 3 (test_preference_dp resumes one on 1 process)
    "orpo-fsdp": lambda root: _train_pairs(root, 22, [*TRAIN_ARGS, "--method", "orpo", "--sharding", "fsdp",
                                                      "--state-dict", "full", "--save-every", "3"]),
    # ... DPO under FSDP2 with a frozen copy of the base as reference (rank 1 built its model empty: its copy
    # receives rank 0's weights)
    "dpo-fsdp": lambda root: _train_pairs(root, 22, [*TRAIN_ARGS, "--method", "dpo", "--sharding", "fsdp"]),
    # ... and DPO under DDP with --precompute-reference: each rank computes its share, gathered on both
    "dpo-precompute": lambda root: _train_pairs(root, 22, [*TRAIN_ARGS[:TRAIN_ARGS.index("--no-packing")],
                                                           "--packing", "none", "--method", "dpo",
                                                           "--precompute-reference",
                                                           *TRAIN_ARGS[TRAIN_ARGS.index("--no-packing") + 1:]]),
    # test_shard_qlora: QLoRA under DDP, and under FSDP2 (the 4-bit base sharded)
    "qlora-ddp": lambda root: _train(root, 22, [*QLORA_ARGS, "--lora-r", "4", "--quantize", "4bit"]),
    "qlora-fsdp": lambda root: _train(root, 22, [*QLORA_ARGS, "--lora-r", "4", "--quantize", "4bit",
                                                 "--sharding", "fsdp", "--save-every", "2"]),
    # test_moe_dp: a mixture-of-experts model under DDP with accumulation (1 x 2) and FSDP2 without (2 x 1)
    "moe-ddp": lambda root: _train_moe(root, "ddp", 1, 2),
    "moe-fsdp": lambda root: _train_moe(root, "fsdp", 2, 1),
}
NEEDS_BNB = {"qlora-ddp", "qlora-fsdp", "memory-qlora"}


def build(names: list[str], root: Path) -> list[dict]:
    """The named cases, in ``CASES``' order, each with its inputs under ``root/NAME``."""
    cases = []
    for name in CASES:
        if name in names and (HAS_BNB or name not in NEEDS_BNB):
            (root / name).mkdir(parents=True, exist_ok=True)
            cases.append({"name": name, **CASES[name](root / name)})
    return cases

"""Decoder causal LMs of the installed transformers that the accuracy grid never covered: tiny configs, the estimate
against a measured CPU training step, or a refusal, never a traceback.

    python bench/architecture_sweep.py --out /tmp/sweep.json                   # the priority list, fp32
    python bench/architecture_sweep.py --types gemma4_text,llama4_text --variants fp32,lora,bf16 --out s.json
    python bench/architecture_sweep.py --table s.json                          # a Markdown table of a result file

Each case, in a subprocess of its own (``--timeout`` s): a tiny config (``GENERIC``: hidden 64, 3 layers, 4 heads
of 16, 2 key/value heads, vocabulary 307, changed per type by ``SPECIAL``, or filled by ``auto_kwargs`` from the
config class's own fields), ``AutoModelForCausalLM.from_config``, memfit's analytic estimate (``device="cpu"``), and
3 steps of AdamW through ``memfit.training.loop.run_training`` as tests/test_train_prediction_families.py runs them
(micro-batch 2, seq 96, the QA data), comparing the measured tensor peak with the prediction at the measured rows.
Variants: fp32 (full fine-tune), lora (r 8), bf16 (mixed precision). Outcomes: ``ok`` (within 3%), ``off>3%``,
``estimate refused`` (a one-sentence ``UserError``), ``estimate crash`` (anything else: a bug), ``train ...``.
Round 18 (2026-12-06, transformers 5.25) swept about 90 types; its findings are in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

VARIANTS = {"fp32": {}, "lora": {"lora_r": 8}, "bf16": {"mixed_precision": "bf16"}}

#: hidden 64, 3 layers (derived recipes trace 2 and extrapolate), 4 heads of 16, 2 kv heads, vocab 307 (prime)
GENERIC = dict(vocab_size=307, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

#: per model type: changes to GENERIC (None value: drop the key)
SPECIAL: dict[str, dict] = {
    "gemma": {},
    "gemma3_text": dict(sliding_window=32, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "cohere": {},
    "cohere2": dict(sliding_window=32, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=64, intermediate_size_mlp=128,
                        interleave_moe_layer_step=1, attention_chunk_size=32,
                        no_rope_layers=[1, 1, 0]),
    "phi": dict(num_key_value_heads=None, head_dim=None),
    "falcon": dict(num_key_value_heads=None, head_dim=None, num_kv_heads=2, new_decoder_architecture=True),
    "bloom": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None),
    "gptj": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None, n_inner=128, rotary_dim=8),
    "starcoder2": dict(head_dim=None),
    "exaone4": dict(sliding_window=32, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "smollm3": dict(no_rope_layers=[1, 1, 0]),
    "glm": {},
    "glm4": {},
    "olmo": dict(head_dim=None),
    "olmo3": dict(head_dim=None, sliding_window=32,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "hunyuan_v1_dense": {},
    "ernie4_5": {},
    "apertus": {},
    "seed_oss": {},
    "arcee": {},
    "helium": {},
    "nemotron": {},
    "dbrx": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None, d_model=64, n_heads=4, n_layers=3,
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}),
    # jetmoe: attention heads = num_key_value_heads * num_experts_per_tok (4), head_dim is kv_channels
    "jetmoe": dict(num_key_value_heads=2, head_dim=None, num_local_experts=4, num_experts_per_tok=2,
                   kv_channels=16, intermediate_size=64),
    "minimax": dict(num_local_experts=4, num_experts_per_tok=2, block_size=32,
                    layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                      mamba_d_conv=4, mamba_chunk_size=32),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                  mamba_chunk_size=32, attn_layer_indices=[1]),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=None),
    "dots1": dict(first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                  moe_intermediate_size=32, n_group=1, topk_group=1),
    "ministral": dict(sliding_window=32, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "mpt": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None, d_model=64, n_heads=4,
                n_layers=3, expansion_ratio=2, max_seq_len=512),
    "codegen": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None, n_inner=128, rotary_dim=8,
                    n_ctx=512),
    "opt": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None, ffn_dim=128,
                word_embed_proj_dim=64, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "gpt_bigcode": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None, n_inner=128),
    "persimmon": dict(num_key_value_heads=None, head_dim=None),
    "recurrent_gemma": dict(lru_width=64, attention_window_size=32, block_types=["recurrent", "attention"],
                            conv1d_width=4, num_key_value_heads=1),
    "zamba2": dict(mamba_d_state=16, mamba_headdim=16, mamba_ngroups=1, n_mamba_heads=8, mamba_d_conv=4,
                   chunk_size=32, hybrid_layer_ids=[1], layers_block_type=["mamba", "hybrid", "mamba"], num_mem_blocks=1, use_shared_attention_adapter=False,
                   adapter_rank=8, use_mem_rope=False),
    "mamba2": dict(num_key_value_heads=None, head_dim=16, num_heads=8, state_size=16, n_groups=1, expand=2,
                   chunk_size=32, conv_kernel=4, intermediate_size=None),
    "mamba": dict(num_key_value_heads=None, head_dim=None, state_size=16, expand=2, conv_kernel=4,
                  intermediate_size=None),
    "gpt_neo": dict(num_key_value_heads=None, head_dim=None, attention_types=[[["global", "local"], 1], [["global"], 1]],
                    window_size=32, intermediate_size=128),
    "biogpt": dict(num_key_value_heads=None, head_dim=None),
    "xglm": dict(num_key_value_heads=None, head_dim=None, ffn_dim=128, d_model=64, attention_heads=4),
    "openai-gpt": dict(num_key_value_heads=None, head_dim=None, intermediate_size=None, n_positions=512),
    "ctrl": dict(num_key_value_heads=None, head_dim=None, dff=128, n_positions=512),
}

SECOND = ["gpt_neo", "internlm3", "diffllama", "bitnet", "vaultgemma", "biogpt", "xglm", "exaone", "phimoe", "minicpm3",
          "granitemoeshared", "hunyuan_v1_moe", "ernie4_5_moe", "glm4_moe", "cwm", "nanochat", "doge", "gemma3n_text",
          "jamba", "lfm2_moe", "olmo_hybrid", "granitemoehybrid", "nemotron_h", "falcon_mamba", "mamba", "openai-gpt",
          "ctrl", "afmoe", "flex_olmo", "granite_swa", "granitemoe_swa", "jais2", "kimi_linear", "longcat_flash",
          "minimax_m2", "ministral3", "qwen3_5_text", "qwen3_5_moe_text", "solar_open", "gemma4_text", "deepseek_v32",
          "exaone_moe", "glm4_moe_lite", "youtu", "mellum", "cohere2_moe", "apertus1p5_text", "gpt_neox_japanese",
          "zamba", "xlstm", "rwkv"]

PRIORITY = ["gemma", "gemma3_text", "cohere", "cohere2", "llama4_text", "phi", "falcon", "bloom", "gptj",
            "starcoder2", "exaone4", "smollm3", "glm", "glm4", "olmo", "olmo3", "hunyuan_v1_dense", "ernie4_5",
            "apertus", "seed_oss", "arcee", "helium", "nemotron", "dbrx", "jetmoe", "minimax", "qwen3_next",
            "falcon_h1", "bamba", "granitemoe", "deepseek_v2", "dots1", "ministral", "mpt", "codegen", "opt",
            "gpt_bigcode", "persimmon", "recurrent_gemma", "zamba2", "mamba2"]


#: Small sizes for the fields a config class declares (``auto_kwargs``): mixture-of-experts, MLA, linear attention, mamba.
SMALL = dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_k=2, moe_topk=2, top_k_experts=2,
    moe_intermediate_size=32, expert_ffn_hidden_size=32, shared_expert_intermediate_size=64,
    shared_intermediate_size=64, n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1, num_dense_layers=1, moe_layer_start_index=1,
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16,
    index_head_dim=16, index_n_heads=2, index_topk=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
    sliding_window=32, laurel_rank=8, altup_num_inputs=2, hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=307, num_kv_shared_layers=0,
    mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=32,
    mamba_expand=2, mamba_dt_rank=8, mamba_num_heads=4, mamba_head_dim=32,
    ssm_state_size=16, state_size=16, conv_kernel=4, expand=2, time_step_rank=8, n_groups=1, chunk_size=32,
    time_step_limit=(0.0, 100.0),
)


def declared_fields(cls) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        names |= set(getattr(klass, "attribute_map", {}) or {})
        names |= set(getattr(klass, "__dataclass_fields__", {}) or {})
    return names


def auto_kwargs(model_type: str, generic: dict) -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = declared_fields(cls)
    kw = {k: v for k, v in generic.items() if k in fields or k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                                    "tie_word_embeddings", "vocab_size")}
    kw.update({k: v for k, v in SMALL.items() if k in fields})
    if "q_lora_rank" in fields or "kv_lora_rank" in fields:  # MLA: as many kv heads as heads, no head_dim
        kw["num_key_value_heads"] = generic["num_attention_heads"]
        kw.pop("head_dim", None)
    return kw


def build_config(model_type: str):
    """The tiny config of ``model_type``, or of ``type+key=json+key=json`` (extra changes: ``opt+dropout=0.0``)."""
    from transformers import AutoConfig

    model_type, *extra = model_type.split("+")
    kw = dict(GENERIC) if model_type in SPECIAL else auto_kwargs(model_type, GENERIC)
    changes = dict(SPECIAL.get(model_type, {}))
    changes.update({k: json.loads(v) for k, v in (e.split("=", 1) for e in extra)})
    for key, value in changes.items():
        if value is None:
            kw.pop(key, None)
        else:
            kw[key] = value
    return AutoConfig.for_model(model_type, **kw)


def _tail(err: BaseException, n: int = 8) -> list[str]:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip().splitlines()[-n:]


def one(model_type: str, variant: str, work: Path) -> dict:
    """One case (module docstring), in this process."""
    from _train_helpers import tiny_config
    from memfit.errors import UserError
    from memfit.memory.estimate import estimate
    from memfit.settings.config import RunConfig
    from memfit.training.loop import run_training

    result: dict = {"model_type": model_type, "variant": variant}
    folder = work / "family"  # not work/"model": tiny_config writes its own tiny Llama there
    try:
        from transformers import AutoModelForCausalLM

        config = build_config(model_type)
        model = AutoModelForCausalLM.from_config(config)
        result["model_class"], result["params"] = type(model).__name__, sum(p.numel() for p in model.parameters())
        config.save_pretrained(folder)
    except Exception as err:  # noqa: BLE001
        return {**result, "outcome": "config/model build failed", "error": f"{type(err).__name__}: {str(err)[:300]}"}
    run_kw = {"optimizer": "adamw", "micro_batch": 2, "seq_len": 96, **VARIANTS[variant]}
    model_path = str(folder / "config.json")
    try:
        est = estimate(model_path, RunConfig.of(packing="none", grad_accum=1, **run_kw), device="cpu")
        result["estimate"] = {"peak_bytes": est.peak_bytes, "recipe": est.recipe}
    except UserError as err:
        result["estimate"] = {"refused": str(err)}
    except Exception as err:  # noqa: BLE001
        result["estimate"] = {"crash": f"{type(err).__name__}: {str(err)[:300]}", "traceback_tail": _tail(err)}
    try:
        cfg = tiny_config(work, model=model_path, run=run_kw)
        run_training(cfg, show=False)
        record = json.loads((Path(cfg.folder.output) / "run.json").read_text())
        measured = record["peak_memory"]["peak_bytes"]
        predicted = record["predicted_at_measured_rows"] or record["predicted_peak_bytes"]
        result["train"] = {"measured": measured, "predicted": predicted,
                           "recipe": (record.get("predicted") or {}).get("recipe")}
        if measured and predicted:
            result["train"]["error_pct"] = round(100 * (predicted - measured) / measured, 2)
            result["outcome"] = "ok" if abs(predicted - measured) <= 0.03 * measured else "off>3%"
        else:
            result["outcome"] = "no prediction"
    except UserError as err:
        result["train"], result["outcome"] = {"refused": str(err)}, "train refused"
    except Exception as err:  # noqa: BLE001
        result["train"] = {"crash": f"{type(err).__name__}: {str(err)[:300]}", "traceback_tail": _tail(err)}
        result["outcome"] = "train crash"
    est = result.get("estimate", {})
    if "crash" in est or "refused" in est:
        result["outcome"] = ("estimate crash; " if "crash" in est else "estimate refused; ") + result["outcome"]
    return result


def sweep(types: list[str], variants: list[str], out: Path, timeout: int) -> dict:
    """Every case in a subprocess of its own; results written to ``out`` after each."""
    results = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="memfit-sweep-") as tmp:
        for model_type in types:
            for variant in variants:
                work = Path(tmp) / f"{model_type}-{variant}"
                work.mkdir()
                case_out = work / "result.json"
                started = time.perf_counter()
                try:
                    proc = subprocess.run([sys.executable, __file__, "--one", model_type, variant, str(work)],
                                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
                    res = json.loads(case_out.read_text()) if case_out.exists() else \
                        {"model_type": model_type, "variant": variant, "outcome": f"process exit {proc.returncode}",
                         "log_tail": proc.stderr.splitlines()[-8:]}
                except subprocess.TimeoutExpired:
                    res = {"model_type": model_type, "variant": variant, "outcome": f"timeout after {timeout} s"}
                res["seconds"] = round(time.perf_counter() - started, 1)
                results[f"{model_type}/{variant}"] = res
                out.write_text(json.dumps(results, indent=1, default=str))
                print(f"{model_type}/{variant:6s} {res['outcome']:40s} error "
                      f"{res.get('train', {}).get('error_pct')}% ({res['seconds']} s)", flush=True)
    return results


def table(results: dict) -> str:
    """A Markdown table: case, outcome, error, recipe or the refusal."""
    rows = ["| case | outcome | error | recipe, refusal or crash |", "|---|---|---|---|"]
    for key, res in results.items():
        train, est = res.get("train", {}), res.get("estimate", {})
        error = f"{train['error_pct']:+.2f}%" if "error_pct" in train else "-"
        said = train.get("recipe") or est.get("refused") or est.get("crash") or train.get("refused") or ""
        rows.append(f"| {key} | {res.get('outcome', '?')} | {error} | {str(said)[:160]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(PRIORITY), help="model types, comma-separated")
    parser.add_argument("--variants", default="fp32", help="of " + ", ".join(VARIANTS))
    parser.add_argument("--out", type=Path, help="the result file (JSON; kept and extended)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per case")
    parser.add_argument("--table", type=Path, help="print a result file as Markdown and stop")
    parser.add_argument("--one", nargs=3, metavar=("TYPE", "VARIANT", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        model_type, variant, work = args.one
        result = one(model_type, variant, Path(work))
        (Path(work) / "result.json").write_text(json.dumps(result, indent=1, default=str))
        return 0
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.out is None:
        parser.error("--out is required for a sweep")
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    print(table(sweep(args.types.split(","), args.variants.split(","), args.out, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every training config four tools ship, read by ``memfit.interop`` and priced by the analytic estimate
(issue #35): how many are priced, refused in one sentence, crash, or look mis-read.

    python bench/interop_sweep.py                       # the mirrors under /work/.mirror
    python bench/interop_sweep.py --mirrors DIR --list  # ... and one line per file
    python bench/interop_sweep.py --tool axolotl --only suspect,crash --list

``--mirrors`` holds bare git repositories (``owner+name/repo``); each tool's shipped configs (and the DeepSpeed/
FSDP files they name) are copied at the mirror's HEAD into a scratch folder with their paths kept, and read
from the repository's root, as the tools resolve ``deepspeed: examples/deepspeed/ds_z3_config.json``. Nothing is
downloaded (``HF_HUB_OFFLINE=1``): a Hub model memfit has no preset for is priced on ``FALLBACK`` instead (the
run, not the architecture, is what is swept) and counted apart: a refusal there may be the fallback's (LoRA
targets of another architecture).

Each file is one of: ``priced``; ``refused`` (a ``memfit.errors.UserError``: one sentence); ``crash`` (any other
exception: a bug); ``suspect`` (priced, but the file names a preference/RL method priced as SFT, a distributed
launch priced replicated with no sentence, or a quantized base priced unquantized: read it by hand). Not run by
the test suite (the mirrors are not in CI); ``classify`` is (tests/test_interop_sweep.py).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: tool -> (mirror folder, the configs it ships, the files they may name: DeepSpeed JSON, accelerate's FSDP YAML).
SOURCES = {
    "axolotl": ("axolotl-ai-cloud+axolotl", r"^examples/.*\.ya?ml$", r"^deepspeed_configs/.*\.json$"),
    "llamafactory": ("hiyouga+LLaMA-Factory", r"^examples/.*\.ya?ml$", r"^examples/.*\.json$"),
    "torchtune": ("pytorch+torchtune", r"^recipes/configs/.*\.yaml$", None),
    "handbook": ("huggingface+alignment-handbook", r"^recipes/.*\.yaml$", None),
}
#: The preset a Hub model without one is priced on (a long context, so the file's sequence length is kept).
FALLBACK = "llama-3.1-8b"

#: Words that name a training objective memfit must not price as next-token training.
PREFERENCE = re.compile(r"(?<![a-z])(dpo|orpo|kto|simpo|ipo|cpo|apo|grpo|gdpo|ppo|rloo|rm|reward|gkd)(?![a-z])")


@dataclass(frozen=True)
class Outcome:
    kind: str  # priced | refused | crash | suspect
    detail: str
    fallback: bool = False


def _objective_words(path: Path, data: dict) -> str:
    """What in the file names its objective: the RL/stage keys, the loss component, the file's name and folder."""
    loss = data.get("loss")
    loss = loss.get("_component_", "") if isinstance(loss, dict) else loss or ""
    said = [str(data.get(k) or "") for k in ("rl", "stage", "loss_type", "pref_loss")]
    name = "" if "sft" in re.split(r"[^a-z0-9]+", path.stem.lower()) else path.stem  # 3B_sft_for_grpo: an SFT run
    return " ".join([*said, str(loss).rsplit(".", 1)[-1], path.parent.name, name]).lower()


def _suspicions(path: Path, data: dict, reading, run) -> list[str]:
    """What looks mis-read in a priced file (each a reason to read it by hand)."""
    out = []
    words = _objective_words(path, data)
    if str(run.method) == "sft" and PREFERENCE.search(re.sub(r"[^a-z0-9]+", " ", words)):
        out.append(f"objective words {PREFERENCE.search(re.sub(r'[^a-z0-9]+', ' ', words)).group(0)!r} priced as sft")
    text = path.read_text(encoding="utf-8", errors="replace")
    distributed = [k for k in ("deepspeed", "fsdp", "fsdp_config", "fsdp_version") if data.get(k)]
    if "_distributed" in path.stem or re.search(r"nproc|num_processes|torchrun", text):
        distributed.append("launch")
    said = " ".join(reading.unmapped + reading.priced)
    if distributed and str(run.sharding) == "ddp" and not re.search(r"ZeRO-[01]|NO_SHARD", said):
        out.append(f"distributed ({', '.join(distributed)}) priced replicated")
    quantized = [k for k in ("load_in_4bit", "load_in_8bit", "quantization_bit", "quantization_method")
                 if data.get(k)] + (["qlora"] if "qlora" in str(data.get("adapter", "")) else [])
    model = data.get("model")
    if isinstance(model, dict) and ".qlora_" in str(model.get("_component_", "")):
        quantized.append("qlora builder")
    if quantized and str(run.quantize) == "none" and "quantiz" not in said.lower():
        out.append(f"quantized ({', '.join(quantized)}) priced unquantized")
    return out


def classify(path: str | Path) -> Outcome:
    """Read ``path`` as ``estimate --from`` does and price it analytically (see the module docstring)."""
    import memfit
    from memfit.errors import UserError
    from memfit.interop import read
    from memfit.interop.common import check_model, load_file

    path = Path(path)
    fallback = False
    try:
        reading = read(path)
        run = reading.with_flags({})
        try:
            check_model(reading)
        except UserError:
            if reading.model is None or "/" not in reading.model:
                raise
            fallback = True
        # as estimate --from: what the model cannot run of the file is refused in the file's keys
        spec = memfit.load_spec(FALLBACK) if fallback else reading.spec(run=run)
        memfit.estimate(spec, run, device="cuda", engine=reading.engine, stack=reading.stack)
    except UserError as err:
        message = str(err)
        one = "\n" not in message.strip() and message.rstrip().endswith((".", ")"))
        return Outcome("refused" if one else "crash", message if one else f"not one sentence: {message}", fallback)
    except Exception as err:  # noqa: BLE001 - every other exception is the bug this sweep looks for
        where = traceback.extract_tb(err.__traceback__)[-1]
        return Outcome("crash", f"{type(err).__name__}: {err} ({Path(where.filename).name}:{where.lineno})", fallback)
    doubts = _suspicions(path, load_file(path), reading, run)
    flat = run.to_flat()
    summary = (f"{reading.tool} {flat['method']} r{flat['lora_r']} q{flat['quantize']} {flat['sharding']}x"
               f"{flat['num_processes']} seq {flat['seq_len']} mb {flat['micro_batch']} {flat['dtype']}/"
               f"{flat['mixed_precision']} {flat['loss']} {flat['packing']} off {flat['offload']}")
    if doubts:
        return Outcome("suspect", "; ".join(doubts) + f" [{summary}]", fallback)
    return Outcome("priced", summary, fallback)


def extract(mirrors: Path, scratch: Path, tool: str) -> tuple[Path, list[Path]]:
    """Copy ``tool``'s shipped configs (and the files they name) out of its bare mirror; (root, configs)."""
    folder, configs, support = SOURCES[tool]
    git = ["git", f"--git-dir={mirrors / folder / 'repo'}"]
    names = subprocess.run([*git, "ls-tree", "-r", "--name-only", "HEAD"], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    root, found = scratch / folder, []
    for name in names:
        wanted = re.search(configs, name)
        if not wanted and not (support and re.search(support, name)):
            continue
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(subprocess.run([*git, "show", f"HEAD:{name}"], check=True, capture_output=True).stdout)
        if wanted:
            found.append(target)
    return root, sorted(found)


def sweep(mirrors: Path, tools: list[str], scratch: Path) -> dict[str, list[tuple[str, Outcome]]]:
    results = {}
    for tool in tools:
        root, files = extract(mirrors, scratch, tool)
        here = Path.cwd()
        os.chdir(root)  # the tools resolve the DeepSpeed/FSDP files their configs name from the repository root
        try:
            results[tool] = [(str(f.relative_to(root)), classify(f.relative_to(root))) for f in files]
        finally:
            os.chdir(here)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    parser.add_argument("--tool", action="append", choices=sorted(SOURCES), help="default: every tool")
    parser.add_argument("--list", action="store_true", help="one line per file")
    parser.add_argument("--only", default="", help="with --list: the kinds to list (comma-separated)")
    args = parser.parse_args(argv)
    from memfit import quiet_import_notices

    with quiet_import_notices(), tempfile.TemporaryDirectory(prefix="interop_sweep_") as scratch:
        results = sweep(args.mirrors, args.tool or list(SOURCES), Path(scratch))
    only = set(filter(None, args.only.split(",")))
    for tool, rows in results.items():
        if args.list:
            for name, out in rows:
                if not only or out.kind in only:
                    print(f"{tool} {out.kind:8} {name}{' (fallback model)' if out.fallback else ''}: {out.detail}")
    print(f"{'tool':14} {'files':>5} {'priced':>6} {'refused':>7} {'crash':>5} {'suspect':>7} {'(fallback)':>10}")
    for tool, rows in results.items():
        counts = Counter(out.kind for _, out in rows)
        fallback = sum(out.fallback for _, out in rows)
        print(f"{tool:14} {len(rows):5} {counts['priced']:6} {counts['refused']:7} {counts['crash']:5} "
              f"{counts['suspect']:7} {fallback:10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

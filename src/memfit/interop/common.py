"""What every reader of another tool's training configuration shares: the file, its keys, the model.

A reader walks the keys of one file with a ``Keys`` object: every key it reads is marked, values are
checked as they are read (one sentence naming the file and the key on a bad one), and what it cannot
map is recorded as a sentence saying what that means for the number. Keys never read are reported
too: known ones that do not change memory in one summary sentence, unknown ones by name, so a reading
never drops a setting silently.

Size: over 500 lines because it is the one place every reader imports (``Reading``, ``Keys``, the model name, the
precision switches, LoRA targets, the launch command in the comments, Trainer's optimizer names); each part is a
few short functions, and splitting them would spread one file's reading over modules that each reader needs.
"""

# Inside a function: transformers.training_args (8.5 s to import; python -X importtime, 2026-12-06, this shared
# 2-core machine): it imports transformers.trainer_utils, hence PEFT and bitsandbytes (and its import-time notice).
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memfit.errors import UserError
from memfit.files import user_path
from memfit.integrations.quant_support import shards_packed_weights
from memfit.settings.config import RunConfig
from memfit.settings.stack import Stack
from memfit.spec.model import check_seq_len, is_preset, load_presets, load_spec
from memfit.spec.resolved import attention

_MISSING = object()


@dataclass(frozen=True)
class Reading:
    """One tool's configuration read as memfit's run description."""

    path: str
    tool: str
    """The tool's name as ``--from-format`` spells it (``trl``, ``axolotl``, ``llamafactory``, ``torchtune``)."""
    model: str | None
    """What ``memfit.spec.model.load_spec`` takes: a preset, a local folder or a Hub id; None: the file names none."""
    model_key: str
    run: RunConfig
    priced: tuple[str, ...] = ()
    """How the tool's own behaviour was priced where it differs from memfit's stack (sentences)."""
    unmapped: tuple[str, ...] = ()
    """Every setting that could not be mapped, with what it means for the number (sentences)."""
    data: dict = field(default_factory=dict, compare=False, repr=False)
    """The file's contents as read (``emit`` updates them for the same tool)."""
    engine: str = "fsdp2"
    """Which engine shards ``zero2``/``zero3`` (``memory.deepspeed_layout.ENGINES``): ``deepspeed`` when the file
    launches DeepSpeed, else FSDP2's layout (``fsdp`` settings, or none)."""
    processes_stated: bool = False
    """Whether the file states its process count (a launch command in its comments); else ``--num-processes``."""
    origins: dict = field(default_factory=dict, compare=False, repr=False)
    """memfit setting -> the file's key that set it, so a refusal names what the user wrote (``origin``)."""
    stack: Stack = field(default_factory=Stack)
    """The trainer (and FSDP version) that runs the file, which ``estimate`` prices (``memfit.settings.stack``);
    versions are the installed ones, as none of these files pins them."""
    flash_as_sdpa: str = ""
    """The file's key asking for flash-attention where it is priced as SDPA (``flash_attention``), else ""."""
    unknown_model: str = ""
    """Why ``load_spec`` cannot read ``model`` (a torchtune builder with no preset), raised unless MODEL is given."""

    def with_flags(self, typed: dict[str, Any]) -> RunConfig:
        """The run with the memory flags typed on the command line written over it; a combination memfit
        cannot price is one sentence naming the file's keys (not memfit flags the user never typed)."""
        run = RunConfig.from_flat({**self.run.to_flat(), **typed})

        if str(run.quantize) != "none" and str(run.offload) == "params" and not shards_packed_weights(run):
            raise UserError(f"{self.path}: {self.origin('offload')} offloads the parameters of a "
                            f"{self.origin('quantize')} base, which only FSDP sharding over 2 or more processes can "
                            f"do ({self.origin('sharding')}); the file does not say how many processes, so give "
                            "--num-processes N.")
        return run

    def origin(self, setting: str) -> str:
        """The file's key that set ``setting`` (memfit's flag where the file set none)."""
        return self.origins.get(setting) or "--" + setting.replace("_", "-")

    def spec(self, trust_remote_code: bool = False, run: RunConfig | None = None, model: str | None = None,
             revision: str | None = None):
        """The model's ``ModelSpec``; an unknown model is one sentence naming the file and the key. ``model``: the
        MODEL given over the file (``memfit estimate MODEL --from FILE``), loaded instead of the file's. With ``run``
        (the run priced: the file's, flags typed over it), what the model cannot run of it (LoRA targets that match no
        projection, an attention it does not support, a length beyond its positions) is refused here, naming the
        file's keys for the settings the file set (``in_file_terms``), MODEL or not."""
        spec = load_spec(model, trust_remote_code, revision) if model else check_model(self, trust_remote_code)
        if run is not None:
            try:
                spec.check_lora_targets(run)
                attention(spec, run.attn_implementation, run.compute_dtype())
                check_seq_len(run.seq_len, spec.max_position_embeddings)
            except UserError as err:
                said = str(err)
                if self.flash_as_sdpa and str(run.attn_implementation) == "sdpa" == str(self.run.attn_implementation) \
                        and "attn-implementation sdpa" in said:  # the file asks for flash-attention, not SDPA
                    raise UserError(f"{self.path}: {self.flash_as_sdpa} asks for flash-attention, which memfit prices "
                                    "as SDPA as flash-attn is not installed here, and "
                                    f"{said.split(' cannot run ', 1)[0]} cannot run SDPA; install flash-attn, or give "
                                    "--attn-implementation eager.") from None
                raise UserError(f"{self.path}: {self.in_file_terms(said, run)}") from None
        return spec

    def in_file_terms(self, sentence: str, run: RunConfig) -> str:
        """``sentence`` with its subject, a memfit flag (``--lora-targets``) the file set and ``run`` keeps as the file
        has it, written as the file's key (``lora_target_modules``); a flag typed over the file stays as typed, and so
        does the advice after it (``use --seq-len 4096 or less``: a flag to type over the file)."""
        mine, file_flat = run.to_flat(), self.run.to_flat()

        def key(match: re.Match) -> str:
            setting = match.group(1).replace("-", "_")
            same = setting in file_flat and mine.get(setting) == file_flat[setting]
            return self.origins[setting] if same and setting in self.origins else match.group(0)
        return re.sub(r"--([a-z0-9-]+)", key, sentence, count=1)  # the subject; advice stays memfit's flags

    def plan_pins(self) -> dict[str, Any]:
        """What ``plan --from`` keeps of the file: the method (full fine-tune, LoRA or QLoRA, with its rank, alpha,
        dropout and targets; the objective, sft or a preference method, and DPO's reference), how documents fill
        rows, and the attention; the planner chooses the rest (precision, checkpointing, optimizer, micro-batch,
        loss, sharding, ...) among what the tool runs."""
        run = self.run
        pins = {"lora_r": run.lora.r, "packing": str(run.packing), "attn_implementation": str(run.attn_implementation),
                "quantize": str(run.quantize), "method": str(run.method)}
        if str(run.method) == "dpo":
            pins["precompute_reference"] = run.precompute_reference
        if run.is_lora():
            pins.update(lora_alpha=run.lora.alpha, lora_dropout=run.lora.dropout, lora_targets=run.lora.targets)
        return pins

    def unmapped_for(self, run: RunConfig | None = None) -> tuple[str, ...]:
        """``unmapped``, with the process count assumed for ``run`` (the run priced) when the file states none."""
        if self.processes_stated:
            return self.unmapped
        return (*self.unmapped, processes_sentence(run or self.run, self.engine, self.stack.fsdp))

    def to_dict(self, run: RunConfig | None = None) -> dict[str, Any]:
        return {"file": self.path, "format": self.tool, "model": self.model, "engine": self.engine,
                "priced": list(self.priced), "unmapped": list(self.unmapped_for(run))}


def load_file(path: str | Path) -> dict:
    """A YAML or JSON file's top-level mapping, or one sentence naming the file."""

    path = user_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read ({getattr(err, 'strerror', None) or err}).") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        where = getattr(getattr(err, "problem_mark", None), "line", None)
        at = f" (line {where + 1})" if where is not None else ""
        raise UserError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}{at}, so it is no "
                        "training configuration.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a mapping of settings, so it is no training configuration.")
    return data


class Keys:
    """The keys of one file as a reader consumes them (see the module docstring)."""

    def __init__(self, path: str, tool: str, data: dict) -> None:
        self.path, self.tool, self.data = str(path), tool, data
        self.read: set[str] = set()
        self.unmapped: list[str] = []
        self.priced: list[str] = []
        self.engine = "fsdp2"
        self.origins: dict[str, str] = {}
        self.stack: dict[str, Any] = {"trainer": tool}
        """``Stack.of``'s mapping: the tool runs the file; a reader adds what the file says (``fsdp: 1``)."""
        self.unknown_model = self.flash_as_sdpa = ""  # Reading's fields of the same names
        self.stated_processes = stated_processes(self.path)
        if self.stated_processes is not None:
            self.price(f"processes: {self.stated_processes}, as the launch command in the file's comments starts it "
                       "(--num-processes overrides).")

    def processes_from(self, count: Any, where: str) -> None:
        """A process count the file states under ``where`` (the Accelerate config its launch command names, Ray's
        workers), unless a launch command in its comments gave one."""
        if self.stated_processes is None and isinstance(count, int) and not isinstance(count, bool) and count > 0:
            self.stated_processes = count
            self.price(f"processes: {count}, as {where} says (--num-processes overrides).")

    def error(self, key: str, message: str) -> UserError:
        """One sentence naming the file and the key."""
        return UserError(f"{self.path}, {key}: {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (``default`` when absent or null), marked as read."""
        self.read.add(key)
        value = self.data.get(key, _MISSING)
        return default if value is _MISSING or value is None else value

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(key, f"{value!r} is not a whole number >= {minimum}.")
        return value

    def float(self, key: str, default: float | None = None) -> float | None:
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise self.error(key, f"{value!r} is not a non-negative number.")
        return float(value)

    def bool(self, key: str, default: bool = False, *, extra: tuple = ()) -> Any:
        """A boolean (YAML true/false, or the strings true/false); ``extra``: other values the tool allows."""
        value = self.get(key, default)
        if value in extra:
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            allowed = ", ".join(["true", "false", *map(str, extra)])
            raise self.error(key, f"{value!r} is not one of {allowed}.")
        return value

    def choice(self, key: str, table: dict, default: Any = None) -> Any:
        """``table[value]`` (matched in lower case); an unknown value is one sentence listing the known ones."""
        value = self.get(key, default)
        if value is None:
            return None
        found = table.get(str(value).lower(), _MISSING)
        if found is _MISSING:
            raise self.error(key, f"{value!r} is not one of {', '.join(sorted(table))}.")
        return found

    def origin(self, key: str, *settings: str) -> None:
        """Record that the file's ``key`` set memfit's ``settings`` (named in refusals instead of memfit's flags)."""
        for setting in settings:
            self.origins.setdefault(setting, key)

    def not_mapped(self, key: str, sentence: str) -> None:
        """Record that ``key`` (given in the file) is not mapped; ``sentence`` says what that means."""
        self.read.add(key)
        self.unmapped.append(f"{key}: {sentence}")

    def price(self, sentence: str) -> None:
        self.priced.append(sentence)

    def leftovers(self, no_memory_effect: frozenset[str]) -> None:
        """Report the keys no reader step read: those known to change nothing in memory in one sentence,
        the rest by name (a setting memfit does not know is not priced)."""
        rest = [k for k, v in self.data.items() if k not in self.read and v is not None]
        quiet = sorted(k for k in rest if k in no_memory_effect)
        unknown = sorted(k for k in rest if k not in no_memory_effect)
        if unknown:
            self.unmapped.append(f"{', '.join(unknown)}: not settings memfit knows for {self.tool}; if "
                                 f"{'they change' if len(unknown) > 1 else 'it changes'} memory, the estimate "
                                 "does not include it.")
        if quiet:
            self.priced.append(f"{len(quiet)} setting{'s' if len(quiet) > 1 else ''} with no effect on memory "
                               f"(data, schedule, logging, saving) left aside: {', '.join(quiet)}.")

    def reading(self, model: str | None, model_key: str, run: dict[str, Any]) -> Reading:
        """The ``Reading``; a value ``RunConfig`` refuses is one sentence naming the file."""
        if self.stated_processes is not None:
            run = {**run, "num_processes": self.stated_processes}
        try:
            config = RunConfig.of(**run)
        except UserError as err:
            said = re.sub(r"--([a-z0-9-]+)", lambda m: self.origins.get(m.group(1).replace("-", "_"), m.group(0)),
                          str(err))
            raise UserError(f"{self.path}: {said}") from None
        return Reading(self.path, self.tool, model, model_key, config, tuple(self.priced), tuple(self.unmapped),
                       self.data, self.engine, self.stated_processes is not None, dict(self.origins),
                       Stack.of(self.stack), self.flash_as_sdpa, self.unknown_model)


#: Checkpoints published already quantized by a method memfit has no weight layout for, named so by convention
#: (``TechxGenus/Meta-Llama-3-8B-Instruct-GPTQ``, ``...-AWQ``, ``ISTA-DASLab/...-AQLM-2Bit-1x16``,
#: ``nvidia/Gemma-4-26B-A4B-NVFP4``, ``Qwen/Qwen3-8B-FP8``): their config.json
#: carries the ``quantization_config`` that transformers loads them with.
_PREQUANTIZED = re.compile(r"(?<![a-z])(gptq|awq|aqlm|hqq|eetq|exl2|nvfp4|mxfp4|fp8)(?![a-z0-9])")


def model_name(keys: Keys, key: str) -> str | None:
    """The base model a file names under ``key``: a preset whose ``source`` has the same repository name (so a
    known model is read offline, mirrors such as ``NousResearch/Llama-3.2-1B`` included), else the value as
    it is (a local folder or a Hub id, read by ``load_spec``)."""
    value = keys.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise keys.error(key, f"{value!r} is not a model name or path.")

    if is_preset(value):
        return value.lower()
    quantized = _PREQUANTIZED.search(value.lower().rsplit("/", 1)[-1])
    if quantized:
        raise keys.error(key, f"{value} names a checkpoint quantized with {quantized.group(1).upper()}, whose packed weights "
                         "memfit does not price (it prices bitsandbytes' 4-bit and 8-bit bases).")
    name = _base_name(value)
    if "/" in value and not user_path(value).exists():
        for preset, entry in load_presets().items():
            if _base_name(str(entry.get("source", ""))) == name:
                if entry["source"].lower() != value.lower():
                    keys.price(f"{key} {value} read as the preset {preset} (the architecture of "
                               f"{entry['source']}; no download).")
                return preset
    return value


def _base_name(repo_id: str) -> str:
    """A Hub repository's model name without the variant suffix that keeps the architecture (an instruct or chat
    tune, ``-hf`` conversions) and Meta's prefix: ``meta-llama/Meta-Llama-3-8B-Instruct`` -> ``llama-3-8b``."""
    name = repo_id.rstrip("/").split("/")[-1].lower()
    for suffix in ("-instruct", "-chat", "-it", "-hf"):
        name = name.removesuffix(suffix)
    return name.removeprefix("meta-")  # NousResearch/Meta-Llama-3.1-8B is meta-llama/Llama-3.1-8B


def check_model(reading: Reading, trust_remote_code: bool = False):
    """The reading's ``ModelSpec``; an unknown model is one sentence naming the file and the key."""

    if reading.unknown_model:
        raise UserError(reading.unknown_model)
    if reading.model is None:
        raise UserError(f"{reading.path} names no base model ({reading.model_key}); give MODEL too.")
    try:
        return load_spec(reading.model, trust_remote_code)
    except UserError as err:
        raise UserError(f"{reading.path}, {reading.model_key}: {err}") from None


def precision(keys: Keys, bf16_key: str = "bf16", fp16_key: str = "fp16", *, bf16_default: Any = False,
              extra: tuple = ()) -> str:
    """Accelerate's ``mixed_precision`` from a pair of bf16/fp16 switches (Trainer's and its followers')."""
    bf16 = keys.bool(bf16_key, bf16_default, extra=extra)
    fp16 = keys.bool(fp16_key, False, extra=extra)
    if bf16 is True and fp16 is True:
        raise keys.error(fp16_key, f"true together with {bf16_key}: true; a run uses one of them.")
    return "bf16" if bf16 is True or bf16 == "auto" else "fp16" if fp16 is True else "no"


def lora_targets(keys: Keys, key: str, default: tuple[str, ...] = ("all-linear",)) -> tuple[str, ...]:
    """LoRA target modules: a list, a comma-separated string, ``all`` / ``all-linear``."""
    value = keys.get(key)
    if value is None:
        return default
    keys.origin(key, "lora_targets")
    if isinstance(value, str) and re.search(r"[\\\[\](){}|*+?]", value):
        return _regex_targets(keys, key, value)
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise keys.error(key, f"{value!r} is not a list of module names.")
    if [v.lower() for v in value] in (["all"], ["all-linear"], ["all_linear"]):
        return ("all-linear",)
    return tuple(value)


def _regex_targets(keys: Keys, key: str, pattern: str) -> tuple[str, ...]:
    """A string ``target_modules`` is a regular expression PEFT matches against whole module paths
    (``peft/tuners/tuners_utils.py``, ``check_target_module_exists``: ``re.fullmatch``): the projections it names,
    ``(up|down|gate)_proj`` spelled out, are the modules adapted (its path part keeps them to the decoder)."""
    names: list[str] = []
    for group, suffix in re.findall(r"\(([\w|]+)\)(_proj\w*)", pattern):
        names += [f"{word}{suffix}" for word in group.split("|")]
    names += re.findall(r"(?<!\w)([a-z][a-z0-9_]*_proj\w*)", pattern)
    names = list(dict.fromkeys(names))
    if not names:
        raise keys.error(key, f"{pattern!r} is a regular expression naming no projection (..._proj) memfit can price "
                         "adapters on; give --lora-targets.")
    keys.price(f"{key} is a regular expression PEFT matches against module paths; priced as adapters on the "
               f"projections it names: {', '.join(names)}.")
    return tuple(names)


#: A launch command in a config's comments (torchtune's examples start with ``tune run --nproc_per_node 8 ...``;
#: ``accelerate launch --num_processes 8``, ``torchrun --nproc-per-node 8``).
_LAUNCH = r"^\s*#.*(?:--nproc[_-]per[_-]node|--num[_-]processes|NPROC_PER_NODE)[ =]+([0-9]+)"


def stated_processes(path: str) -> int | None:
    """The process count a launch command in the file's comments gives (one such count only), else None."""

    try:
        text = user_path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    counts = {int(n) for n in re.findall(_LAUNCH, text, flags=re.MULTILINE)}
    return counts.pop() if len(counts) == 1 and min(counts) >= 1 else None


def comment_words(path: str) -> set[str]:
    """The words of the file's comments (a launch command there names the recipe or trainer it runs:
    ``tune run full_dpo_distributed``, ``trl dpo``), lower case."""

    try:
        text = user_path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return set()
    comments = " ".join(line.split("#", 1)[1] for line in text.splitlines() if line.lstrip().startswith("#"))
    return set(re.findall(r"[a-z0-9_.]+", comments.lower()))


#: memfit's preference methods (``--method``) and what each needs of the reference policy.
PREFERENCE = ("dpo", "orpo", "simpo")


def preference(keys: Keys, run: dict[str, Any], method: str, key: str, precompute: bool = False) -> None:
    """Make ``run`` (a reader's settings) memfit's ``method`` run, as memfit prices its own preference runs
    (``memory.preference_terms``): B pairs per micro-batch in one (2B, T) forward, the loss read from the full
    logits, and for DPO a reference policy (a frozen copy of a full fine-tune's base, the LoRA base with the
    adapter off, or log-probabilities precomputed before training). ``key``: the file's key that says so."""
    run["method"] = method
    keys.origin(key, "method")
    loss = run.get("loss", "standard")
    if loss != "standard":
        keys.price(f"{key}: {method} reads each sequence's log-probabilities from the full logits, so the {loss} "
                   "loss the file sets for next-token training is not what runs; priced with the standard loss.")
    run["loss"] = "standard"
    if run.get("packing", "none") != "none":
        keys.price(f"{key}: {method} pairs are padded to the longest sequence, not packed; priced unpacked at the "
                   "full length (the upper bound).")
    run["packing"] = "none"
    lora = bool(run.get("lora_r"))
    if method == "dpo":
        run["precompute_reference"] = bool(precompute)
        policy = ("log-probabilities precomputed before training" if precompute else
                  "the base with the LoRA adapter switched off" if lora else "a frozen copy of the base model")
        keys.price(f"{key}: {method}, B pairs per micro-batch in one forward of 2B sequences; reference policy: "
                   f"{policy}; priced as memfit's --method dpo.")
    else:
        keys.price(f"{key}: {method}, B pairs per micro-batch in one forward of 2B sequences, no reference model; "
                   f"priced as memfit's --method {method}.")


def processes_sentence(run: RunConfig, engine: str, fsdp_version: int = 2) -> str:
    """What the per-rank figures assume about the process count, which none of these files states (the launcher
    does: ``accelerate launch``, ``torchrun``, ``tune run --nproc_per_node``); ``fsdp_version``: the stack's."""
    n = run.num_processes
    if n > 1:
        sharder = "DeepSpeed" if engine == "deepspeed" else "FSDP (1)" if fsdp_version == 1 else "FSDP2"
        how = {"ddp": "replicated (DDP)"}.get(str(run.sharding), f"sharded by {sharder}")
        return (f"processes: the file does not say how many processes the launch starts; priced per rank on "
                f"{n} (--num-processes), {how}.")
    return ("processes: the file does not say how many processes the launch starts; priced on 1 (nothing sharded "
            "or reduced across ranks); --num-processes N gives the per-rank figure of an N-process launch.")


#: transformers' ``TrainingArguments.optim`` names memfit prices exactly (Trainer, TRL, Axolotl and LLaMA-Factory
#: pass them on): torch's AdamW (``adamw_torch``: foreach on CUDA, as memfit's ``adamw``), its fused kernel,
#: bitsandbytes' 8-bit AdamW (paged or not: paging moves the state to host memory only under pressure), SGD and
#: Adafactor.
TRAINER_OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw-fused", "adamw_apex_fused": "adamw-fused",
    "adamw_bnb_8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit", "paged_adamw_8bit": "adamw-8bit",
    "paged_adamw_32bit": "adamw", "adafactor": "adafactor", "sgd": "sgd",
    "adamw_torch_8bit": "adamw-8bit",
}
#: torchao's ``AdamW8bit`` (transformers' ``adamw_torch_8bit``, Axolotl's ``ao_adamw_8bit``): 8-bit states with a
#: scale per block of 256 values, tensors under 4,096 values kept in 32 bits "to follow bitsandbytes"
#: (pytorch/ao ``torchao/optim/adam.py`` L71-76, L309-320 at 36027d82d1): the bytes of bitsandbytes' 8-bit AdamW.
TORCHAO_8BIT = ("adamw_torch_8bit", "ao_adamw_8bit")


def trainer_optimizer(keys: Keys, key: str, default: str, known: tuple[str, ...] = (),
                      own: dict[str, str] | None = None) -> str:
    """memfit's optimizer for a Trainer ``optim`` name (or one of the tool's own, ``own``: name -> memfit's). A name
    transformers (or the tool: ``known``) accepts but memfit has no row for is priced as AdamW with a sentence; any
    other name is an invalid value."""
    from transformers.training_args import OptimizerNames  # see the note at the top of this module


    value = str(keys.get(key, default)).lower()
    table = {**TRAINER_OPTIMIZERS, **(own or {})}
    if value in table:
        if value.startswith("paged_"):
            keys.price(f"{key} {value}: bitsandbytes pages the state to host memory only when the GPU runs out; "
                       "priced resident on the GPU.")
        if value in TORCHAO_8BIT:
            keys.price(f"{key} {value}: torchao's AdamW8bit (8-bit states, a scale per 256 values, tensors under "
                       "4,096 values in 32 bits) priced as bitsandbytes' 8-bit AdamW, which keeps the same bytes.")
        return table[value]
    if value in {o.value for o in OptimizerNames} or value in known:
        keys.not_mapped(key, f"{value} has no row in memfit's optimizer table; priced as AdamW (two fp32 moments "
                        "per trained parameter), so the optimizer state may be over- or under-stated.")
        return "adamw"
    raise keys.error(key, f"{value!r} is not an optimizer name transformers' Trainer knows (adamw_torch_fused, "
                     "adamw_torch, adamw_8bit, paged_adamw_8bit, adafactor, sgd, ...).")


def flash_attention(keys: Keys, key: str) -> str:
    """``flash_attention_2`` where the flash-attn package is installed here, else SDPA with a sentence: memfit
    refuses to price flash-attn without it, and SDPA's CUDA flash backend saves the same tensors (the output and
    its log-sum-exp per head), so the number is the same to within the kernel's workspace."""

    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    keys.flash_as_sdpa = key
    keys.price(f"{key}: flash-attention is priced as SDPA (flash-attn is not installed here; SDPA's CUDA flash "
               "backend saves the same tensors).")
    return "sdpa"


def checkpointing_kwargs(keys: Keys) -> None:
    """``gradient_checkpointing_kwargs.use_reentrant`` (TRL/Trainer, Axolotl), where a file says it, on the stack: reentrant
    checkpointing keeps a quantized base's ``ctx`` tensors for one recomputed layer only (``Stack.checkpoints_reentrant``)."""
    kwargs = keys.data.get("gradient_checkpointing_kwargs") or {}
    if isinstance(kwargs, dict) and isinstance(kwargs.get("use_reentrant"), bool):
        keys.stack["reentrant_checkpointing"] = kwargs["use_reentrant"]
    if isinstance(kwargs, dict) and kwargs.get("use_reentrant") is True:
        keys.price("gradient_checkpointing_kwargs use_reentrant: true: torch's reentrant checkpointing, priced "
                   "(a quantized base keeps bitsandbytes' saved inputs for one recomputed layer, not every layer).")

"""Activation recipes derived from traces, for architectures without a hand-written recipe.

The analytic estimator (``memory/estimate.py``) models four families op by op (``memory/activations.py``).
Any other decoder transformers can build as a causal LM gets a recipe *derived* here from its real
modeling code: a 2-layer version of the architecture (the real hidden size, heads, vocabulary and
settings; a model with several layer kinds: its first layer and one layer of each other kind,
``memory/layer_plan.py``) is traced on fake tensors (``memory/trace.py``, one step, CPU kernels) at five batch x sequence
points (B, T) in {2, 3} x {40, 80, 160}. The same operators run at every size, so the bytes after
operator ``i`` are fitted exactly, category by category, as

    bytes_i(B, T) = c0 + c1 T + c2 T^2 + c3 B T + c4 B T^2

(constants: weight copies and gradients; T: RoPE tables; T^2: a causal mask broadcast over the batch;
B T: per-token tensors; B T^2: attention scores). The estimate predicts the whole step at the run's B
and T, picks the moments the hand-written estimate combines (the forward peak, the start of backward
with the logits' gradients, one layer into backward, the end of backward) on the N-layer timeline:
until backward reaches the first layer, N - 2 more layers hold what one layer keeps from its forward (the
second layer's bytes, read between its forward hooks: under LoRA the first layer differs; less what it
only returns, attention weights the decoder drops when the next layer returns, and its output where the
layer before dropped its own: only the final norm keeps the last layer's); from then on
they hold their weight gradients instead (the second layer's, read between the starts of the second and
the first layer's backward). Each further layer is priced by the traced layer of its own kind. Bytes while a middle layer runs its backward lie between those two, which
is why a 2-layer trace suffices.
Weights, gradients, optimizer state and the optimizer phase stay analytic (parameter counts only).
Fake tensors cost the same at any width, so the five traces take seconds.

Known error: exact where the basis spans what the code allocates (held to the exact trace within 3% on
every family of ``tests/test_estimate_accuracy.py``; lfm2's two kinds +1.6% at seq 2048). Refused, in one
sentence naming the layer kind, where a kind's operators change with the size (jamba's mamba layers loop
over the positions without the mamba kernels) or first appear beyond 8 layers. Wrong where a sliding window sits between the
traced lengths and the run's (the traced lengths are put on the run's side of the window). For
``device="cuda"`` it traces the CUDA substitutions ``--exact`` makes (docs/exact.md), with their known error.
Held with the hand-written recipes to ``--exact`` by ``tests/test_recipe_paths.py`` (every setting, 1%).

Recipes are cached on disk per (config without its depth, the run settings that change activations,
torch and transformers versions), in ``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit/recipes``
(``~/.cache/memfit/recipes``), and in memory.

Size: over 500 lines, with ``derived_estimate`` over 60, because deriving a recipe is one procedure (trace two depths, difference them, cache the
result under a key that names everything it depends on) whose steps share private helpers; split, each part
would import the others' internals.
"""

# Inside functions: torch (2.6 s), transformers and memory.trace (5.5 s; python -X importtime, 2026-12-06, this shared 2-core machine): the CLI imports this module
# for its progress lines (cli.invoke), and an analytic estimate runs without them.
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from memfit.errors import UserError
from memfit.files import user_path, write_atomic
from memfit.integrations import versions
from memfit.memory import layer_plan
from memfit.memory import preference_terms as pref
from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.device_terms import with_fitted_reserved
from memfit.memory.notes import notes
from memfit.memory.states import model_states
from memfit.settings.config import (
    Attention,
    DType,
    Offload,
    Optimizer,
    Precision,
    Quantize,
    RunConfig,
    Sharding,
)
from memfit.spec.engines import shard_group_size
from memfit.spec.model import layer_kinds, spec_from_config

#: Bumped when the fit or what it measures changes: older cache files are then ignored.
RECIPE_VERSION = 6

COMPONENTS = ("gradients", "activations", "logits", "temporary")
MOMENTS = ("forward", "backward_start", "backward_layer", "backward_end")

#: (micro-batch, sequence multiple) of the five traces: as many as ``_basis`` has unknowns. Batches 2
#: and 3, not 1: with one sequence some transposes are already contiguous and transformers' code skips
#: copies (and operators), so a batch of 1 is not on the same curve; for runs with micro-batch 1 the
#: recipe may count a few such copies too many (an over-estimate).
_POINTS = ((2, 1), (2, 2), (2, 4), (3, 1), (3, 2))

#: Base sequence length of the traces (40, 80, 160 tokens): short (a trace's cost does not depend on
#: it) and unlike any hidden size, so B*T never equals a model dimension the tracer keys on.
_BASE_T = 40


def _basis(b: int, t: int) -> list[float]:
    """Bytes of every tensor of a step are a sum of these: constants (weight copies, gradients), T (RoPE
    tables), T^2 (a causal mask broadcast over the batch), B*T (per-token tensors), B*T^2 (scores)."""
    return [1.0, float(t), float(t * t), float(b * t), float(b * t * t)]


@dataclass
class DerivedRecipe:
    """The traced timelines of a 2-layer model at ``points`` (B, T), and what is fitted from them.

    Every operator of a step runs at every size (checked when tracing), so sample ``i`` of one timeline
    is the same moment as sample ``i`` of another: each sample's bytes are fitted exactly in ``_basis``
    and the whole timeline is predicted at the run's B and T, where its moments are then picked.
    """

    model_type: str
    key: str
    points: list[tuple[int, int]]
    timelines: list[list[list[int]]]
    """Per point, per sample: bytes of each of ``COMPONENTS``."""
    phase_runs: list[tuple[str, int]]
    kinds: list[str]
    """The kind of each traced layer (``memory/layer_plan.py``); the lists below hold one entry per kind
    after the first layer (``layer_kinds``)."""
    layer_spans: list[tuple[int, int]]
    """Per kind: sample indices before and at the end of its traced layer's forward (one layer's bytes)."""
    grad_spans: list[tuple[int, int]]
    """Per kind: sample indices before its traced layer's backward and before the layer below's (its gradients)."""
    split: int
    """Sample index before the first layer's backward: from there on, layers above hold their gradients."""
    derive_seconds: float
    returned: list[list[list[int]]] = field(default_factory=list)
    """Per kind, per point: bytes of each of ``COMPONENTS`` its traced layer only returned (``Timeline.returned``):
    alive at its forward's end, gone when the next layer's output replaces them, so not one layer's bytes."""
    forward_only: list[list[list[int]]] = field(default_factory=list)
    """Per kind, per point: bytes of each of ``COMPONENTS`` its traced layer left alive through the forward only
    (``Timeline.forward_only``: autocast's cached weight copies of a checkpointed layer): held by each further
    layer in forward, not in backward."""
    from_cache: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        import numpy as np

        a = np.array([_basis(b, t) for b, t in self.points])
        scale = np.abs(a).max(axis=0)
        y = np.array(self.timelines, dtype=float)  # (points, samples, components)
        coef = np.linalg.solve(a / scale, y.reshape(len(self.points), -1)) / scale[:, None]
        self._coef = coef.reshape((a.shape[1],) + y.shape[1:])
        self._phases = np.array([p for p, n in self.phase_runs for _ in range(n)])  # once: ~1 ms per estimate
        grads = COMPONENTS.index("gradients")
        self._layer_coef, self._grad_coef, self._forward_only_coef = {}, {}, {}

        def fitted(per_point) -> np.ndarray:  # (points, components) bytes -> (basis, components) coefficients
            return np.linalg.solve(a / scale, np.array(per_point, dtype=float)) / scale[:, None]

        for k, kind in enumerate(self.layer_kinds):
            first, last = self.layer_spans[k]
            layer = self._coef[:, last] - self._coef[:, first]  # (basis, components)
            if self.returned:  # attention weights a layer returns, kept by no layer: one alive at a time
                layer = layer - fitted(self.returned[k])
            top, bottom = self.grad_spans[k]
            grad = np.zeros_like(layer)
            grad[:, grads] = self._coef[:, bottom, grads] - self._coef[:, top, grads]
            self._layer_coef[kind], self._grad_coef[kind] = layer, grad
            self._forward_only_coef[kind] = fitted(self.forward_only[k]) if self.forward_only else np.zeros_like(layer)

    @property
    def label(self) -> str:
        if len(self.kinds) == 2:
            return f"derived from traces of 1-2 layer {self.model_type}"
        return f"derived from traces of {len(self.kinds)} layers of {self.model_type} ({len(self.layer_kinds)} kinds)"

    @property
    def layer_kinds(self) -> list[str]:
        """The kinds of the traced layers after the first, each once, in order (``layer_spans``' order)."""
        return list(dict.fromkeys(self.kinds[1:]))

    def timeline_at(self, batch: int, seq: int):
        """Predicted bytes (samples x components) of the traced model's step at ``batch`` x ``seq``."""
        import numpy as np

        return np.tensordot(np.array(_basis(batch, seq)), self._coef, axes=1)

    def timeline_of(self, extra: dict[str, int], batch: int, seq: int, logits_share: float = 1.0):
        """Predicted bytes (samples x components) of the step of a model with ``extra[kind]`` layers of each
        kind more than traced (``layer_plan.extra_layers``), sample by sample of the traced step: each holds
        what its kind's traced layer keeps from its forward until backward reaches the first layer, and its
        weight gradients from then on (the end of backward included: there the estimate counts all
        gradients anyway). ``logits_share``: the run's chunk of a chunked loss over its tokens (the traces
        ran one chunk per micro-batch, ``losses.one_chunk_per_micro_batch``: their chunk-sized tensors are
        the logits)."""
        import numpy as np

        basis = np.array(_basis(batch, seq))
        pred = self.timeline_at(batch, seq)
        zero = np.zeros(len(COMPONENTS))
        held = sum((n * (basis @ self._layer_coef[k]) for k, n in extra.items()), zero)
        grads = sum((n * (basis @ self._grad_coef[k]) for k, n in extra.items()), zero)
        forward_only = sum((n * (basis @ self._forward_only_coef[k]) for k, n in extra.items()), zero)
        more = np.repeat(held[None, :], len(pred), axis=0)
        more[self._phases[:len(pred)] != "forward"] -= forward_only  # freed when the forward ended (autocast's cache)
        more[self.split + 1:] = grads
        pred = pred + more
        pred[:, COMPONENTS.index("logits")] *= logits_share
        return pred

    def at(self, extra: dict[str, int], batch: int, seq: int, accumulating: bool = False,
           logits_share: float = 1.0) -> dict[str, dict[str, int]]:
        """Bytes of each component at each of ``MOMENTS`` with ``extra`` layers (``timeline_of``);
        ``accumulating``: all gradients exist throughout backward, so moments are picked without them."""
        pred = self.timeline_of(extra, batch, seq, logits_share)
        out = {}
        for m, i in pick_moments(pred, self._phases, accumulating).items():
            out[m] = {c: max(0, int(round(float(pred[i][k])))) for k, c in enumerate(COMPONENTS)}
        return out

    def per_layer(self, component: str, batch: int, seq: int, kind: str | None = None) -> int:
        """Bytes of ``component`` one (non-first) decoder layer of ``kind`` (default: the first traced kind)
        keeps from its forward to its backward."""
        import numpy as np

        layer = np.array(_basis(batch, seq)) @ self._layer_coef[kind if kind in self._layer_coef else self.kinds[1]]
        return max(0, int(round(float(layer[COMPONENTS.index(component)]))))

    def to_json(self) -> dict:
        return {"version": RECIPE_VERSION, "model_type": self.model_type, "key": self.key,
                "points": self.points, "timelines": self.timelines, "phase_runs": self.phase_runs,
                "kinds": self.kinds, "layer_spans": self.layer_spans, "grad_spans": self.grad_spans,
                "split": self.split, "derive_seconds": self.derive_seconds, "returned": self.returned,
                "forward_only": self.forward_only}

    @classmethod
    def from_json(cls, data: dict) -> DerivedRecipe:
        return cls(data["model_type"], data["key"], [tuple(p) for p in data["points"]], data["timelines"],
                   [tuple(r) for r in data["phase_runs"]], list(data["kinds"]),
                   [tuple(x) for x in data["layer_spans"]], [tuple(x) for x in data["grad_spans"]],
                   int(data["split"]), float(data["derive_seconds"]), data["returned"], data["forward_only"],
                   from_cache=True)


def pick_moments(pred, phases, accumulating: bool = False) -> dict[str, int]:
    """Sample index of each of ``MOMENTS`` in a (samples x components) timeline of one step.

    ``forward``: the forward sample with the largest total. ``backward_start``: the largest total while
    logits (or their gradients) are alive in backward. ``backward_layer``: after that, the largest
    total (``accumulating``: the most non-gradient bytes, since all gradients are counted then).
    ``backward_end``: the last backward sample.
    """
    import numpy as np

    total = pred.sum(axis=1)
    no_grads = total - pred[:, COMPONENTS.index("gradients")]
    ranked = no_grads if accumulating else total
    kind = np.asarray(phases)
    fwd = np.flatnonzero(kind == "forward")
    bwd = np.flatnonzero(kind == "backward")
    with_logits = bwd[pred[bwd, COMPONENTS.index("logits")] > 0.5]
    split = with_logits[-1] if len(with_logits) else bwd[0]
    start, layer = bwd[bwd <= split], bwd[bwd > split]
    if not len(layer):
        layer = start
    return {
        "forward": int(fwd[np.argmax(total[fwd])]),
        "backward_start": int(start[np.argmax(total[start])]),
        "backward_layer": int(layer[np.argmax(ranked[layer])]),
        "backward_end": int(bwd[-1]),
    }


# ------------------------------------------------------------------------------------------------
# which recipe a run gets
# ------------------------------------------------------------------------------------------------
def hand_written_family(spec, run: RunConfig, device: str = "cuda") -> str | None:
    """The hand-written recipe that models ``spec`` under ``run``, or None when it must be derived.

    None for families without one (``modelspec.FAMILIES``: generic, gemma); for a sliding window
    shorter than the sequence under SDPA (Mistral, Qwen2 with ``use_sliding_window``): transformers then
    passes a mask, CPU SDPA takes its math path and keeps (B, n, T, T) scores the Llama recipe lacks;
    for GPT-2 with attention dropout and checkpointing on CPU kernels, whose recomputed math-path
    attention's gradients the GPT-2 recipe's backward transient lacks (8% under on the accuracy grid);
    and for eager attention with checkpointing (Gemma 2 always): the peaks move into a layer, the
    forward's to the no-grad pass's (B, n, T, T) scores, the backward's to the recomputed attention's
    backward with the scores' gradients, which the hand-written transients (an MLP-backward moment) lack:
    Llama GQA T 512 B 2 was 34% under, Gemma 2 9-10%; derived: within 0.4%.
    """
    from memfit.memory.activations import RECIPES

    if spec.family not in RECIPES:
        return None
    dropout = float(getattr(spec.hf_config, "attn_pdrop", 0.0) or 0.0)
    if spec.family == "gpt2" and device == "cpu" and dropout > 0 and run.grad_checkpointing:
        return None
    eager = run.attn_implementation is Attention.EAGER or spec.family == "gemma2"
    if eager and run.grad_checkpointing:
        return None
    if spec.sliding_window and run.seq_len > spec.sliding_window and not eager:
        return None
    return spec.family


def recipe_settings(spec, run: RunConfig) -> RunConfig:
    """The run settings a derivation traces: what changes activations, nothing else.

    Batch, sequence, accumulation, optimizer, processes and sharding are not part of it (the fit covers B
    and T; model states are analytic). Two techniques are: ``--offload activations`` (the layers keep their
    saved tensors on the host: traced with ``save_on_cpu``'s fake-tensor twin, ``memory/offload_trace.py``)
    and ``--optimizer-in-backward`` (each gradient is stepped and freed as it lands, so the traced
    timeline's gradients and step temporaries are the run's; the other offloads are analytic). QLoRA is traced as LoRA on a bf16 base
    (bitsandbytes cannot run on fake tensors; it computes in bf16, as a bf16 base does).
    """
    settings = RunConfig(
        seq_len=1, micro_batch=1, mixed_precision=run.mixed_precision, dtype=run.dtype,
        grad_checkpointing=run.grad_checkpointing, lora=run.lora, optimizer=Optimizer.ADAMW,
        attn_implementation=run.attn_implementation, experts_implementation=run.experts_implementation,
        packing=run.packing, loss=run.loss, optimizer_in_backward=run.optimizer_in_backward,
        offload=run.offload if run.offload is Offload.ACTIVATIONS else Offload.NONE,
        method=run.method, precompute_reference=run.precompute_reference)
    if run.quantize is not Quantize.NONE:
        settings = settings.replace(dtype=DType.BF16, mixed_precision=Precision.NO)
    return settings


def _beyond_window(spec, run: RunConfig) -> bool:
    return bool(spec.sliding_window) and run.seq_len > spec.sliding_window


def _sequence_lengths(spec, run: RunConfig) -> tuple[int, int, int]:
    """Three trace lengths a, 2a, 4a in the run's regime: beyond the sliding window when the run is,
    within it when the run is."""
    start, base = 0, _BASE_T
    limit = spec.max_position_embeddings or 0
    if _beyond_window(spec, run):
        start = spec.sliding_window
    elif spec.sliding_window:
        limit = min(limit, spec.sliding_window) if limit else spec.sliding_window
    if limit and start + 4 * base > limit:
        base = max(1, (limit - start) // 4)
    return start + base, start + 2 * base, start + 4 * base


_IGNORED_CONFIG_KEYS = {"num_hidden_layers", "n_layer", "layer_types", "_name_or_path", "transformers_version",
                        "architectures", "dtype", "torch_dtype", "_commit_hash"}


_KEYS: dict[tuple, tuple[object, str]] = {}


def recipe_key(spec, run: RunConfig, device: str = "cpu") -> str:
    """Hash of what a derived recipe depends on: the config but its depth, the recipe settings, the target
    device (its kernels are traced), versions.

    Memoised per config object and settings (the planner asks thousands of times; hashing takes ~1 ms).
    """
    memo = (id(spec.hf_config), recipe_settings(spec, run), _beyond_window(spec, run), device)
    hit = _KEYS.get(memo)
    if hit is not None and hit[0] is spec.hf_config:
        return hit[1]
    key = _recipe_key(spec, run, device)
    _KEYS[memo] = (spec.hf_config, key)
    return key


def _recipe_key(spec, run: RunConfig, device: str) -> str:
    import torch
    import transformers

    config = {k: v for k, v in spec.hf_config.to_dict().items() if k not in _IGNORED_CONFIG_KEYS}
    # ``nodes`` never reaches a trace (recipe_settings leaves it at 1): left out, so recipes cached before it existed serve
    settings = {k: v for k, v in recipe_settings(spec, run).to_flat().items() if k != "nodes"}
    payload = {"config": config, "settings": settings,
               "beyond_window": _beyond_window(spec, run), "version": RECIPE_VERSION, "device": device,
               "traced": layer_plan.plan(spec).kinds,
               "torch": torch.__version__, "transformers": transformers.__version__}
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_dir() -> Path:
    """``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit/recipes``, else ``~/.cache/memfit/recipes``."""
    if os.environ.get("MEMFIT_CACHE_DIR"):
        return user_path(os.environ["MEMFIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return user_path(base) / "memfit" / "recipes"


_MEMORY: dict[str, DerivedRecipe] = {}


class RecipeNotCached(Exception):
    """Raised inside ``cached_only()`` where an estimate needs a recipe that would have to be traced now."""


_POLICY = {"cached_only": False, "listeners": []}


@contextlib.contextmanager
def cached_only() -> Iterator[None]:
    """Inside, ``derived_recipe`` raises ``RecipeNotCached`` instead of tracing: the planner prices every
    candidate whose recipe exists first, then derives only for those that can still be the fastest plan."""
    was = _POLICY["cached_only"]
    _POLICY["cached_only"] = True
    try:
        yield
    finally:
        _POLICY["cached_only"] = was


@contextlib.contextmanager
def progress(listener: Callable[[str], None]) -> Iterator[None]:
    """Inside, ``listener`` gets one line before each derivation (the CLI prints it: a derivation takes seconds)."""
    _POLICY["listeners"].append(listener)
    try:
        yield
    finally:
        _POLICY["listeners"].remove(listener)


def derivation_line(spec, run: RunConfig, device: str) -> str:
    """What is being derived, in one line: the model type and the settings that change its activations."""
    default = RunConfig(seq_len=1, micro_batch=1).to_flat()
    changed = [f"{k} {v}" if not isinstance(v, bool) else k
               for k, v in recipe_settings(spec, run).to_flat().items() if v != default.get(k) and v is not False]
    what = ", ".join(changed) or "default settings"
    return (f"deriving a memory recipe for {spec.model_type} ({what}; {device} kernels) from traces of its code: "
            f"once, then cached in {cache_dir()}")


def derived_recipe(spec, run: RunConfig, device: str = "cpu") -> DerivedRecipe:
    """The derived recipe for ``spec`` under ``run`` on ``device``: from memory, the disk cache, or traced now
    (``RecipeNotCached`` inside ``cached_only()``)."""
    key = recipe_key(spec, run, device)
    if key in _MEMORY:
        return _MEMORY[key]
    path = cache_dir() / f"{spec.model_type}-{key}.json"
    recipe = _load(path, key)
    if recipe is None:
        if _POLICY["cached_only"]:
            raise RecipeNotCached(key)
        for listener in _POLICY["listeners"]:
            listener(derivation_line(spec, run, device))
        recipe = derive(spec, run, key, device)
        _store(path, recipe)
    _MEMORY[key] = recipe
    return recipe


def _load(path: Path, key: str) -> DerivedRecipe | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != RECIPE_VERSION or data.get("key") != key:
        return None
    try:
        return DerivedRecipe.from_json(data)
    except (KeyError, TypeError, ValueError):
        return None


def _store(path: Path, recipe: DerivedRecipe) -> None:
    """Write atomically; a cache that cannot be written only costs the next run a derivation."""

    try:
        write_atomic(path, json.dumps(recipe.to_json(), separators=(",", ":")))
    except UserError:
        pass


# ------------------------------------------------------------------------------------------------
# the derivation
# ------------------------------------------------------------------------------------------------
def _segments(timeline) -> list[tuple[int, int]]:
    """[start, end) sample ranges of a one-step timeline cut at every decoder layer's forward hooks and
    at the ends of forward and backward."""
    forward = timeline.phases.count("forward")
    backward = timeline.phases.count("backward")
    cuts = sorted({0, forward, forward + backward} | {n for _, _, n in timeline.layer_marks})
    return list(zip(cuts, cuts[1:], strict=False))


def _align(lines, model_type: str, kinds: tuple[str, ...]) -> tuple[list[str], dict[str, tuple], int]:
    """Check that every size ran the same operators; the phases, per kind its traced layer's forward span
    and its backward's gradient span (``DerivedRecipe.layer_spans``, ``grad_spans``), and the split.

    Raises ``UserError`` when they differ (the per-operator fit would compare different moments), naming
    the layer kind whose operators differ where one does (jamba's mamba layers without the mamba kernels
    loop over the positions).
    """
    cut = [_segments(line) for line in lines]
    if len({tuple(c) for c in cut}) != 1 or len({len(line.samples) for line in lines}) != 1:
        raise UserError(f"Cannot derive a memory recipe for {model_type}: {_what_differs(lines, kinds)} runs "
                        "different operators at different sequence lengths or batch sizes; use --exact.")
    marks = {(i, when): n for i, when, n in lines[0].layer_marks}
    spans, grads = {}, {}
    for i, kind in enumerate(kinds):
        if i == 0 or kind in spans:
            continue
        if not {(i, "pre"), (i, "post"), (i, "grad"), (i - 1, "grad")} <= set(marks):
            raise UserError(f"Cannot derive a memory recipe for {model_type}: its decoder layers were not found "
                            "(transformers lists none in _no_split_modules); use --exact.")
        spans[kind] = ((marks[(i, "pre")] - 1, marks[(i, "post")] - 1), i)
        grads[kind] = (marks[(i, "grad")] - 1, marks[(i - 1, "grad")] - 1)
    return list(lines[0].phases), {k: (spans[k][0], grads[k], spans[k][1]) for k in spans}, marks[(0, "grad")] - 1


def _what_differs(lines, kinds: tuple[str, ...]) -> str:
    """'its <kind> layer' whose forward ran a different number of operators at two sizes, else 'its step'."""
    def layer_lengths(line):
        marks = {(i, when): n for i, when, n in line.layer_marks}
        return [marks.get((i, "post"), 0) - marks.get((i, "pre"), 0) for i in range(len(kinds))]

    lengths = [layer_lengths(line) for line in lines]
    for i, kind in enumerate(kinds):
        if len({row[i] for row in lengths}) > 1:
            return f"its {kind} layer"
    return "its step"


def derive(spec, run: RunConfig, key: str | None = None, device: str = "cpu") -> DerivedRecipe:
    """Trace the small model of ``layer_plan.plan`` (one layer of each kind) at the five ``_POINTS``, with
    ``device``'s kernels (``"cuda"``: the substitutions ``--exact`` makes, ``trace.cuda_kernels``)."""
    from memfit.memory.trace import trace
    from memfit.spec.losses import one_chunk_per_micro_batch

    started = time.perf_counter()
    settings = recipe_settings(spec, run)
    lengths = _sequence_lengths(spec, run)
    config, kinds = _traced_model(spec)
    settings = _targets_in_traced_model(settings, spec, config)
    points, lines = [], []
    for batch, mult in _POINTS:
        seq = lengths[{1: 0, 2: 1, 4: 2}[mult]]
        try:
            # a chunked loss' chunk count grows with the tokens: one chunk per micro-batch keeps the
            # operators the same at every size (scaled back to the run's chunk in ``derived_estimate``)
            with one_chunk_per_micro_batch():
                _, line = trace(config, settings.replace(seq_len=seq, micro_batch=batch), device=device,
                                timeline=True, steps=1)
        except (RuntimeError, ValueError, TypeError, NotImplementedError, AttributeError, IndexError, KeyError) as err:
            # the model's own code failing on the small copy (a module PEFT cannot wrap, a config field it lacks)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise UserError(f"Cannot derive a memory recipe for {spec.model_type}: tracing its {len(kinds)}-layer "
                            f"version failed ({first}).") from None
        points.append((batch, seq))
        lines.append(line)
        if len(line.samples) != len(lines[0].samples):
            _align(lines, spec.model_type, kinds)  # raises: no need to trace the other sizes
    phases, per_kind, split = _align(lines, spec.model_type, kinds)
    end = phases.count("forward") + phases.count("backward")  # the optimizer step is analytic
    timelines = [[[int(s[c]) for c in COMPONENTS] for s in line.samples[:end]] for line in lines]
    forward_only = [[[line.forward_only.get(at, {}).get(c, 0) for c in COMPONENTS] for line in lines]
                    for _span, _grads, at in per_kind.values()]
    returned = [[[_only_returned(line, kinds, at).get(c, 0) for c in COMPONENTS] for line in lines]
                for _span, _grads, at in per_kind.values()]
    return DerivedRecipe(spec.model_type, key or recipe_key(spec, run, device), points, timelines, _runs(phases[:end]),
                         list(kinds), [v[0] for v in per_kind.values()], [v[1] for v in per_kind.values()], split,
                         round(time.perf_counter() - started, 2), returned, forward_only)


def _only_returned(line, kinds, at: int) -> dict[str, int]:
    """Bytes by category the traced layer ``at`` leaves alive that a layer further down would not keep: what it
    only returned (``Timeline.returned``) and, where the layer before it (of its kind) dropped its own output
    in forward, its output, which only the final norm keeps (``Timeline.dropped_outputs``). Without this,
    OLMo 2 LoRA + AMP counted one fp32 hidden state per extra layer: +1.0% of the step's peak."""
    returned = dict(line.returned.get(at, {}))
    before = line.dropped_outputs.get(at - 1) if at > 0 and kinds[at - 1] == kinds[at] else None
    if before and at not in line.dropped_outputs:
        for category, size in before.items():
            returned[category] = returned.get(category, 0) + size
    return returned


#: The first numeric component inside a module name: the decoder layer's index (``model.layers.10.self_attn``,
#: ``transformer.h.3.attn``); an expert's index further down stays, and a trailing one (``altup_projections.0``)
#: is no layer's.
_LAYER_INDEX = re.compile(r"\.\d+\.")


def _targets_in_traced_model(settings: RunConfig, spec, traced_config) -> RunConfig:
    """``settings`` with LoRA targets the traced copy has. Where PEFT's suffix rule with the last name components
    would select other modules too, the run names its targets in full (``spec.resolved``: gpt2's ``attn.c_proj``
    beside ``mlp.c_proj``; gemma3n's ``altup_projections.0``), and a full name of layer 10 is in no 2-layer copy: each
    becomes the traced copy's projections of the same name in every layer (layers of a kind are wrapped alike, which
    is what the derived recipe extrapolates)."""
    targets = tuple(settings.lora.targets)
    if not settings.lora.r or not any(_LAYER_INDEX.search(t) for t in targets):
        return settings
    wanted = {_LAYER_INDEX.sub(".#.", t, count=1) for t in targets}
    traced = spec_from_config(traced_config, spec.name)
    names = tuple(sorted(name for name, _, _ in traced.linear_modules
                         if _LAYER_INDEX.sub(".#.", name, count=1) in wanted))
    return settings.replace(lora_targets=names) if names else settings


def _traced_model(spec):
    """The config of the model ``derive`` traces and its layers' kinds: ``layer_plan.plan``, by the
    config's ``layer_types`` where the model built from them has the planned kinds, else its first layers."""
    import torch
    from transformers import AutoModelForCausalLM

    chosen = layer_plan.plan(spec)
    config = layer_plan.small_config(spec.hf_config, chosen)
    if chosen.layer_types is not None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        if layer_kinds(model, config) != chosen.kinds:  # layer_types do not decide the kinds alone
            chosen = layer_plan.plan(spec, by_layer_types=False)
            config = layer_plan.small_config(spec.hf_config, chosen)
    return config, chosen.kinds


def _runs(phases: list[str]) -> list[tuple[str, int]]:
    """``["forward", "forward", "backward"]`` -> ``[("forward", 2), ("backward", 1)]`` (compact on disk)."""
    out: list[tuple[str, int]] = []
    for p in phases:
        if out and out[-1][0] == p:
            out[-1] = (p, out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


# ------------------------------------------------------------------------------------------------
# the estimate from a derived recipe (the same composition as estimate.estimate's hand-written path)
# ------------------------------------------------------------------------------------------------
def derived_estimate(spec, run: RunConfig, device: str, engine: str = "fsdp2",
                     rank: int | None = None, stack=None) -> MemoryBreakdown:
    """``estimate()`` for a model without a hand-written recipe: analytic model states + derived moments.

    Phases: forward = states + forward moment; backward = the largest of backward start, one layer in
    (their gradients are those the traced step held then; with accumulation, all gradients) and backward
    end (all gradients); optimizer = states + the optimizer's step temporaries (analytic, as hand-written).
    """
    traced = run.replace(loss="chunked") if str(run.loss) == "trl" else run  # TRL's head: see _trl_head_delta
    recipe = derived_recipe(spec, traced, device)
    states = model_states(spec, pref.pair_forward_run(run), device, engine, rank, stack)  # as the hand-written path's
    # DPO's frozen copy of the base beside the model's weights (the traces ran the reference forward: its transient)
    states = dataclasses.replace(states, weights=states.weights + pref.reference_copy_bytes(spec, run))
    base = states.weights + states.optimizer  # (DDP: its buckets are the gradients of every moment below)
    # all gradients exist throughout backward under accumulation and under DDP (its resident buckets), so
    # backward's moments are picked by what else is alive (the hand-written recipes' rule, ``estimate``)
    accum = run.grad_accum > 1 or bool(states.buckets)
    at = recipe.at(layer_plan.extra_layers(spec, recipe.kinds), run.micro_batch, run.seq_len, accum,
                   _logits_share(spec, traced))
    if traced is not run:
        at = _trl_head_delta(spec, run, traced, at, device)

    def categories(moment: str) -> dict[str, int]:
        got = dict(at[moment])
        if run.optimizer_in_backward:
            pass  # traced so (``recipe_settings``): each gradient stepped and freed as it landed
        elif accum or moment == "backward_end":
            got["gradients"] = states.gradients
        elif moment == "backward_layer" and sharded:
            # the traced layers above hold full gradients; FSDP2 reduce-scatters each unit's after its
            # backward, so they hold shards (``estimate._layers_below_top``'s rule for the hand-written recipes)
            got["gradients"] = got["gradients"] // shard_group_size(run)
        if states.buckets:
            got["gradients"] = states.buckets  # DDP: every gradient is a view into its resident buckets
        elif states.backward_gradients and moment in ("backward_start", "backward_layer"):
            # DeepSpeed ZeRO-2: its flat partition, whole (off the last rank: one layer in, at the latest)
            got["gradients"] = states.from_backward_start or (states.backward_gradients
                                                              if moment == "backward_layer" else 0)
        got["temporary"] += gathered_at(moment, got["logits"] > 0)
        return got

    def gathered_at(moment: str, logits: bool) -> int:
        """FSDP2's unsharded bytes at ``moment``: the same terms as the hand-written recipes' (``estimate``).
        A forward moment with the logits alive is the loss's, after every layer resharded: the tail only."""
        if moment == "forward":
            tail_only = logits and states.gathered_start is not None
            return states.gathered_start if tail_only else states.forward_gathered
        if moment == "backward_end":
            return states.gathered_end
        if moment == "backward_layer":  # and the reduce-scatter of the layer above, still in flight
            return states.layer_gathered - (spec.num_layers - 1) * states.released_per_layer + states.reducing
        if moment == "backward_start" and states.gathered_start is not None:
            return states.gathered_start
        return states.gathered

    sharded = run.num_processes > 1 and run.sharding is not Sharding.DDP

    candidates = {m: categories(m) for m in MOMENTS}
    in_backward = run.optimizer_in_backward  # stepped in backward: nothing left for the step
    candidates["optimizer"] = {"gradients": states.buckets or (0 if in_backward else states.gradients),
                               "activations": 0, "logits": 0, "temporary": 0 if in_backward else states.step_temporary}
    totals = {m: base + sum(v.values()) for m, v in candidates.items()}
    phase_of = {"forward": "forward", "backward_start": "backward", "backward_layer": "backward",
                "backward_end": "backward", "optimizer": "optimizer"}
    phase_peaks: dict[str, int] = {}
    for m, total in totals.items():
        phase_peaks[phase_of[m]] = max(phase_peaks.get(phase_of[m], 0), total)
    peak = max(totals, key=lambda m: totals[m])
    out = MemoryBreakdown(method="analytic", phase=phase_of[peak], params=spec.params,
                          trainable_params=spec.trainable_params(run), weights=states.weights,
                          optimizer=states.optimizer, **candidates[peak])
    out.phase_peaks = phase_peaks
    kinds = layer_plan.model_kinds(spec)[1:]
    most = max(dict.fromkeys(kinds), key=kinds.count) if kinds else None
    out.activations_per_layer = recipe.per_layer("activations", run.micro_batch, run.seq_len, most)
    out.recipe = recipe.label
    if device == "cuda":
        with_fitted_reserved(out)
    out.notes = notes(spec, run, out)
    if spec.num_experts:
        from memfit.memory.moe import compute_bytes_of, moe_notes

        per_param = (states.weights + states.gradients + states.optimizer) / max(spec.params, 1)
        out.notes += moe_notes(spec, run, per_param, compute_bytes_of(run))
    out.notes.append(derivation_note(spec, run, recipe, device))
    if layer_plan.kinds_note(spec):
        out.notes.append(layer_plan.kinds_note(spec))
    return out


def _trl_head_delta(spec, run: RunConfig, traced: RunConfig, at: dict, device: str) -> dict:
    """``--loss trl`` (TRL's fused LM head, which the tracer does not run): the recipe traced with memfit's chunked
    loss, its ``logits`` at forward's end and backward's start moved by the difference of the two heads' analytic
    terms (``activations.logits_terms``). Known error: that of the two analytic terms."""
    from memfit.memory.activations import Precisions, logits_terms

    prec = Precisions.of(run)
    trl_head, chunked = logits_terms(spec, run, prec, device), logits_terms(spec, traced, prec, device)
    out = {moment: dict(values) for moment, values in at.items()}
    out["forward"]["logits"] += trl_head.forward - chunked.forward
    out["backward_start"]["logits"] += trl_head.backward - chunked.backward
    return out


def _logits_share(spec, run: RunConfig) -> float:
    """The run's chunk over its tokens with a chunked loss (1 with the standard loss): the traces ran one
    chunk per micro-batch (``derive``), whose chunk-sized tensors (``logits``) the run has at this scale.
    Exact for the largest chunk (a shorter last chunk is never the peak)."""
    if str(run.loss) == "standard":
        return 1.0
    from memfit.spec.losses import chunk_tokens

    tokens = run.micro_batch * run.seq_len
    return chunk_tokens(tokens, spec.vocab_size, spec.hidden_size) / tokens


def derivation_note(spec, run: RunConfig, recipe: DerivedRecipe, device: str) -> str:
    how = "cached" if recipe.from_cache else f"derived now in {recipe.derive_seconds:.1f} s"
    if hand_written_family_any(spec) is None:
        why = "no hand-written recipe for this model type"
    elif _beyond_window(spec, run):
        why = f"its sliding window ({spec.sliding_window}) is shorter than the sequence"
    elif run.grad_checkpointing and (run.attn_implementation is Attention.EAGER or spec.family == "gemma2"):
        why = "the hand-written recipe does not model eager attention's peaks inside a checkpointed layer"
    elif hand_written_family(spec, run, device) is not None:  # it models this run: derived for the versions, or asked
        why = ("the installed versions are outside those the hand-written recipes are verified on"
               if versions.unverified() else "asked for: estimate(..., derived=True)")
    else:
        why = "the hand-written recipe does not model this run's CPU attention kernel"
    line = f"recipe: {recipe.label} ({why}; {how})"
    if run.quantize is not Quantize.NONE:
        line += "; QLoRA's activations traced on a bf16 base"
    if device == "cuda":
        line += "; CUDA kernels substituted as --exact does (see docs/exact.md)"
    return line + "."


def hand_written_family_any(spec) -> str | None:
    from memfit.memory.activations import RECIPES

    return spec.family if spec.family in RECIPES else None

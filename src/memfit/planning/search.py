"""``plan()``: the fastest configuration that fits a memory budget, and ``fallbacks()`` for OOM.

Every candidate of ``space.candidates`` is estimated (``memory.estimate``, analytic, ~ms) and timed
(``cost.step_time``). Whether a candidate *fits* is ``planning.fit``'s rule (the predicted reserved memory of
every phase, loading to the last save, plus the CUDA context and NCCL's buffers, with a safety margin, 5% by
default). A mixture-of-experts step is checked
with its worst routing (``Plan.routing_bytes``: the estimate assumes balanced routing). Fitting plans are ranked by tokens/s
(``cost.py``), fastest first, with 8-bit AdamW handicapped by 1% (``PREFERENCE``) so that exact AdamW
wins near-ties; further ties go to the lower peak, then to the candidate order of ``space``.
The effective batch is the same for every plan: ``micro_batch * grad_accum * num_processes == batch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.errors import NothingFitsError, UserError
from memfit.memory import derive
from memfit.memory.breakdown import MemoryBreakdown
from memfit.memory.device_terms import cuda_other
from memfit.memory.moe import routing_margin
from memfit.memory.phases import DevicePhases
from memfit.memory.snapshot import device_estimate, host_bytes
from memfit.planning.cost import StepTime, step_time
from memfit.planning.fit import SAFETY_MARGIN, decide, fits, margin_note
from memfit.planning.gpus import GPU, REFERENCE_GPU, gpu_by_name, smallest_fitting
from memfit.planning.moe import moe_plan_lines
from memfit.planning.space import Constraints, candidates, micro_batches
from memfit.report.runs import describe
from memfit.settings.config import Optimizer, RunConfig
from memfit.spec.engines import refusal
from memfit.spec.model import load_spec
from memfit.spec.resolved import attention
from memfit.units import fmt_gib, parse_size

#: Ranking weight of settings that change the arithmetic for a speed gain too small to matter when an
#: exact setting is nearly as fast: 8-bit AdamW (quantized moments, bitsandbytes) saves a few bytes per
#: parameter of optimizer-step traffic, well under 1% of a step, so it wins only when it buys more
#: (a larger micro-batch, no checkpointing) than 1% of speed.
PREFERENCE = {Optimizer.ADAMW_8BIT: 0.99}

#: Settings that can change between optimizer steps without rebuilding the model or the optimizer.
LIVE_FIELDS = ("micro_batch", "grad_accum", "grad_checkpointing")


@dataclass(frozen=True)
class Plan:
    """One candidate configuration with its predicted peak and speed."""

    config: RunConfig
    peak_bytes: int
    tokens_per_s: float
    fits: bool
    breakdown: MemoryBreakdown = field(compare=False, repr=False)
    time: StepTime | None = field(default=None, compare=False, repr=False)
    outside_bytes: int = field(default=0, compare=False, repr=False)
    """The largest peak outside the step (loading, evaluation, a save, samples; ``memory.outside``)."""
    routing_bytes: int = field(default=0, compare=False, repr=False)
    """Mixture-of-experts: what the worst routing adds to the step's peak (``memory.moe.routing_margin``)."""
    phases: DevicePhases | None = field(default=None, compare=False, repr=False)
    """Every phase's predicted reserved memory (``memory.phases``): what the fit decision read."""
    proxy: bool = field(default=False, compare=False, repr=False)
    """Priced with the hand-written recipe of a nearby family instead of the derived one it would need: a
    candidate no faster than a plan already found to fit, or far over the budget (``_evaluate_deferred``)."""

    @property
    def needed_bytes(self) -> int:
        """What must fit (``planning.fit``): the worst phase's reserved memory + context + NCCL, where priced;
        else the step's peak with the worst routing or, where higher, a peak outside it."""
        if self.phases is not None:
            return self.phases.needed()
        return max(self.peak_bytes + self.routing_bytes, self.outside_bytes)

    @property
    def weight(self) -> float:
        """The ``PREFERENCE`` weight of its settings (1.0: none); the plan table's note states it."""
        return PREFERENCE.get(self.config.optimizer, 1.0)

    @property
    def score(self) -> float:
        """What the ranking sorts by: tokens/s times the ``PREFERENCE`` weight of its settings."""
        return self.tokens_per_s * self.weight

    def to_dict(self) -> dict[str, Any]:
        out = {"config": self.config.to_flat(), "peak_bytes": int(self.peak_bytes),
               "tokens_per_s": float(self.tokens_per_s), "fits": bool(self.fits),
               "phase": self.breakdown.phase}
        if self.time is not None:
            out["step_seconds"] = self.time.seconds
        if self.phases is not None:  # what the fit rule read (planning.fit)
            out["needed_bytes"] = int(self.phases.needed())
            out["worst_phase"] = self.phases.worst.name
        if self.routing_bytes:
            out["routing_margin_bytes"] = int(self.routing_bytes)
        if self.proxy:
            out["proxy"] = True
        return out


@dataclass
class PlanResult:
    """Ranked plans: fitting ones by tokens/s (fastest first), then the others by peak (smallest first)."""

    budget_bytes: int
    safety_margin: float
    plans: list[Plan]
    chosen: int = 0
    """Index in ``plans`` of the chosen plan (the fastest that fits)."""
    model: str = ""
    gpu: GPU | None = None
    """The device whose speed ``tokens_per_s`` is for."""
    spec: Any = field(default=None, repr=False)
    """The ``ModelSpec`` planned for (``fallbacks`` estimates with it)."""
    cpu: bool = False
    """The budget is a CPU's memory (``plan(..., cpu=True)``): fallbacks and the refusal say so too."""
    notes: list[str] = field(default_factory=list)
    """Lines about the chosen plan that the table does not show (a mixture-of-experts model's: ``planning.moe``)."""

    @property
    def best(self) -> Plan:
        return self.plans[self.chosen]

    @property
    def fitting(self) -> list[Plan]:
        return [p for p in self.plans if p.fits]

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """``{"budget_bytes", "chosen", "plans": [...]}`` (the ``--json`` schema); ``top`` keeps the first N."""
        plans = self.plans if top is None else self.plans[:top]
        return {
            "model": self.model,
            "budget_bytes": int(self.budget_bytes),
            "safety_margin": self.safety_margin,
            "gpu": self.gpu.name if self.gpu else None,
            "candidates": len(self.plans),
            "fitting": len(self.fitting),
            "chosen": self.chosen,
            "plans": [p.to_dict() for p in plans],
            **({"notes": self.notes} if self.notes else {}),
        }


def evaluate(spec, run: RunConfig, gpu: GPU, budget_bytes: int, margin: float = SAFETY_MARGIN, *,
             cpu: bool = False, engine: str | None = None, derived: bool | None = None, stack=None) -> Plan:
    """Estimate and time one configuration; ``cpu``: the budget is a CPU's memory (CPU kernels, no CUDA
    context, and ``memfit train``'s rollback snapshot counts: ``memory.snapshot``); ``derived``: ``estimate``'s
    choice of recipe (False: a proxy, ``Plan.proxy``); ``stack``: the trainer that runs it (``settings.stack``)."""

    breakdown = device_estimate(spec, run, "cpu" if cpu else "cuda", engine, derived, stack)
    t = step_time(spec, run, gpu)
    # Loading, evaluation and the full-state save must fit too (the step fitting is not enough); a mixture-of-experts
    # step with the routing that costs most (the estimate assumes the balanced one).
    routing = routing_margin(spec, run)
    decision = decide(spec, run, breakdown, budget_bytes, margin, cpu=cpu, extra_step=routing, stack=stack)  # the one rule
    return Plan(run, breakdown.peak_bytes, t.tokens_per_s, decision.fits, breakdown, t,
                decision.phases.outside_step(), routing, phases=decision.phases, proxy=derived is False)


def rank(plans: list[Plan]) -> list[Plan]:
    """Fitting by score (tokens/s, see ``PREFERENCE``) desc, then lower peak; non-fitting by peak asc.

    Python's sort is stable and the keys end with the candidate order, so the ranking is deterministic.
    """
    order = {id(p): i for i, p in enumerate(plans)}
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (-p.score, p.peak_bytes, order[id(p)]))
    rest = sorted((p for p in plans if not p.fits), key=lambda p: (p.peak_bytes, -p.tokens_per_s, order[id(p)]))
    return fitting + rest


def resolve_target(model, gpu: GPU | str | None, budget_bytes) -> tuple[Any, GPU, int]:
    """``(spec, gpu, budget_bytes)``: the model (a name is loaded), the GPU (a name is looked up; None: the
    reference GPU) and the budget (None: that GPU's memory), as ``plan`` and ``maximize`` search them."""

    spec = load_spec(model) if isinstance(model, str) else model
    if isinstance(gpu, str):
        gpu = gpu_by_name(gpu)
    device = gpu or gpu_by_name(REFERENCE_GPU)
    if budget_bytes is None:
        if gpu is None:
            raise UserError("Give a memory budget (--budget 24GiB) or a GPU (--gpu rtx-4090 or --gpu auto).")
        budget_bytes = gpu.memory_bytes
    return spec, device, parse_size(budget_bytes)


def plan(model, budget_bytes: int | str | None, *, seq_len: int, batch: int, num_processes: int = 1,
         gpu: GPU | str | None = None, constraints: Constraints | None = None,
         safety_margin: float = SAFETY_MARGIN, cpu: bool = False, adapt=None,
         method="sft", engine_of=None, nodes: int = 1, stack=None) -> PlanResult:
    """Rank every candidate configuration for ``model`` by speed among those that fit ``budget_bytes``.

    Args:
        model: preset name, local folder / config.json, or a ``ModelSpec``.
        budget_bytes: memory per device (bytes or ``"24GiB"``); ``None`` takes the GPU's memory.
        seq_len: tokens per sequence.
        batch: effective batch in sequences per optimizer step, over all processes (kept exact).
        num_processes: data-parallel ranks (memory is per rank; sharding is tried when > 1).
        nodes: the machines they run on (``planning.nodes`` searches node counts; hybrid sharding is tried on 2+).
        gpu: the device whose speed ranks the plans (default: ``REFERENCE_GPU``; fp16 AMP instead of
            bf16 on devices without bf16).
        constraints: settings the user pinned.
        safety_margin: fits iff ``peak * (1 + safety_margin) <= budget``.
        cpu: the budget is a CPU's memory (``memfit train --budget`` without CUDA; see ``evaluate``).
        adapt: each candidate as another tool would run it, or None where it cannot (``memfit.interop``'s ``realize``:
            ``plan --emit axolotl`` plans only what Axolotl runs, priced as it runs it).
        engine_of: each candidate's sharding engine (``memory.deepspeed_layout.ENGINES``), or None for the
            launch's (``engines.estimator_engine``): ``memfit.interop``'s ``engine_of`` for a tool that runs
            some shardings through DeepSpeed.
        stack: the trainer and versions that run the candidates (``memfit.settings.stack``: ``plan --from`` a file
            prices them as the file's tool runs them, as ``estimate --from`` reads them back); None: memfit's own.
        method: the objective (``--method``): a preference method doubles the forward's sequences and,
            for DPO, the planner chooses the reference policy (``space.candidates``).

    Raises:
        NothingFitsError: one sentence with the smallest peak reached, its settings and the smallest
            listed GPU that would hold it.
    """
    if not 0.0 <= safety_margin < 1.0:
        raise UserError(f"--margin must be in [0, 1), got {safety_margin}.")
    spec, device, budget = resolve_target(model, gpu, budget_bytes)
    runs = candidates(seq_len, batch, num_processes, constraints, bf16_ok=device.bf16, method=method, cpu=cpu,
                      nodes=nodes)
    if adapt is not None:
        runs = list(dict.fromkeys(r for r in map(adapt, runs) if r is not None))
        if not runs:
            raise UserError("No candidate the planner considers can be run by that tool with the settings pinned; "
                            "pin fewer settings.")
    # Refuse once what no candidate can run (bad LoRA targets, an attention the model cannot run),
    # instead of every candidate being skipped for it.
    spec.check_lora_targets(next((r for r in runs if r.is_lora()), runs[0]))
    attention(spec, runs[0].attn_implementation)
    host = None if cpu or not constraints else constraints.host_memory
    ranked = rank(_evaluate_all(spec, runs, device, budget, safety_margin, cpu=cpu, host_memory=host, engine_of=engine_of,
                                stack=stack))
    result = PlanResult(budget, safety_margin, ranked, 0, getattr(spec, "name", str(model)), device, spec, cpu)
    if not ranked[0].fits:
        raise NothingFitsError(nothing_fits_message(result))

    result.notes = moe_plan_lines(result, lambda r: evaluate(spec, r, device, budget, safety_margin, cpu=cpu))
    result.notes.append(margin_note(result.best.phases, budget, safety_margin))  # what the decision read, what is left
    result.notes += _proxy_note(ranked, spec)
    return result


def _proxy_note(ranked: list[Plan], spec) -> list[str]:
    """The table's ``~`` rows explained, when there are any."""
    proxies = sum(p.proxy for p in ranked)
    if not proxies:
        return []
    return [f"~: {proxies} of {len(ranked)} candidates priced with the hand-written Llama recipe as a proxy, not the "
            f"recipe derived from {spec.model_type}'s code: each is slower than the chosen plan or far over the "
            "budget, so deriving theirs could not change the choice."]


def _evaluate_all(spec, runs: list[RunConfig], gpu: GPU, budget: int, margin: float, cpu: bool = False,
                  host_memory: int | None = None, engine_of=None, stack=None) -> list[Plan]:
    """Evaluate every candidate; ones the estimator refuses (a combination it knows cannot run) are
    skipped, and if it refuses them all its first reason is the error. ``host_memory``: candidates whose
    host RAM (``memory.snapshot.host_bytes``) exceeds it are skipped too."""

    plans, refused, deferred = [], [], []
    plain_plans: dict[RunConfig, Plan] = {}
    for run in runs:
        reason = refusal(run, cuda=True)  # only what `memfit train` runs on a GPU (e.g. no optimizer-only offload)
        if reason:
            refused.append(UserError(reason))
            continue
        host = host_bytes(spec, run) if host_memory is not None else 0
        if host_memory is not None and host > host_memory:
            refused.append(UserError(f"Every candidate needs more host RAM than --host-memory {fmt_gib(host_memory)} "
                                     f"(e.g. {fmt_gib(host)} for offload {run.offload}); "
                                     "raise it or pin --offload none."))
            continue
        plain = run.replace(loss="standard", optimizer_in_backward=False)
        if run != plain and plain in plain_plans and not _technique_can_help(plain_plans[plain], run, budget, margin):
            continue
        try:
            with derive.cached_only():  # a recipe still to be traced: later, only if the run can win
                plans.append(evaluate(spec, run, gpu, budget, margin, cpu=cpu,
                                      engine=engine_of(run) if engine_of else None, stack=stack))
        except derive.RecipeNotCached:
            deferred.append(run)
            continue
        except UserError as err:
            refused.append(err)
            continue
        if run == plain:
            plain_plans[run] = plans[-1]
    plans += _evaluate_deferred(spec, deferred, plans, gpu, budget, margin, cpu, engine_of, refused, stack)
    if not plans:
        raise refused[0]
    return plans


#: A candidate whose proxy estimate holds more than this times the tensor bytes the budget leaves room for is not
#: derived: it is not going to fit (the proxy, Llama's hand-written recipe, was within 6% of the derived recipes
#: on the accuracy grid's families with SDPA, and under-estimates, which this never skips, where attention is eager).
PROXY_SLACK = 1.15


def _far_over(proxy: Plan, budget: int, margin: float) -> bool:
    """Whether ``proxy``'s tensor bytes exceed ``PROXY_SLACK`` times the room the budget leaves for tensors (the
    budget less the safety margin and the device's constant ``other``: CUDA context, workspace)."""
    other = proxy.breakdown.other
    room = budget / (1.0 + margin) - other
    return room <= 0 or proxy.needed_bytes - other > PROXY_SLACK * room


def _evaluate_deferred(spec, runs: list[RunConfig], found: list[Plan], gpu: GPU, budget: int, margin: float,
                       cpu: bool, engine_of, refused: list, stack=None) -> list[Plan]:
    """Price the candidates whose recipe must be derived (``memory/derive.py``: seconds per recipe, once, then
    cached), fastest first, deriving only while one can still beat every plan found to fit.

    A candidate is derived and priced exactly when it is not slower than the fastest plan known to fit and its proxy
    estimate (the hand-written recipe, ``derived=False``) is not far over the budget (``_far_over``); every other
    one keeps the proxy's numbers (``Plan.proxy``): it cannot be the chosen plan, whatever its exact peak.
    The chosen plan is therefore the one a derivation of every candidate would choose, unless the proxy
    over-estimates a candidate by more than ``PROXY_SLACK`` (then a slower plan is chosen: safe, not wrong).
    """
    best = max((p.score for p in found if p.fits), default=0.0)
    proxies = []
    for run in runs:
        try:
            proxies.append(evaluate(spec, run, gpu, budget, margin, cpu=cpu,
                                    engine=engine_of(run) if engine_of else None, derived=False, stack=stack))
        except UserError as err:
            refused.append(err)
    out = []
    for proxy in sorted(proxies, key=lambda p: -p.score):
        if proxy.score < best or _far_over(proxy, budget, margin):
            out.append(proxy)
            continue
        try:
            plan = evaluate(spec, proxy.config, gpu, budget, margin, cpu=cpu,
                            engine=engine_of(proxy.config) if engine_of else None, stack=stack)
        except UserError as err:
            refused.append(err)
            continue
        out.append(plan)
        if plan.fits:
            best = max(best, plan.score)
    return out


def _technique_can_help(plain: Plan, run: RunConfig, budget: int, margin: float) -> bool:
    """Whether ``run`` (``plain`` + chunked loss and/or optimizer-in-backward) can be worth evaluating.

    Both cost time (planning/cost.py), so they matter only where ``plain`` does not fit; and they remove at
    most the logits (chunked) with the caching allocator's overhead that follows them
    (``memory.fragmentation``: its logits term, 12.5 GiB of a 32k-token Llama 3.2 step's 47 GiB of logits) and
    the gradients + step temporaries (in backward) of ``plain``'s peak, so where even that would not fit they are
    skipped unevaluated (this keeps the search under a second).
    """
    if plain.fits:
        return False
    b = plain.breakdown
    cut = 0
    if str(run.loss) != "standard":
        tensors = b.peak_bytes - b.other
        without = cuda_other(tensors - b.logits, b.optimizer, 0) if b.other else 0
        cut += b.logits + max(0, b.other - without)
    cut += (b.gradients + b.temporary) if run.optimizer_in_backward else 0
    return fits(plain.peak_bytes - cut, budget, margin)


def nothing_fits_message(result: PlanResult) -> str:
    """One sentence: the smallest peak reached, with which settings, and the smallest GPU that holds it."""
    smallest = min(result.plans, key=lambda p: p.needed_bytes)
    need = smallest.needed_bytes * (1 + result.safety_margin)
    # a peak outside the step (loading a sharded 4-bit base whole, evaluation, a save) can be the binding one
    where_peak = " outside the training step" if smallest.outside_bytes > smallest.peak_bytes else ""
    if result.cpu:  # a GPU's name would be for a different peak (CUDA context, CUDA kernels)
        return (f"Nothing fits in {fmt_gib(result.budget_bytes)} with a {result.safety_margin:.0%} safety margin: "
                f"the smallest peak reached on this CPU is {fmt_gib(smallest.needed_bytes)}{where_peak} "
                f"({describe(smallest.config)}), so it needs a --budget of about {fmt_gib(need)} or more.")
    gpu = smallest_fitting(need)
    where = (f"the smallest listed GPU that would hold it is {gpu.name} ({fmt_gib(gpu.memory_bytes, 0)})" if gpu
             else "no listed GPU holds it, so spread it over more GPUs with --num-processes and --sharding fsdp")
    return (f"Nothing fits in {fmt_gib(result.budget_bytes)} with a {result.safety_margin:.0%} safety margin: "
            f"the smallest peak reached is {fmt_gib(smallest.needed_bytes)}{where_peak} ({describe(smallest.config)}), "
            f"and {where}.")


def fallbacks(result: PlanResult, current: RunConfig, *, live_only: bool = False) -> list[RunConfig]:
    """Configurations to fall back to after an out-of-memory error with ``current``, best first.

    Every one keeps ``current``'s effective batch and sequence length exactly and has a lower predicted
    peak than ``current``. Live changes come first: those that differ from ``current`` only in
    ``micro_batch``, ``grad_accum`` and ``grad_checkpointing`` (``LIVE_FIELDS``), which a running
    training loop can switch between optimizer steps without rebuilding the model or the optimizer;
    they are generated from ``current`` itself (so pinned settings such as the LoRA rank are kept),
    fastest first. Then, unless ``live_only``, the other fitting plans of ``result`` with the same
    effective batch (these need the model/optimizer rebuilt), fastest first.
    """
    spec, gpu = result.spec, result.gpu or gpu_by_name(REFERENCE_GPU)
    current_peak = evaluate(spec, current, gpu, result.budget_bytes, result.safety_margin, cpu=result.cpu).peak_bytes
    live = []
    for micro, accum in micro_batches(current.effective_batch(), current.num_processes, Constraints()):
        for gc in (current.grad_checkpointing, not current.grad_checkpointing):
            run = current.replace(micro_batch=micro, grad_accum=accum, grad_checkpointing=gc)
            if run != current:
                live.append(evaluate(spec, run, gpu, result.budget_bytes, result.safety_margin, cpu=result.cpu))
    live = [p for p in rank(live) if p.peak_bytes < current_peak]
    seen = {p.config for p in live}
    rest = [] if live_only else [
        p for p in result.plans
        if p.fits and p.peak_bytes < current_peak and p.config not in seen and p.config != current
        and p.config.effective_batch() == current.effective_batch() and p.config.seq_len == current.seq_len]
    return [p.config for p in live + rest]

"""``plan --maximize seq-len|micro-batch``: the longest sequence (largest micro-batch) that fits a budget.

The question users ask of a card ("what is the longest sequence I can train on 24 GB?"), answered with the
techniques the user allows (``space.candidates``: every regime, checkpointing, optimizer, offload, loss...,
each a *technique*; the maximized setting is the one number left free). ``plan()`` ranks techniques by
tokens/s at a given size; this searches the size itself, per technique, and keeps the largest:

- the predicted peak grows with the sequence length and the micro-batch (activations, logits, attention
  all scale with the tokens; nothing shrinks), so for one technique the values that fit are ``1..v`` and
  a bisection finds ``v`` exactly: ``v`` fits (``search.fits``: peak and the peaks outside the step with
  the safety margin), ``v + 1`` does not, or ``v`` is the cap (the model's ``max_position_embeddings``
  for the sequence; ``MAX_MICRO_BATCH``);
- techniques are tried cheapest first (their peak at a probe size), and one that does not fit at the best
  value found so far is dropped after that one evaluation: only a technique that fits there is searched
  further (a tie at the best value is kept, and the tie goes to the faster one, as in ``plan``).

The step size is one token (one sequence): "one more step does not fit" is checked by the tests.
"""

from __future__ import annotations

from memfit.errors import NothingFitsError, UserError
from memfit.planning.search import (
    SAFETY_MARGIN,
    Plan,
    PlanResult,
    evaluate,
    nothing_fits_message,
    resolve_target,
)
from memfit.planning.space import Constraints, candidates
from memfit.spec.engines import refusal
from memfit.units import fmt_gib

#: What ``--maximize`` can maximize: the flag's value -> the ``RunConfig`` field.
TARGETS = {"seq-len": "seq_len", "micro-batch": "micro_batch"}

#: The largest micro-batch searched (a bound for the bisection; far beyond any budget of a real model).
MAX_MICRO_BATCH = 1 << 16

#: The sequence length the techniques are first compared at (cheapest first), when the search starts.
PROBE_SEQ_LEN = 4096


def maximize(model, budget_bytes, target: str, *, seq_len: int, num_processes: int = 1, gpu=None,
             constraints: Constraints | None = None, safety_margin: float = SAFETY_MARGIN, engine_of=None,
             stack=None) -> PlanResult:
    """The techniques that reach the largest ``target`` (``seq-len`` or ``micro-batch``) within the budget.

    ``seq-len``: one sequence per process per micro-batch (the longest context; a pinned ``--micro-batch``
    is kept), ``seq_len`` ignored. ``micro-batch``: at ``seq_len``, one micro-batch per optimizer step (the
    effective batch is ``micro_batch x num_processes``). Returns a ``PlanResult`` whose plans are the
    techniques that reached the best value (and those that held it before a better one was found), best
    first: the largest value, then tokens/s. Raises ``NothingFitsError`` when not even 1 fits.
    ``engine_of`` and ``stack``: as ``planning.search.plan``'s (``plan --from FILE``: each candidate on the file's
    engine, priced on its stack); None: memfit's own.
    """
    if target not in TARGETS:
        raise UserError(f"--maximize must be one of {', '.join(TARGETS)}, got {target!r}.")
    if not 0.0 <= safety_margin < 1.0:
        raise UserError(f"--margin must be in [0, 1), got {safety_margin}.")
    c = constraints or Constraints()
    if target == "micro-batch" and (c.micro_batch is not None or c.grad_accum not in (None, 1)):
        raise UserError("--maximize micro-batch chooses the micro-batch (one per optimizer step); "
                        "drop --micro-batch and --grad-accum.")
    spec, device, budget = resolve_target(model, gpu, budget_bytes)
    field = TARGETS[target]
    cap = spec.max_position_embeddings if field == "seq_len" else MAX_MICRO_BATCH
    micro = (c.micro_batch or 1) if field == "seq_len" else 1
    start = min(PROBE_SEQ_LEN, cap) if field == "seq_len" else seq_len
    techniques = _techniques(start, micro * num_processes, num_processes, c, device.bf16)

    def plan_at(run, value) -> Plan | None:
        try:
            run = run.replace(**{field: value})
            return evaluate(spec, run, device, budget, safety_margin, engine=engine_of(run) if engine_of else None,
                            stack=stack)
        except UserError:  # a combination the estimator refuses at this size
            return None

    def fits(run, value) -> Plan | None:
        p = plan_at(run, value)
        return p if p is not None and p.fits else None

    probes = [(p.needed_bytes, i, run) for i, run in enumerate(techniques)
              for p in [plan_at(run, 1 if field == "micro_batch" else start)] if p is not None]
    best_value, kept = 0, []
    for _, _, run in sorted(probes, key=lambda t: (t[0], t[1])):
        at_best = fits(run, max(best_value, 1))
        if at_best is None:
            continue
        value, plan = _largest(run, max(best_value, 1), cap, at_best, fits)
        if value > best_value:
            best_value = value
        kept.append(plan)
    ranked = sorted(kept, key=lambda p: (-getattr(p.config, field), -p.score))
    if not ranked:
        smallest = [p for _, _, run in probes for p in [plan_at(run, 1)] if p is not None]
        empty = PlanResult(budget, safety_margin, sorted(smallest, key=lambda p: p.needed_bytes), 0,
                           getattr(spec, "name", str(model)), device, spec)
        raise NothingFitsError(nothing_fits_message(empty))
    return PlanResult(budget, safety_margin, ranked, 0, getattr(spec, "name", str(model)), device, spec)


def _techniques(seq_len: int, batch: int, num_processes: int, c: Constraints, bf16_ok: bool) -> list:
    """The candidates of ``space`` at one micro-batch per step: each a technique, the maximized value free.
    What ``memfit train`` would refuse on a GPU (``engines.refusal``) is left out, as ``plan`` leaves it."""

    return [run for run in candidates(seq_len, batch, num_processes, c, bf16_ok=bf16_ok)
            if not refusal(run, cuda=True)]


def _largest(run, low: int, cap: int, at_low: Plan, fits) -> tuple[int, Plan]:
    """The largest value in ``[low, cap]`` at which ``run`` fits (it fits at ``low``: ``at_low``), and its plan:
    doubling from ``low`` until a value does not fit (or the cap), then bisection between the two."""
    good, good_plan, step = low, at_low, 1
    bad = None
    while bad is None:
        probe = min(good + step, cap)
        if probe == good:
            return good, good_plan  # the cap fits
        plan = fits(run, probe)
        if plan is None:
            bad = probe
        else:
            good, good_plan, step = probe, plan, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        plan = fits(run, mid)
        if plan is None:
            bad = mid
        else:
            good, good_plan = mid, plan
    return good, good_plan


def next_step(result: PlanResult, target: str) -> Plan | None:
    """The best plan's configuration one step further (one more token or sequence), evaluated; None at the cap
    (the model's positions for the sequence, ``MAX_MICRO_BATCH``)."""
    field = TARGETS[target]
    value = getattr(result.best.config, field)
    cap = result.spec.max_position_embeddings if field == "seq_len" else MAX_MICRO_BATCH
    if value >= cap:
        return None
    return evaluate(result.spec, result.best.config.replace(**{field: value + 1}), result.gpu, result.budget_bytes,
                    result.safety_margin)


def largest_note(result: PlanResult, target: str) -> str:
    """One sentence: the largest value found, and why one more does not fit (or that it is the model's cap).

    It lives here, not in report/: it evaluates one more step (``next_step``) to say what that needs."""
    field = TARGETS[target]
    value = getattr(result.best.config, field)
    what = "sequence" if field == "seq_len" else "micro-batch"
    unit = "tokens" if field == "seq_len" else "sequences"
    nxt = next_step(result, target)
    if nxt is None:
        limit = "the model's positions" if field == "seq_len" else f"the search's bound ({MAX_MICRO_BATCH:,})"
        return f"Largest {what} that fits: {value:,} {unit}, {limit} (more would fit the budget)."
    return (f"Largest {what} that fits: {value:,} {unit}; {value + 1:,} needs {fmt_gib(nxt.needed_bytes)}, over "
            f"{fmt_gib(result.budget_bytes)} once the {result.safety_margin:.0%} margin is added.")

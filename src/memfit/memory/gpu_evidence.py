"""What published GPU runs say about the reserved memory memfit predicts: the error spread a fit margin is read against.

``memory.fragmentation.SPREAD`` is the allocator term's error against allocator replays on a CPU. A GPU adds what no
replay holds (other streams' cached blocks, kernels' own workspaces, what a stack keeps that memfit does not
price), so ``planning.fit.margin_note`` also states how a plan's leftover compares with memfit's errors against real
GPUs: the 22 published runs of ``bench/published_runs.yaml`` whose figure counts ``max_memory_reserved`` or
nvidia-smi (issue 36's set), each predicted by the analytic estimate for its own stack (``bench/published_check.py``).

``RESERVED_ERRORS`` holds their signed errors, ``(predicted - published) / published``, as that script computed them
on 2026-12-06 (round 19), rounded to 0.1%; ``tests/test_published_figures.py`` recomputes them and fails once any
moves by more than a percentage point, so the figures stated here follow the estimator. Known limits: 22 runs of five
projects, mostly Llama 2 7B and 70B and Llama 3.1 8B on 2024-2025 stacks; the two over by 40% are torch.compile runs
that memfit prices as eager (their note in ``published_runs.yaml``).
"""

from __future__ import annotations

#: Signed errors of the 22 runs, sorted (bench/published_check.py, issue 36's set, 2026-12-06).
RESERVED_ERRORS = (-0.175, -0.124, -0.096, -0.089, -0.088, -0.086, -0.086, -0.066, -0.057, -0.030, -0.026, -0.019,
                   -0.007, -0.002, -0.002, 0.001, 0.001, 0.003, 0.010, 0.015, 0.402, 0.409)


def covered(left: int, needed: int) -> int:
    """How many of the published runs a plan would still have fitted had memfit erred on it as on them: a run
    under-predicted by ``e`` (``e`` < 0) really needs ``needed / (1 + e)``, so the ``left`` bytes of the budget cover it
    when ``left >= needed x (1 / (1 + e) - 1)``; every over-prediction is covered."""
    return sum(1 for e in RESERVED_ERRORS if e >= 0 or left >= needed * (1.0 / (1.0 + e) - 1.0))


def describe(left: int, needed: int) -> str:
    """The comparison in words, for the fit decision's note."""
    under = sum(1 for e in RESERVED_ERRORS if e < 0)
    return (f"against {len(RESERVED_ERRORS)} published GPU runs that count max_memory_reserved or nvidia-smi, memfit "
            f"read {RESERVED_ERRORS[0]:+.1%} .. {RESERVED_ERRORS[-1]:+.1%} of the figure ({under} under); this leftover "
            f"covers {covered(left, needed)} of them (memory/gpu_evidence.py)")

"""The tensor peaks of a head and loss on real tensors, as another trainer's code runs them (tests of
``memory.transformers_loss`` and ``memory.stack_terms.chunked_output_logits``)."""

from __future__ import annotations

import torch

from memfit.memory.measure import counted


def head_and_loss_peaks(run_loss, shape: tuple[int, int, int, int], count=counted,
                        keep_output: bool = False) -> tuple[int, int]:
    """(forward's peak, backward's peak), bytes beyond the inputs: seeded bf16 hidden states ``(B, T, H)`` that need a
    gradient, a frozen bf16 head ``(V, H)`` and labels ``(B, T)``; ``run_loss(hidden, head, labels)`` returns the loss
    and what the caller's loop binds (the logits), dropped before ``loss.backward()`` unless ``keep_output``. ``count``:
    memfit's counter (``memory.measure.counted``, or ``counted_compiled`` for compiled code)."""
    b, t, h, v = shape
    torch.manual_seed(0)
    hidden = torch.randn(b, t, h, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(v, h, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (b, t))
    with count((hidden, head, labels)) as live:
        start = live.current
        loss, output = run_loss(hidden, head, labels)
        forward = live.peak - start
        if not keep_output:
            del output
        live.peak = live.current
        loss.backward()
        backward = live.peak - start
    return forward, backward

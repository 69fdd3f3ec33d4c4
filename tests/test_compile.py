"""``--compile``: torch.compile of the model (inductor's C++ backend on CPU) trains, and what it saves for
backward is predicted by AOTAutograd's partitioner on fake tensors (``memory/compiled.py``).

Compiling takes minutes on 2 busy cores even for the tiny model: both tests are slow.
"""

from __future__ import annotations

import json

import pytest

from _trace_helpers import family_config
from _train_helpers import tiny_config
from memfit.settings.config import RunConfig

pytestmark = pytest.mark.slow


def test_compile_trains_and_reports_memory(tmp_path):
    from memfit.training.loop import train

    eager = tiny_config(tmp_path / "e", max_steps=2)
    compiled = tiny_config(tmp_path / "c", max_steps=2, run={"compile": True})
    train(eager)
    train(compiled)
    runs = [json.loads((tmp_path / d / "out" / "run.json").read_text()) for d in ("e", "c")]
    assert runs[1]["settings"]["compile"] is True
    first = [json.loads(line)["loss"] for d in ("e", "c")
             for line in (tmp_path / d / "out" / "metrics.jsonl").read_text().splitlines()[:1]]
    assert first[0] == pytest.approx(first[1], rel=1e-4)  # same weights, same batch: the same loss


def test_exact_compile_prices_the_partitioners_smaller_saved_set():
    import re

    from memfit.memory.trace import trace

    config = family_config("llama")
    run = RunConfig.of(seq_len=128, micro_batch=2)  # packed documents: the block-causal mask path, as compiled
    eager = trace(config, run, device="cpu")
    compiled = trace(config, run.replace(compile=True), device="cpu")
    saved, eager_saved = (int(x.replace(",", "")) for x in
                          re.search(r"saves ([\d,]+) bytes .* saves ([\d,]+);", compiled.notes[-1]).groups())
    assert 0 < saved < eager_saved
    assert compiled.peak_bytes <= eager.peak_bytes


def test_exact_compile_predicts_the_compiled_steps_measured_peak():
    """Real tensors on CPU: one compiled step counted with inductor's buffers (``counted_compiled``), against
    ``trace(..., compile=True)``; eager counted alike against the eager trace."""
    import torch
    from transformers import AutoModelForCausalLM

    from memfit.builder.parts import make_optimizer, parameter_groups
    from memfit.memory.measure import counted, counted_compiled, resident_tensors
    from memfit.memory.trace import trace
    from memfit.settings.config import OptimSettings

    config = family_config("llama")
    # 384 tokens: activations, not the optimizer step, set both peaks (at 128 the step did, the same for both)
    run = RunConfig.of(seq_len=128, micro_batch=3, packing="concat", optimizer="adamw")
    measured = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        # memfit's optimizer, as the trace builds it: its two weight-decay groups order the per-tensor loop,
        # whose previous ``denom`` is alive during the next tensor's step (one AdamW over model.parameters()
        # was 702,464 bytes lower than the trace: a down_proj-sized denom before the head's step)
        optimizer = make_optimizer(run, parameter_groups(model, OptimSettings.weight_decay), 1e-4)
        net = torch.compile(model) if compiled else model
        ids = torch.randint(0, config.vocab_size, (run.micro_batch, run.seq_len))

        def step(net=net, optimizer=optimizer, ids=ids):
            net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # compiles; creates the optimizer state
        with (counted_compiled if compiled else counted)(resident_tensors(model, optimizer, [ids])) as live:
            step()
        predicted = trace(config, run.replace(compile=compiled), device="cpu").peak_bytes
        measured[compiled] = (live.peak, predicted)
    for compiled, (real, predicted) in measured.items():
        # eager: exact; compiled: within the known error of memory/compiled.py (about 7% either way)
        assert abs(predicted - real) / real < (0.1 if compiled else 0.01), (compiled, measured)
    assert measured[True][0] < measured[False][0]  # compile saves fewer tensors for backward

"""memfit train on a 2-layer hidden-64 Llama (random init from a config.json, byte tokenizer), CPU, fp32.

Every run here is a few optimizer steps of a few sequences; golden numbers are explained inline.
"""

from __future__ import annotations

import json

import pytest
import torch

from _train_helpers import (
    crash_after_first_checkpoint_then_resume,
    max_diff,
    metrics,
    tiny_config,
    write_text,
)
from memfit.data.dataset import collate, count_target_tokens
from memfit.errors import UserError
from memfit.settings.config import RunConfig
from memfit.training import step as step_module
from memfit.training.loop import run_training
from memfit.training.sampler import DUMMY, StepBatchSampler, StepSchedule, split_step


# ------------------------------------------------------------------------------------------- sampler
def test_split_step_worked_example():
    # The module docstring's example: E=4 split over P=2 ranks x k=2 micro-batches of 1, j-major order.
    assert split_step([10, 11, 12, 13], 1, 2, 2) == [[10], [12], [11], [13]]
    # A partial last step (2 of 4 samples): rank 0 takes both, rank 1 gets dummy rows.
    assert split_step([10, 11], 1, 2, 2) == [[10], [DUMMY], [11], [DUMMY]]


def test_schedule_covers_every_sample_once_per_epoch_whatever_the_split():
    schedule = StepSchedule(num_samples=10, effective_batch=4, seed=3)
    assert schedule.steps_per_epoch() == 3  # 4 + 4 + 2: the last partial step is kept
    for micro, accum, procs in ((4, 1, 1), (2, 2, 1), (1, 2, 2), (1, 4, 1)):
        batches = list(StepBatchSampler(schedule, start_samples=0, num_steps=6, micro_batch=micro,
                                        grad_accum=accum, num_processes=procs))
        seen = [i for b in batches for i in b if i != DUMMY]
        assert sorted(seen) == sorted(list(range(10)) * 2)  # two epochs, nothing dropped or repeated
        assert len(batches) == 6 * accum * procs  # every rank runs k micro-batches every step
        first_step = [i for b in batches[: accum * procs] for i in b]
        assert sorted(first_step) == sorted(schedule.step_samples(0))


# -------------------------------------------------------------------------- issue 6: accumulation grid
@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """4 x 1, 2 x 2 and 1 x 4 (micro-batch x accumulation), 3 SGD steps each, same samples per step."""
    out = {}
    for micro, accum in ((4, 1), (2, 2), (1, 4)):
        cfg = tiny_config(tmp_path_factory.mktemp(f"grid{micro}x{accum}"), run={"micro_batch": micro, "grad_accum": accum})
        out[(micro, accum)] = (cfg, run_training(cfg, show=False))
    return out


def test_data_has_unequal_target_counts_per_micro_batch(grid):
    # The grid is only a test of normalisation if micro-batches of a step hold different target counts.
    cfg, _ = grid[(1, 4)]
    from _data_helpers import tokenize
    from memfit.data.sources import load_examples
    from memfit.training.setup import build_model

    tok = build_model(cfg, cfg.run).tokenizer
    rows = tokenize(load_examples(cfg.data), tok, seq_len=64, packing=False, eval_fraction=0.0, seed=0).train
    step0 = StepSchedule(len(rows), 4, 0).step_samples(0)
    counts = [count_target_tokens(collate([rows[i]], 0)["labels"]) for i in step0]
    assert len(set(counts)) > 1, counts


def test_accumulation_equivalence_weights_and_logged_losses(grid):
    ref_cfg, ref = grid[(4, 1)]
    ref_losses = [m["loss"] for m in metrics(ref_cfg.folder.output)]
    assert len(ref_losses) == 3
    for key in ((2, 2), (1, 4)):
        cfg, res = grid[key]
        assert max_diff(ref.model, res.model) < 1e-6, key
        assert [m["loss"] for m in metrics(cfg.folder.output)] == pytest.approx(ref_losses, abs=1e-6)


def test_gradient_checkpointing_gives_the_same_loss(grid, tmp_path):
    ref_cfg, ref = grid[(4, 1)]
    cfg = tiny_config(tmp_path, run={"grad_checkpointing": True})
    res = run_training(cfg, show=False)
    ref_losses = [m["loss"] for m in metrics(ref_cfg.folder.output)]
    assert [m["loss"] for m in metrics(cfg.folder.output)] == pytest.approx(ref_losses, abs=1e-6)
    assert max_diff(ref.model, res.model) < 1e-6


def test_output_folder_loads_and_records_the_run(grid):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, res = grid[(4, 1)]
    out = cfg.folder.output
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert max_diff(loaded, res.model) == 0.0
    assert AutoTokenizer.from_pretrained(out).pad_token_id == 0
    run = json.loads((tmp := __import__("pathlib").Path(out) / "run.json").read_text())
    assert run["steps"] == 3 and run["sequences"] == 12 and run["skipped_steps"] == 0
    assert run["run"]["micro_batch"] == 4 and run["settings"]["lr"] == 0.5
    assert {"torch", "transformers", "accelerate", "peft"} <= set(run["versions"])
    assert run["peak_memory"]["cpu_peak_rss"] > 0 and run["measured"]["method"] == "measured"
    assert (tmp.parent / "loss.png").stat().st_size > 1000
    assert run["uses_model_loss"] is True  # Llama's forward takes num_items_in_batch


# ----------------------------------------------------------------------------------------- training
def test_loss_falls_on_text(tmp_path):
    cfg = tiny_config(tmp_path, data=write_text(tmp_path), max_steps=12, packing=True, lr=1e-2,
                      eval_every=12, eval_fraction=0.1, run={"optimizer": "adamw", "seq_len": 64})
    summary = run_training(cfg, show=False).summary
    losses = [m["loss"] for m in metrics(cfg.folder.output)]
    assert losses[-1] < losses[0] - 1.0  # starts near ln(384) = 5.95 nats; a byte model drops fast
    assert summary.final_eval_loss < summary.unigram_loss + 1.0


def test_lora_trains_only_the_adapters(tmp_path):
    # r=4 on q_proj and v_proj of 2 layers: q: A 4x64 + B 64x4 = 512; v: A 4x64 + B 32x4 = 384
    # (v's output is 2 kv heads x 16 = 32); 2 layers x (512 + 384) = 1,792 trainable parameters.
    cfg = tiny_config(tmp_path, merge=True, run={"lora_r": 4, "lora_targets": "q_proj,v_proj"})
    res = run_training(cfg, show=False)
    assert res.summary.trainable_params == 1792
    trained = {n: p for n, p in res.model.named_parameters() if p.requires_grad}
    assert len(trained) == 8 and all("lora_" in n for n in trained)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "base")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    # The frozen base is untouched: its mlp weights equal the merged model's (LoRA did not wrap mlp).
    assert torch.equal(base.model.layers[0].mlp.up_proj.weight, merged.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(base.model.layers[0].self_attn.q_proj.weight, merged.model.layers[0].self_attn.q_proj.weight)
    with_adapter = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # transformers' PEFT integration
    x = torch.tensor([[1, 50, 60, 70]])
    torch.testing.assert_close(with_adapter(x).logits, merged(x).logits, atol=1e-5, rtol=1e-5)


def test_resume_after_a_crash_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch):
    full = run_training(tiny_config(tmp_path / "a", max_steps=4, run={"optimizer": "adamw"}, lr=1e-2,
                                    warmup_steps=2), show=False)
    cfg = tiny_config(tmp_path / "b", max_steps=4, save_every=2, run={"optimizer": "adamw"}, lr=1e-2,
                      warmup_steps=2)
    resumed = crash_after_first_checkpoint_then_resume(cfg, monkeypatch)  # killed after the step-2 checkpoint
    assert resumed.summary.steps == 4 and resumed.summary.sequences == 16
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- issue 5.4: OOM fallback
def test_fake_oom_falls_back_and_redoes_the_step(tmp_path, monkeypatch):
    # Reference: 1 step at 4 x 1, checkpoint, then the fallback config 2 x 2 from step 2 on.
    ref_cfg = tiny_config(tmp_path / "ref", save_every=1, max_steps=1)
    run_training(ref_cfg, show=False)
    ref = run_training(tiny_config(tmp_path / "ref", resume=True, extend_schedule=True,  # the 1-step run trained on
                                   run={"micro_batch": 2, "grad_accum": 2}), show=False)

    real = step_module.micro_loss

    def oom_at_micro_batch_4_after_step_1(model, batch, *args):
        oom_at_micro_batch_4_after_step_1.calls += 1
        if batch["input_ids"].shape[0] == 4 and oom_at_micro_batch_4_after_step_1.calls > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(model, batch, *args)

    oom_at_micro_batch_4_after_step_1.calls = 0
    monkeypatch.setattr(step_module, "micro_loss", oom_at_micro_batch_4_after_step_1)
    res = run_training(tiny_config(tmp_path / "oom"), show=False)
    assert res.summary.steps == 3 and res.summary.sequences == 12  # no step lost or counted twice
    fallbacks = [fb.to_dict() for fb in res.summary.fallbacks]
    assert fallbacks == [{"step": 2, "phase": "forward",
                          "error": "CUDA out of memory. Tried to allocate 2.00 GiB (simulated)",
                          "from": {"micro_batch": 4, "grad_accum": 1, "grad_checkpointing": False, "optimizer": "sgd"},
                          "to": {"micro_batch": 2, "grad_accum": 2, "grad_checkpointing": False, "optimizer": "sgd"}}]
    run_json = json.loads((tmp_path / "oom" / "out" / "run.json").read_text())
    assert run_json["fallbacks"] == fallbacks and run_json["run"]["micro_batch"] == 2
    for (name, a), b in zip(ref.model.state_dict().items(), res.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_oom_in_evaluation_is_not_taken_for_a_batch_problem(tmp_path, monkeypatch):
    from memfit.training import loop

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(loop, "evaluate", oom)
    with pytest.raises(UserError, match="while evaluating, outside a training step"):
        run_training(tiny_config(tmp_path, max_steps=1, eval_every=1, eval_fraction=0.2), show=False)


# ------------------------------------------------------------------------------- fp16: scaler, preflight
def test_skipped_steps_are_counted_with_a_forced_overflow(tmp_path, monkeypatch):
    # CPU Accelerate runs no loss scaler, so give it torch's CPU GradScaler as it does for fp16 on CUDA.
    from memfit.training import session

    real_build = session.build_accelerator

    def with_scaler(*args, **kwargs):
        acc = real_build(*args, **kwargs)
        acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu", init_scale=2.0**10), True
        return acc

    real_loss = step_module.micro_loss

    def inf_at_step_2(*args):
        inf_at_step_2.calls += 1
        loss = real_loss(*args)
        return loss * float("inf") if inf_at_step_2.calls == 2 else loss

    inf_at_step_2.calls = 0
    monkeypatch.setattr(session, "build_accelerator", with_scaler)
    monkeypatch.setattr(step_module, "micro_loss", inf_at_step_2)
    cfg = tiny_config(tmp_path)
    res = run_training(cfg, show=False)
    assert res.summary.skipped_steps == 1
    assert [m["skipped_steps"] for m in metrics(cfg.folder.output)] == [0, 1, 1]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["skipped_steps"] == 1


def test_fp16_preflight():
    from memfit.training.setup import preflight

    with pytest.raises(UserError, match="cannot train weights stored in fp16"):
        preflight(RunConfig.of(mixed_precision="fp16", dtype="fp16"))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="use --mixed-precision bf16"):
            preflight(RunConfig.of(mixed_precision="fp16"))
    preflight(RunConfig.of(mixed_precision="fp16", dtype="fp16", lora_r=8)) if torch.cuda.is_available() else None


def test_fallback_ladder_keeps_the_effective_batch_and_ends():
    from memfit.settings.config import RunConfig
    from memfit.training import oom

    run = RunConfig.of(micro_batch=4, grad_accum=1)
    ladder = oom.fallback_ladder(run)
    # Divisors of 4 below 4, largest first, with accumulation raised to keep 4 sequences per step;
    # then checkpointing on at micro-batch 1.
    assert [(r.micro_batch, r.grad_accum, r.grad_checkpointing) for r in ladder] == [
        (2, 2, False), (1, 4, False), (1, 4, True)]
    assert all(r.effective_batch() == run.effective_batch() for r in ladder)
    assert oom.next_config(run) == ladder[0]
    # At micro-batch 1 with checkpointing already on there is nothing left that keeps the batch.
    assert oom.next_config(RunConfig.of(micro_batch=1, grad_accum=4, grad_checkpointing=True)) is None

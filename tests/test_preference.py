"""Preference methods (issue 26): DPO, ORPO and SimPO losses and gradients against TRL's, exact
accumulation, the pair data (every record form) and its bad inputs.

The oracle is TRL (a test-only dependency): its ``get_batch_logps`` for the log-probabilities,
``CPOTrainer.cpo_loss`` (``loss_type="simpo"``) and ``ORPOTrainer.odds_ratio_loss`` called as plain
functions on a namespace holding their settings, and for DPO the formula of ``DPOTrainer._compute_loss``
(``loss_type="sigmoid"``: ``-logsigmoid(beta * ((c - c_ref) - (r - r_ref)))``, averaged over the batch),
which is a method of a built trainer, not a function that can be called alone. ORPO's NLL term is the
mean cross-entropy of the chosen completion tokens (the paper's L_SFT; TRL takes it over the prompt too,
memfit over the completion as its next-token loss does: ``memfit.builder.preference``), computed here by
``torch.nn.functional.cross_entropy``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from _train_helpers import assert_one_sentence, max_diff, tiny_config, write_model, write_pairs
from memfit.builder import preference
from memfit.cli import cli
from memfit.settings.config import Method, PreferenceSettings

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")

B, T, V = 3, 9, 11


def _batch(seed=0):
    """Logits (2B, T, V) needing grad and labels with a masked prompt of varying length per sequence."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * B, T, V, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, V, (2 * B, T), generator=g)
    for i in range(2 * B):
        labels[i, : 1 + i % 4] = -100  # the prompt
        labels[i, T - i % 3 :] = -100 if i % 3 else labels[i, T - i % 3 :]  # right padding
    return logits, labels


def _trl_logps(logits, labels, average):
    from trl.experimental.cpo import CPOTrainer

    return CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)


def _memfit(spec, logits, labels, ref=None):
    norms = preference.Norms(torch.tensor(B), torch.tensor(int((labels[:B, 1:] != -100).sum())))
    loss, _ = preference.micro_loss(spec, logits, labels, norms, ref)
    return loss


def _trl(spec, logits, labels, ref=None):
    device = SimpleNamespace(device="cpu")
    if spec.method is Method.DPO:
        c, r = _trl_logps(logits, labels, False).chunk(2)
        rc, rr = ref.chunk(2)
        return (-F.logsigmoid(spec.params.beta * ((c - rc) - (r - rr)))).mean()
    c, r = _trl_logps(logits, labels, True).chunk(2)
    if spec.method is Method.SIMPO:
        from trl.experimental.cpo import CPOTrainer

        ns = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=spec.params.simpo_gamma, beta=spec.params.beta,
                             label_smoothing=0.0, accelerator=device)
        return CPOTrainer.cpo_loss(ns, c, r)[0].mean()
    from trl.experimental.orpo import ORPOTrainer

    losses = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=spec.params.orpo_lambda, accelerator=device), c, r)[0]
    nll = F.cross_entropy(logits[:B, :-1].reshape(-1, V), labels[:B, 1:].reshape(-1), ignore_index=-100)
    return nll - losses.mean()


@pytest.mark.parametrize("method", [Method.DPO, Method.ORPO, Method.SIMPO])
def test_loss_and_gradient_equal_trl(method):
    logits, labels = _batch()
    spec = preference.PreferenceLoss(method, PreferenceSettings(beta=0.3, orpo_lambda=0.2, simpo_gamma=0.7))
    ref = torch.randn(2 * B, dtype=torch.float64) * 3 - 10
    mine = _memfit(spec, logits, labels, ref)
    (g_mine,) = torch.autograd.grad(mine, logits)
    theirs = _trl(spec, logits, labels, ref)
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    assert abs(mine.item() - theirs.item()) < 1e-5
    assert float((g_mine - g_theirs).abs().max()) < 1e-5
    assert float(g_mine.abs().max()) > 1e-4  # a gradient that exists


def test_trl_defaults_are_memfit_defaults():
    from trl import DPOConfig
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    ours = preference.PreferenceLoss(Method.DPO).params  # the schema's defaults (PreferenceSettings)
    assert ours.beta == DPOConfig.beta == CPOConfig.beta
    assert ours.simpo_gamma == CPOConfig.simpo_gamma
    assert ours.orpo_lambda == ORPOConfig.beta


@pytest.mark.parametrize("method", [Method.DPO, Method.ORPO, Method.SIMPO])
def test_micro_batches_sum_to_the_big_batch(method):
    """Split 3 pairs into micro-batches of 2 and 1 (different target counts): the summed shares and their
    gradients are the big batch's, because the step's pairs and chosen tokens normalise every share."""
    logits, labels = _batch(1)
    spec = preference.PreferenceLoss(method)
    ref = torch.randn(2 * B, dtype=torch.float64) - 8
    big = _memfit(spec, logits, labels, ref)
    (g_big,) = torch.autograd.grad(big, logits)
    micro = [[0, 1], [2]]
    batches = [{"labels": torch.cat([labels[i], labels[[B + j for j in i]]])} for i in micro]
    norms = preference.step_norms(batches, lambda t: t)
    total = 0
    for i in micro:
        rows = i + [B + j for j in i]
        loss, _ = preference.micro_loss(spec, logits[rows], labels[rows], norms, ref[rows])
        total = total + loss
    (g_split,) = torch.autograd.grad(total, logits)
    assert abs(float(total) - float(big)) < 1e-10
    assert float((g_split - g_big).abs().max()) < 1e-10


# ------------------------------------------------------------------------------------ data and training
@pytest.mark.parametrize("split", [(4, 1), (2, 2), (1, 4)])
def test_dpo_accumulation_trains_the_same_weights(tmp_path, split):
    """One step of 4 pairs as 4x1, 2x2 and 1x4: the same weights (exact normalisation by the step's pairs)."""
    from memfit.training.loop import run_training

    data = write_pairs(tmp_path / "p.jsonl", n=8)
    models = []
    for micro, accum in [(4, 1), split]:
        out = tmp_path / f"o{micro}{accum}{len(models)}"
        cfg = tiny_config(tmp_path, data=data, output=str(out), max_steps=2, lr=0.5,
                          run={"method": "dpo", "micro_batch": micro, "grad_accum": accum})
        models.append(run_training(cfg, show=False).model)
    assert max_diff(*models) < 1e-5


def test_pair_record_forms(tmp_path):
    """Text with an explicit or an implicit prompt, conversations with an explicit or implicit prompt."""
    from memfit.data.pairs import record_to_pair

    explicit = record_to_pair({"prompt": "Q:", "chosen": " yes", "rejected": " no"}, "r1")
    assert (explicit.prompt, explicit.chosen, explicit.rejected) == ("Q:", " yes", " no")
    implicit = record_to_pair({"chosen": "Q: the sky is blue", "rejected": "Q: the sky is red"}, "r2")
    assert implicit.prompt == "Q: the sky is" and implicit.chosen == " blue"
    user = {"role": "user", "content": "hi"}
    chat = record_to_pair({"chosen": [user, {"role": "assistant", "content": "hello"}],
                           "rejected": [user, {"role": "assistant", "content": "go away"}]}, "r3")
    assert chat.prompt == (("user", "hi"),) and chat.chosen == (("assistant", "hello"),)


def test_conversation_pair_carries_loss_on_its_completion_only(tmp_path):
    from memfit.data.dataset import byte_tokenizer
    from memfit.data.formats import BYTE_CHAT_TEMPLATE
    from memfit.data.pairs import encode_pair, record_to_pair

    tok = byte_tokenizer()
    tok.chat_template = BYTE_CHAT_TEMPLATE
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "PROMPTREPLY"},
             {"role": "user", "content": "b"}]
    pair = record_to_pair({"prompt": turns, "chosen": [{"role": "assistant", "content": "yes"}],
                           "rejected": [{"role": "assistant", "content": "no"}]}, "r")
    row = encode_pair(pair, tok, 256)
    targets = tok.decode([t for t in row["labels"] if t != -100])
    assert "yes" in targets and "PROMPTREPLY" not in targets


def _cli(tmp_path, data, *extra):
    return CliRunner().invoke(cli, ["train", "--model", write_model(tmp_path / "m"), "--tokenizer", "byte",
                                    "--data", data, "--seq-len", "32", "--micro-batch", "2", "--max-steps", "1",
                                    "--eval-every", "0", "--samples", "0", "--output", str(tmp_path / "out"),
                                    "--method", "dpo", *extra])


@pytest.mark.parametrize("case", ["no rejected", "identical", "prompt too long", "no pairs"])
def test_bad_pair_input_is_one_sentence(tmp_path, case):
    path = tmp_path / "p.jsonl"
    records = {
        "no rejected": ({"r3": {"prompt": "x", "chosen": " y"}}, f"{path} row 4 has no rejected answer"),
        "identical": ({"r2": {"prompt": "x", "chosen": " y", "rejected": " y"}},
                      f"{path} row 3 has identical chosen and rejected"),
        "prompt too long": ({"r1": {"prompt": "x" * 40, "chosen": " y", "rejected": " z"}},
                            f"{path} row 2 has a prompt of 41 tokens"),
    }
    if case == "no pairs":
        path.write_text('{"prompt": "a", "completion": "b"}\n')
        pattern = f"--method dpo trains on preference pairs, but {path} row 1 has none"
    else:
        changes, pattern = records[case]
        write_pairs(path, **changes)
    assert_one_sentence(_cli(tmp_path, str(path)), pattern)
    assert not (tmp_path / "out").exists()


def test_data_preview_shows_the_pair_and_its_loss_tokens(tmp_path):
    data = write_pairs(tmp_path / "p.jsonl")
    result = CliRunner().invoke(cli, ["data", "preview", "--data", data, "--index", "2"])
    assert result.exit_code == 0, result.output
    assert "preference pair" in result.output
    assert "--- chosen (9 tokens, 4 with loss)\n[[no loss: <s>2+2=]] 4.</s>" in result.output
    assert "--- rejected (9 tokens, 4 with loss)\n[[no loss: <s>2+2=]] 5.</s>" in result.output


def test_dpo_oom_in_forward_falls_back_to_the_smaller_micro_batch(tmp_path, monkeypatch):
    """An out-of-memory error in step 1's preference forward: the step is redone as 2 x 2, and the run ends
    with the weights of 2 x 2 from the start (the pairs' normalisation does not depend on the split)."""
    from memfit.training.loop import run_training

    data = write_pairs(tmp_path / "p.jsonl", n=8)
    cfg = dict(data=data, max_steps=2, run={"method": "dpo", "micro_batch": 4})
    planned = run_training(tiny_config(tmp_path / "a", **{**cfg, "run": {"method": "dpo", "micro_batch": 2,
                                                                          "grad_accum": 2}}), show=False)
    real, calls = preference.micro_loss, []

    def once_out_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(preference, "micro_loss", once_out_of_memory)
    res = run_training(tiny_config(tmp_path / "b", **cfg), show=False)
    [fallback] = res.summary.fallbacks
    assert fallback.phase == "forward" and (fallback.after["micro_batch"], fallback.after["grad_accum"]) == (2, 2)
    assert max_diff(planned.model, res.model) < 1e-6


@pytest.mark.parametrize("method", [Method.DPO, Method.ORPO, Method.SIMPO])
def test_a_pair_without_targets_adds_nothing_and_stays_finite(method):
    """The sampler's dummy row (a rank with no pair left in the last step) carries no target: its pair adds
    neither loss nor gradient, and ORPO's log(1 - e^a) at a = 0 does not turn the step into NaN."""
    logits, labels = _batch(2)
    labels[[0, B]] = -100  # pair 0: no target on either side
    spec = preference.PreferenceLoss(method)
    norms = preference.Norms(torch.tensor(B - 1), torch.tensor(int((labels[:B, 1:] != -100).sum())))
    loss, stats = preference.micro_loss(spec, logits, labels, norms, torch.zeros(2 * B, dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and float(stats[0]) == B - 1
    assert float(grad[[0, B]].abs().max()) == 0.0


def test_precompute_reference_splits_the_pairs_over_the_ranks(tmp_path):
    """--precompute-reference on 2 processes: each rank's forwards read only its share of the pairs (rank r:
    rows r, r + 2, ...), and after the gather every rank holds every pair's log-probabilities, those one
    process computes. Where only rank 0 holds the weights (CPU FSDP2), it computes them all. (The real
    2-process run: ``test_preference_dp``'s dpo-precompute case.)"""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from _train_helpers import TINY_LLAMA
    from memfit.data.dataset import byte_tokenizer
    from memfit.data.pairs import encode_pair, read_pairs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA))
    cfg = tiny_config(tmp_path, data=write_pairs(tmp_path / "p.jsonl", n=7), run={"method": "dpo"})
    tok = byte_tokenizer()
    fresh = lambda: [encode_pair(p, tok, 32) for p in read_pairs(cfg)]  # noqa: E731
    seen = []
    model.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs["input_ids"].shape[0] // 2),
                                with_kwargs=True)
    one = fresh()
    kw = dict(pad_id=tok.pad_token_id, batch_size=2)
    assert preference.precompute(model, one, **kw) == 7 and sum(seen) == 7
    ranks, shares = [fresh(), fresh()], {}
    seen.clear()
    preference.precompute(model, ranks[1], rank=1, holders=2, gather=lambda mine: shares.setdefault(1, mine), **kw)
    assert sum(seen) == 3  # rows 1, 3, 5
    seen.clear()
    preference.precompute(model, ranks[0], rank=0, holders=2, gather=lambda mine: mine + shares[1], **kw)
    assert sum(seen) == 4  # rows 0, 2, 4, 6
    # (flat: pytest 9.2's approx compares no nested sequences)
    assert [x for r in ranks[0] for x in r["ref_logps"]] == pytest.approx([x for r in one for x in r["ref_logps"]],
                                                                          abs=1e-6)
    seen.clear()
    assert preference.precompute(model, fresh(), rank=1, holders=1, gather=lambda mine: mine, **kw) == 0
    assert not seen  # a rank without the weights computes nothing


def test_tokens_per_step_counts_both_sides_of_each_pair(tmp_path):
    """A micro-batch of B pairs runs 2B sequences: the preamble's tokens per optimizer step count them all."""
    result = _cli(tmp_path, write_pairs(tmp_path / "p.jsonl"), "--grad-accum", "3")
    assert result.exit_code == 0, result.output
    assert ("effective batch 6 pairs (12 sequences) = micro-batch 2 x accumulation 3 x 1 process(es); "
            "tokens per optimizer step: 384 (padding included)") in " ".join(result.output.split())


def test_dpo_metrics_reach_the_tracker(tmp_path):
    """--tracker with a preference method: the reward accuracy and margin of every logged step reach it
    (TensorBoard's event files, read back), as the loss does for sft (test_trackers)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from _train_helpers import metrics
    from memfit.training.loop import run_training

    cfg = tiny_config(tmp_path, data=write_pairs(tmp_path / "p.jsonl"), tracker="tensorboard", max_steps=2,
                      lr=0.1, run={"method": "dpo", "micro_batch": 2})
    run_training(cfg, show=False)
    logged = {}
    for events in (tmp_path / "out").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in set(acc.Tags()["scalars"]) & {"reward_accuracy", "reward_margin"}:
            logged[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    for tag in ("reward_accuracy", "reward_margin"):
        written = metrics(cfg.folder.output)
        assert [step for step, _ in logged[tag]] == [m["step"] for m in written]  # (pytest 9.2: no nested approx)
        assert [value for _, value in logged[tag]] == pytest.approx([m[tag] for m in written], abs=1e-6)

"""``memfit plan --maximize seq-len|micro-batch``: the largest value that fits, and one more does not.

Specs are presets (meta device, no download); "fits" is the analytic estimator's (``planning.search.fits``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memfit.cli import cli
from memfit.errors import NothingFitsError, UserError
from memfit.planning.maximize import maximize, next_step
from memfit.planning.search import evaluate, fits
from memfit.planning.space import Constraints
from memfit.units import GiB


@pytest.fixture(scope="module")
def llama31():
    from memfit.spec.model import load_spec

    return load_spec("llama-3.1-8b")


@pytest.fixture(scope="module")
def longest_qlora(llama31):
    # pinned to QLoRA with checkpointing: the search stays small (what the unpinned search picks on 24 GiB)
    pins = Constraints(quantize="4bit", grad_checkpointing=True, optimizer="adamw-fused", loss="chunked")
    return maximize(llama31, "24GiB", "seq-len", seq_len=1024, constraints=pins)


def test_longest_sequence_fits_and_one_more_token_does_not(longest_qlora):
    best = longest_qlora.best
    assert best.fits and fits(best.needed_bytes, 24 * GiB)
    nxt = next_step(longest_qlora, "seq-len")
    assert nxt is not None and nxt.config.seq_len == best.config.seq_len + 1
    assert not nxt.fits
    assert 8192 < best.config.seq_len < 131072  # llama-3.1-8b QLoRA on 24 GiB: tens of thousands of tokens
    assert best.tokens_per_s > 0


def test_unpinned_search_answers_for_llama31_on_24gib(llama31, longest_qlora):
    result = maximize(llama31, "24GiB", "seq-len", seq_len=1024)
    best = result.best
    assert not next_step(result, "seq-len").fits
    # nothing the techniques allow reaches further than the pinned QLoRA + checkpointing run by more than the
    # 8-bit optimizer's bytes, and every plan kept holds a value no larger than the best's
    assert best.config.seq_len >= longest_qlora.best.config.seq_len
    assert all(p.config.seq_len <= best.config.seq_len for p in result.plans)
    assert str(best.config.quantize) == "4bit" and best.config.grad_checkpointing


def test_largest_micro_batch_fits_and_one_more_does_not(llama31):
    pins = Constraints(quantize="4bit", grad_checkpointing=True, optimizer="adamw-fused", loss="chunked")
    result = maximize(llama31, "24GiB", "micro-batch", seq_len=2048, constraints=pins)
    best = result.best.config
    assert best.micro_batch > 1 and best.grad_accum == 1 and best.seq_len == 2048
    assert not next_step(result, "micro-batch").fits
    smaller = evaluate(llama31, best.replace(micro_batch=best.micro_batch - 1), result.gpu, result.budget_bytes)
    assert smaller.fits


def test_cap_is_the_models_positions():
    result = maximize("tiny", "80GiB", "seq-len", seq_len=128)
    assert result.best.config.seq_len == 1024  # tiny's max_position_embeddings
    assert next_step(result, "seq-len") is None


def test_nothing_fits_and_bad_pins_are_one_sentence(llama31):
    with pytest.raises(NothingFitsError):
        maximize(llama31, "2GiB", "seq-len", seq_len=1024, constraints=Constraints(quantize="4bit",
                                                                                    optimizer="adamw-fused"))
    with pytest.raises(UserError, match="drop --micro-batch"):
        maximize(llama31, "24GiB", "micro-batch", seq_len=1024, constraints=Constraints(micro_batch=2))


def test_cli_maximize_seq_len():
    args = ["plan", "llama-3.1-8b", "--budget", "24GiB", "--maximize", "seq-len", "--quantize", "4bit",
            "--grad-checkpointing", "--optimizer", "adamw-fused", "--loss", "chunked"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "Largest sequence that fits:" in res.output and "--seq-len" in res.output
    res = CliRunner().invoke(cli, [*args, "--json"])
    data = json.loads(res.output)
    assert data["plans"][0]["config"]["seq_len"] > 8192 and data["plans"][0]["fits"]


def test_lean_qlora_reaches_further_than_peft_full_upcast(llama31):
    # the planner's QLoRA is lean unless --qlora-upcast full is pinned; PEFT's fp32 stream costs context
    pins = dict(quantize="4bit", grad_checkpointing=True, optimizer="adamw-fused", loss="standard")
    lean = maximize(llama31, "24GiB", "seq-len", seq_len=1024, constraints=Constraints(**pins)).best.config
    full = maximize(llama31, "24GiB", "seq-len", seq_len=1024,
                    constraints=Constraints(**pins, qlora_upcast="full")).best.config
    assert str(lean.qlora_upcast) == "lean" and str(full.qlora_upcast) == "full"
    assert lean.seq_len > 1.2 * full.seq_len


def test_maximize_prices_the_given_stack(llama31):
    # plan --from FILE --maximize: the candidates are priced on the file's stack, as plan without --maximize does
    # (torchtune's LoRA adapters in bf16 hold half of PEFT's fp32 ones, so the two stacks price the same run apart)
    from memfit.settings.stack import Stack

    stack = Stack(trainer="torchtune")
    pins = Constraints(quantize="none", lora_r=16, dtype="bf16", grad_checkpointing=True, optimizer="adamw-fused",
                       loss="chunked")
    result = maximize(llama31, "24GiB", "micro-batch", seq_len=2048, constraints=pins, stack=stack)
    best = result.best
    on_stack = evaluate(llama31, best.config, result.gpu, result.budget_bytes, result.safety_margin, stack=stack)
    own = evaluate(llama31, best.config, result.gpu, result.budget_bytes, result.safety_margin)
    assert best.needed_bytes == on_stack.needed_bytes
    assert own.needed_bytes > on_stack.needed_bytes  # fp32 adapters, their gradients and moments

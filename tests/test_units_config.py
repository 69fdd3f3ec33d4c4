"""units.py and config.py: parsing sizes and validating settings."""

from __future__ import annotations

import pytest

from memfit.errors import UserError
from memfit.settings.config import Precision, RunConfig, TrainConfig
from memfit.units import GB, GiB, fmt_gb, fmt_gib, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GiB", 24 * 2**30), ("24 GB", 24 * 10**9), ("24G", 24 * 2**30), ("8000MiB", 8000 * 2**20), ("1e9", 10**9),
     ("25769803776", 24 * 2**30)],
)
def test_parse_size_reads_both_binary_and_decimal_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1GB", "0GiB", "24 parsecs", "lots", "80"])  # "80": bytes, surely not meant
def test_parse_size_rejects_nonsense_with_a_user_error(text):
    with pytest.raises(UserError):
        parse_size(text)


def test_gb_and_gib_are_labelled_and_differ():
    # A "24 GB" card holds 24 GiB = 25.77 GB: 24 * 2**30 / 1e9 = 25.769803776.
    assert fmt_gib(24 * GiB) == "24.00 GiB"
    assert fmt_gb(24 * GiB) == "25.77 GB"
    assert fmt_gb(GB) == "1.00 GB"


def test_run_config_derived_numbers_and_validation():
    run = RunConfig.of(seq_len=512, micro_batch=2, grad_accum=8, num_processes=2, mixed_precision="bf16")
    assert run.effective_batch() == 32
    assert run.tokens_per_step() == 32 * 512
    assert run.mixed_precision is Precision.BF16
    assert run.compute_dtype() == "bf16"
    with pytest.raises(UserError, match="micro-batch"):
        RunConfig.of(micro_batch=0)
    with pytest.raises(UserError, match="--optimizer"):
        RunConfig.of(optimizer="adam9000")
    with pytest.raises(UserError, match="lora-r"):
        RunConfig.of(quantize="4bit")


def test_train_config_round_trips_through_flat_keys():
    cfg = TrainConfig.of(model="tiny", run=RunConfig.of(lora_r=8, lora_targets=("q_proj", "v_proj")), lr=1e-4)
    flat = cfg.to_flat()
    assert flat["lora_targets"] == "q_proj,v_proj" and flat["lr"] == 1e-4
    assert TrainConfig.from_flat(flat) == cfg
    with pytest.raises(UserError, match="Unknown setting"):
        TrainConfig.from_flat({"learning_rate": 1})

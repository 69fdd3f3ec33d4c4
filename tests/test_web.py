"""``memfit serve``'s library side, without a browser (issue 38): the form is the schema, the answers are the
CLI's, an error names its field. tests/test_web_browser.py drives the page itself in Chromium."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from memfit.cli import cli
from memfit.errors import UserError
from memfit.web import form, service


def _help_of(command: str) -> str:
    return re.sub(r"\s+", " ", CliRunner().invoke(cli, [command, "--help"], terminal_width=1000).output)


def test_every_estimate_flag_is_a_control_with_the_cli_help():
    """One fact, one place: the page's controls are the settings ``memfit estimate`` takes, each with the help
    text its --help prints (a setting added to the schema appears on the page untouched)."""
    controls = form.run_controls()
    text = _help_of("estimate")
    for c in controls:
        assert c["flag"] in text, c["flag"]
        assert re.sub(r"\s+", " ", c["help"]) in text, c["flag"]
    from memfit.settings.config import RunConfig
    from memfit.settings.schema import for_command

    assert [c["key"] for c in controls] == [s.key for s in for_command(RunConfig, "estimate")]
    by_key = {c["key"]: c for c in controls}
    assert by_key["mixed_precision"]["choices"] == ["no", "fp16", "bf16"]
    assert by_key["grad_checkpointing"] == {**by_key["grad_checkpointing"], "kind": "bool", "default": False}
    assert by_key["seq_len"]["default"] == 128 and by_key["seq_len"]["kind"] == "int"  # estimate's, train's
    assert [c["default"] for c in form.plan_controls()] == [None, 4]  # plan's --batch: train's micro-batch x 1


@pytest.fixture(scope="module")
def tiny_cli_json():
    result = CliRunner().invoke(cli, ["estimate", "tiny", "--seq-len", "128", "--lora-r", "8", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_estimate_answers_what_estimate_json_prints(tiny_cli_json):
    page = service.estimate({"model": {"kind": "preset", "value": "tiny"},
                             "settings": {"seq_len": "128", "lora_r": "8"}})
    assert {k: v for k, v in page.items() if k != "page"} == tiny_cli_json
    assert page["page"]["cli"] == "memfit estimate tiny --seq-len 128 --lora-r 8 --json"
    fits = {g["name"]: g["fits"] for g in page["page"]["gpus"]}
    assert fits["rtx-3060-12gb"] and len(fits) == 18


@pytest.mark.parametrize(("settings", "field"), [
    ({"seq_len": "0"}, "seq_len"),
    ({"lora_dropout": "0.1"}, "lora_dropout"),  # without --lora-r: the CLI's check_lora_options sentence
    ({"seq_len": "999999"}, "seq_len"),  # beyond the model's positions
    ({"mixed_precision": "fp8"}, "mixed_precision"),
])
def test_an_error_is_the_cli_sentence_and_names_its_field(settings, field):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    result = CliRunner().invoke(cli, ["estimate", "tiny", *args])
    with pytest.raises(UserError) as err:
        service.estimate({"model": {"kind": "preset", "value": "tiny"}, "settings": settings})
    if field != "mixed_precision":  # click refuses an unknown choice itself, in its own words
        assert result.exit_code == 1 and result.stderr.strip() == f"error: {err.value}"
    assert service.field_of(str(err.value)) == field


def test_an_uploaded_file_is_named_by_its_own_name_not_the_temporary_copy():
    with pytest.raises(UserError) as err:
        service.estimate({"model": {"kind": "tool", "value": "base_model: [1, 2]\nsequence_len: 128\n",
                                    "filename": "../../axolotl.yml", "format": "axolotl"}})
    assert str(err.value).startswith("axolotl.yml, base_model:"), str(err.value)
    assert "memfit-serve-" not in str(err.value)
    assert service.field_of(str(err.value)) == "model"


@pytest.mark.parametrize(("source", "sentence"), [
    ({"kind": "disk"}, "Choose the model as one of: preset, hub, config, tool."),
    ({"kind": "hub", "value": " "}, "Give a Hugging Face Hub id (org/name)."),
    ({"kind": "tool", "value": "x", "format": "deepspeed"}, "Unknown --from-format 'deepspeed'; choose one of: "),
])
def test_a_malformed_model_request_is_one_sentence(source, sentence):
    with pytest.raises(UserError, match=re.escape(sentence)):
        service.Source.from_dict(source)


def test_settings_the_page_cannot_send_are_refused():
    with pytest.raises(UserError, match="lr is no setting of memfit estimate"):
        service.typed_settings({"lr": "1e-3"})
    with pytest.raises(UserError, match="--seq-len takes one value"):
        service.typed_settings({"seq_len": [1, 2]})

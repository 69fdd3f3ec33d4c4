"""The settings schema is the one source: every flag, YAML key, resume rule and planner constraint is a
field of ``RunConfig``/``TrainConfig`` (``memfit.settings.schema``), or is listed here as the command's own."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import typing

import click
import pytest
from click.testing import CliRunner

from memfit.cli import cli
from memfit.cli import data as data_cli
from memfit.cli import estimate as estimate_cli
from memfit.cli import plan as plan_cli
from memfit.cli import train as train_cli
from memfit.cli.options import _plain
from memfit.errors import UserError
from memfit.planning.space import Constraints
from memfit.settings.config import (
    Cadence,
    CheckpointSettings,
    DataReading,
    FolderSettings,
    LoraSettings,
    ModelSource,
    OptimSettings,
    PreferenceSettings,
    RunConfig,
    RunLength,
    TrainConfig,
)
from memfit.settings.schema import (
    COMMANDS,
    PLAN_ROLES,
    RESUME_RULES,
    flag_of,
    for_command,
    groups,
    in_group,
    key_of,
    option_spec,
    searched,
    setting,
    settings,
    walk,
)
from memfit.settings.validate import flag
from memfit.training import resume

COMMANDS_CLI = {"estimate": estimate_cli.command, "plan": plan_cli.command, "train": train_cli.command}

#: Flags that are no setting of a run: each command's own. A flag not here must be a schema field.
COMMAND_ONLY = {
    # estimate: what to show and how (the run it prices is all schema settings)
    "estimate": {"--compare", "--exact", "--timeline", "--plot", "--device", "--json",
                 "--from", "--from-format"},  # another tool's configuration read as the run (memfit.interop)
    # plan: the machine and the search (--full/--no-quantize/--no-offload/--host-memory are Constraints'
    # plan-only fields), and its output (--output is plan.yaml, not train's run folder)
    "plan": {"--gpu", "--margin", "--full", "--no-quantize", "--no-offload", "--host-memory", "--maximize", "--top", "--output",
             "--accelerate-config", "--json", "--from", "--from-format", "--emit",
             "--gpus-per-node", "--max-nodes", "--internode-gbs"},  # the cluster (planning.nodes)
    # train: where the settings come from (--config), and the old spelling of --packing none
    "train": {"--config", "--no-packing"},
    # data preview: which record and how to print it; its --data/--model/--revision/--tokenizer are train's
    "data preview": {"--index", "--json"},
}


def _flags(command: click.Command) -> dict[str, click.Option]:
    """Each option of ``command`` by its long flag."""
    out = {}
    for param in command.params:
        if isinstance(param, click.Option):
            long = [o for o in param.opts if o.startswith("--")]
            out[long[0]] = param
    return out


def _schema_flags(command: str) -> dict[str, tuple[type, dataclasses.Field]]:
    return {flag_of(f): (cls, f) for cls in (TrainConfig, RunConfig) for f in for_command(cls, command)}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_schema_setting_or_the_commands_own(command):
    flags, declared = _flags(COMMANDS_CLI[command]), _schema_flags(command)
    undeclared = set(flags) - set(declared) - COMMAND_ONLY[command]
    assert not undeclared, f"{command} has flags the schema does not declare: {sorted(undeclared)}"
    assert not COMMAND_ONLY[command] & set(declared), "a command-only flag is also a schema setting"
    missing = set(declared) - set(flags)
    assert not missing, f"the schema declares {sorted(missing)} for {command}, which lacks them"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_has_the_schemas_name_default_and_help(command):
    flags = _flags(COMMANDS_CLI[command])
    for name, (_cls, f) in _schema_flags(command).items():
        spec, option = option_spec(f, command), flags[name]
        assert option.name == key_of(f), name  # the kwarg is the YAML key (``lr``)
        if option.is_flag and not option.secondary_opts:
            assert spec["default"] is False, name  # an is_flag setting is off unless given
        else:
            assert option.default == _plain(spec["default"]), name
        assert option.help == spec["help"], name


def test_a_commands_own_default_says_why():
    with pytest.raises(ValueError, match="reason"):
        setting(1, resume="restored", commands=("plan",), overrides={"plan": {"default": 2}})
    for cls in (RunConfig, TrainConfig):
        for f in walk(cls):
            for command, changes in f.metadata["overrides"].items():
                assert "default" not in changes or changes["why"], (f.name, command)
    # one shape for every command, the run train runs (memfit.settings.defaults.SHAPE); the library's RunConfig()
    # keeps its own (256 x 8), which the estimator's golden numbers are computed at
    assert _flags(train_cli.command)["--seq-len"].default == TrainConfig().run.seq_len == 128
    assert _flags(estimate_cli.command)["--seq-len"].default == _flags(plan_cli.command)["--seq-len"].default == 128
    assert RunConfig().seq_len == 256


def test_data_preview_flags_are_train_settings():
    flags = set(_flags(data_cli.preview))
    assert flags - COMMAND_ONLY["data preview"] <= set(_schema_flags("train"))
    # the data group's flags in the schema's order, as train's --help lists them (they were listed reversed)
    reading = [flag_of(s) for s in in_group(TrainConfig, "data")]
    assert [f for f in _flags(data_cli.preview) if f in reading] == reading
    assert [f for f in _flags(train_cli.command) if f in reading] == reading


def test_every_field_is_a_setting_with_a_resume_rule_and_a_flag_validate_names():
    nested_classes = {f.metadata["nested"] for cls in (RunConfig, TrainConfig) for f in groups(cls)}
    assert nested_classes == {LoraSettings, DataReading, OptimSettings, CheckpointSettings, PreferenceSettings,
                              ModelSource, FolderSettings, RunLength, Cadence}
    for cls in (RunConfig, TrainConfig, *nested_classes):
        others = {f.name for f in dataclasses.fields(cls)} - {f.name for f in settings(cls)}
        held = {f.name for f in groups(cls)} | ({"run"} if cls is TrainConfig else set())
        assert others == held, "a field that is no setting and no nested group of settings"
    for cls in (RunConfig, TrainConfig):
        for s in walk(cls):
            assert s.metadata["resume"] in RESUME_RULES, s.path
            assert s.metadata["plan"] in (None, *PLAN_ROLES), s.path
            assert flag(s.key) == flag_of(s), s.path  # error sentences name the flag the user types


def test_nested_groups_keep_flags_keys_and_run_json_flat():
    """``RunConfig.lora`` and ``TrainConfig.preference`` are nested dataclasses; what a user types, writes in
    YAML and finds in run.json is the flat name it always was (``--lora-r``, ``lora_r``, ``--beta``)."""
    assert [s.path for s in in_group(RunConfig, "lora")] == [("lora", "r"), ("lora", "alpha"), ("lora", "dropout"),
                                                            ("lora", "targets")]
    assert [flag_of(s) for s in in_group(RunConfig, "lora")] == ["--lora-r", "--lora-alpha", "--lora-dropout",
                                                                "--lora-targets"]
    assert [s.key for s in in_group(TrainConfig, "preference")] == ["beta", "orpo_lambda", "simpo_gamma"]
    assert [s.key for s in in_group(TrainConfig, "optim")] == ["lr", "weight_decay", "warmup_steps", "max_grad_norm"]
    assert [s.key for s in in_group(TrainConfig, "checkpoints")] == ["save_every", "keep_last", "state_dict"]
    run = RunConfig.of(lora_r=8, lora_targets="q_proj,v_proj", seq_len=64)
    assert run.lora == LoraSettings(r=8, targets=("q_proj", "v_proj")) and run.seq_len == 64
    assert run.to_flat()["lora_r"] == 8 and run.to_flat()["lora_targets"] == "q_proj,v_proj" and "lora" not in run.to_flat()
    assert run.replace(lora_alpha=32).lora.alpha == 32.0 and run.replace(lora_alpha=32).lora.r == 8
    assert RunConfig.from_flat(run.to_flat()) == run
    with pytest.raises(TypeError, match="lora_rank"):
        RunConfig.of(lora_rank=8)  # a key that is no setting is refused as a constructor refuses it
    with pytest.raises(UserError, match="--lora-alpha must be a finite positive number"):
        LoraSettings(alpha=0)  # a group checks its own values, in the flag's words
    with pytest.raises(UserError, match=r"RunConfig.lora must be of type LoraSettings \(or give its settings by key"):
        RunConfig(lora={"r": 8})  # a plain dict would fail later, deep in a run
    with pytest.raises(UserError, match="TrainConfig.optim must be of type OptimSettings"):
        TrainConfig(optim=3e-4)
    config = TrainConfig.from_flat({"beta": 0.3, "lora_r": 4, "lr": "1e-3", "save_every": 5})
    assert config.preference == PreferenceSettings(beta=0.3) and config.run.lora.r == 4
    assert config.optim.lr == 1e-3 and config.checkpoints.save_every == 5
    assert config.to_flat()["beta"] == 0.3 and "preference" not in config.to_flat()


#: TrainConfig's groups of issue 23 (model, run folder, length, cadence): field -> (class, the flat keys in order)
TRAIN_GROUPS = {
    "source": (ModelSource, ["model", "tokenizer", "revision", "trust_remote_code", "allow_pickle_weights", "init"]),
    "folder": (FolderSettings, ["output", "resume", "overwrite", "extend_schedule", "allow_data_change"]),
    "length": (RunLength, ["max_steps", "epochs"]),
    "cadence": (Cadence, ["eval_every", "log_every", "samples", "eval_samples"]),
}


@pytest.mark.parametrize("field_name", TRAIN_GROUPS)
def test_the_model_folder_length_and_cadence_groups_keep_flags_and_keys_flat(field_name, tmp_path):
    """``TrainConfig.source``/``.folder``/``.length``/``.cadence`` are nested dataclasses; their flags, YAML keys
    and run.json keys are the flat names they always were (``--output``, ``output``), reached by key."""
    cls, keys = TRAIN_GROUPS[field_name]
    settings_ = [s for s in walk(TrainConfig) if s.path[0] == field_name]
    assert [s.key for s in settings_] == keys and {s.path for s in settings_} == {(field_name, k) for k in keys}
    assert [flag_of(s) for s in settings_] == ["--" + k.replace("_", "-") for k in keys]  # no prefix
    train_flags = _flags(train_cli.command)
    assert all(train_flags[flag_of(s)].name == s.key for s in settings_)  # train's option, its kwarg the key
    values = {"model": str(tmp_path / "m"), "tokenizer": "byte", "revision": None, "trust_remote_code": True,
              "allow_pickle_weights": True, "init": "random", "output": str(tmp_path / "out"), "resume": True,
              "overwrite": True, "extend_schedule": True, "allow_data_change": True, "max_steps": 7, "epochs": 2,
              "eval_every": 3, "log_every": 2, "samples": 1, "eval_samples": 4}
    given = {k: values[k] for k in keys}
    config = TrainConfig.of(**given)
    assert getattr(config, field_name) == cls(**given)  # of() by key builds the group
    flat = config.to_flat()
    assert {k: flat[k] for k in keys} == given and field_name not in flat  # run.json's settings stay flat
    assert TrainConfig.from_flat(flat) == config  # and are read back by the same keys
    other = {"init": "pretrained", "allow_data_change": False, "epochs": 5, "eval_samples": 0}[keys[-1]]
    changed = getattr(config.replace(**{keys[-1]: other}), field_name)  # one setting by key, the rest kept
    assert changed == dataclasses.replace(getattr(config, field_name), **{keys[-1]: other})
    with pytest.raises(UserError, match=f"TrainConfig.{field_name} must be of type {cls.__name__}"):
        TrainConfig(**{field_name: given})  # a plain dict would fail later, deep in a run
    assert TrainConfig.keys()[keys[0]] == f"{field_name}.{keys[0]}"


def test_the_groups_check_their_values_in_the_flags_words(tmp_path):
    """The checks ``validate.check_train`` made on the flat config hold on the groups, in the same words."""
    with pytest.raises(UserError, match=re.escape("--model must name a preset or a model folder, got nothing.")):
        TrainConfig.of(model=None)
    with pytest.raises(UserError, match=re.escape("--max-steps must be a positive whole number, got 0.")):
        RunLength(max_steps=0)
    with pytest.raises(UserError, match=re.escape("--eval-every must be 0 or a positive whole number, got -1.")):
        TrainConfig.of(eval_every=-1)
    assert FolderSettings(output="~/runs/x").output == str(pathlib.Path("~/runs/x").expanduser())
    with pytest.raises(UserError, match="--output"):
        TrainConfig.of(output=str(tmp_path / ("x" * 300)))  # a name the file system refuses
    result = CliRunner().invoke(cli, ["train", "--extend-schedule", "--output", str(tmp_path / "o")])
    assert result.exit_code == 1 and "--extend-schedule continues a finished run past its end and needs --resume" \
        in result.output, result.output


def test_resumes_rules_name_only_settings_and_come_from_the_schema():
    keys = set(TrainConfig.keys())
    named = resume.SAFE | resume.LENGTH | resume.NOT_RESTORED
    assert named <= keys, f"resume names what is no setting: {sorted(named - keys)}"
    assert resume.LENGTH <= resume.SAFE and not resume.SAFE & resume.NOT_RESTORED
    # the examples the rules are written for
    assert {"micro_batch", "grad_accum", "eval_every", "state_dict"} <= resume.SAFE
    assert {"lora_r", "optimizer", "lr", "seq_len", "dtype"}.isdisjoint(resume.SAFE | resume.NOT_RESTORED)
    assert {"trust_remote_code", "allow_pickle_weights", "output", "resume"} <= resume.NOT_RESTORED
    # what a checkpoint saves (run.json's "settings") is settings only, read back by the same keys
    saved = resume.settings(TrainConfig(), RunConfig())
    assert set(saved) <= keys and "lr" in saved and "optimizer_lr" not in saved


def test_the_yaml_keys_train_accepts_are_the_schemas(tmp_path):
    keys = TrainConfig.keys()
    assert set(keys) == {s.key for cls in (TrainConfig, RunConfig) for s in walk(cls)}
    config = TrainConfig.of(lr=3e-4, max_steps=7, run=RunConfig.of(lora_r=8, lora_dropout=0.1))
    assert TrainConfig.from_flat(config.to_flat()) == config  # every key round-trips
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora_dropuot: 0.1\nmax_steps: 1\n")
    result = CliRunner().invoke(cli, ["train", "--config", str(bad)])
    assert result.exit_code == 1
    assert "Unknown setting(s) in config: lora_dropuot (did you mean lora_dropout?)." in result.output


def test_the_planners_constraints_are_the_searched_settings():
    names = [f.name for f in dataclasses.fields(Constraints)]
    assert names[:len(searched(RunConfig))] == [s.key for s in searched(RunConfig)]  # lora_r: the flat key
    assert set(names) - {s.key for s in searched(RunConfig)} == {"full", "allow_quantize", "allow_offload",
                                                                   "host_memory"}
    assert {s.key for s in walk(RunConfig) if s.metadata["plan"] == "given"} == {"seq_len", "num_processes", "nodes", "method"}
    hints = typing.get_type_hints(Constraints)  # an ordinary dataclass, each pin typed as its setting or None
    assert {s.key: hints[s.key] for s in searched(RunConfig)} == \
        {s.key: typing.get_type_hints(s.owner)[s.name] | None for s in searched(RunConfig)}
    assert all(getattr(Constraints(), s.key) is None for s in searched(RunConfig))
    pinned = Constraints.from_flat({"lora-dropout": 0.1, "dtype": "BF16", "seq_len": 64})
    assert pinned.lora_dropout == 0.1 and pinned.dtype.value == "bf16" and pinned.micro_batch is None


def test_a_check_from_the_schema_names_the_flag_everywhere(tmp_path):
    """``lora_dropout``'s check (``frac``) refuses the same value from the CLI, a YAML file and a library call."""
    sentence = "--lora-dropout must be a number in [0, 1), got 1."
    with pytest.raises(UserError, match=re.escape(sentence)):
        RunConfig.of(lora_dropout=1.0)
    for command, args in (("estimate", ["tiny"]), ("train", [])):
        result = CliRunner().invoke(cli, [command, *args, "--lora-r", "4", "--lora-dropout", "1"])
        assert result.exit_code == 1 and sentence in result.output, result.output
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lora_r: 4\nlora_dropout: 1\n")
    result = CliRunner().invoke(cli, ["train", "--config", str(cfg)])
    assert result.exit_code == 1 and sentence in result.output, result.output


@pytest.mark.parametrize(("key", "value", "flag_name", "choices"), [
    ("state_dict", "fulll", "--state-dict", "sharded, full"),
    ("init", "zeros", "--init", "pretrained, random"),
    ("tracker", "tensorbord", "--tracker", "tensorboard, wandb, mlflow, trackio, aim"),
])
def test_a_yaml_value_outside_a_settings_choices_is_refused(tmp_path, key, value, flag_name, choices):
    """click checks a flag's choices; the same value from a ``--config`` file or a library call was accepted
    (``TrainConfig.from_flat({"state_dict": "foo"})`` built a config). Now refused in one sentence, nothing written."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{key}: {value}\nmax_steps: 1\n")
    result = CliRunner().invoke(cli, ["train", "--config", str(cfg), "--output", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert f"Unknown {flag_name} '{value}'; choose one of: {choices}." in result.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=f"Unknown {flag_name}"):
        TrainConfig.of(**{key: value})

"""Hub ids (org/name) in train, estimate, plan and data preview, offline, from a real Hugging Face cache
built here (``models--org--name/{blobs,snapshots/<commit>,refs/main}``, as huggingface_hub writes it);
and outputs that load from any directory (the adapter names its base by Hub id or absolute path)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from _train_helpers import TINY_LLAMA, assert_one_sentence, write_qa
from memfit.cli import cli
from memfit.errors import UserError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FAST = ["--tokenizer", "byte", "--seq-len", "64", "--micro-batch", "4", "--eval-every", "0", "--samples", "0",
        "--packing", "none"]


def tiny_model_folder(folder: Path, *, pickle: bool = False) -> Path:
    """A 2-layer hidden-64 Llama with memfit's byte tokenizer, saved as a checkpoint folder (``pickle``: its
    weights as pytorch_model.bin only, like an old repository)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.data.dataset import byte_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}))
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    if pickle:
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    return folder


def put_in_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Copy ``source``'s files into the Hub cache layout huggingface_hub reads: content-addressed blobs, a
    snapshot folder of symlinks to them named by the commit, and ``refs/<ref>`` holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in source.iterdir():
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, model_source):
    """An offline Hugging Face cache holding ``org/tiny`` at ``COMMIT`` (huggingface_hub and transformers
    read ``constants.HF_HUB_CACHE`` at call time; the environment is set for child processes too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    put_in_cache(cache, "org/tiny", model_source)
    return cache


def test_the_cache_layout_is_what_huggingface_hub_reads(hub_cache):
    """The fixture is a real cache: huggingface_hub's own offline look-up finds the snapshot."""
    from huggingface_hub import snapshot_download

    path = Path(snapshot_download("org/tiny", local_files_only=True))
    assert path == hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert (path / "model.safetensors").is_file()


def test_train_a_hub_model_offline_then_resume_and_load_the_adapter_anywhere(hub_cache, tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = ["train", "--model", "org/tiny", "--lora-r", "4", "--data", write_qa(tmp_path), *FAST,
            "--max-steps", "2", "--output", str(out), "--merge"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "org/tiny" in result.output and COMMIT[:12] in result.output  # the preamble and summary name it
    run = json.loads((out / "run.json").read_text())
    assert run["hub"]["id"] == "org/tiny" and run["hub"]["commit"] == COMMIT
    assert run["settings"]["model"] == "org/tiny" and run["settings"]["revision"] == COMMIT  # pinned for --resume
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/tiny" and adapter["revision"] == COMMIT

    resumed = CliRunner().invoke(cli, ["train", "--output", str(out), "--resume", "--max-steps", "3",
                                       "--extend-schedule"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((out / "run.json").read_text())["steps"] == 3

    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert AutoPeftModelForCausalLM.from_pretrained(out).peft_config["default"].base_model_name_or_path == "org/tiny"
    AutoModelForCausalLM.from_pretrained(out / "merged")


def test_estimate_plan_and_data_preview_accept_a_hub_id(hub_cache, tmp_path):
    estimate = CliRunner().invoke(cli, ["estimate", "org/tiny", "--seq-len", "64", "--json"])
    assert estimate.exit_code == 0, estimate.output
    assert json.loads(estimate.output)["model"] == "org/tiny"
    plan = CliRunner().invoke(cli, ["plan", "org/tiny", "--revision", "main", "--budget", "1GiB", "--seq-len", "64",
                                    "--batch", "4", "--json"])
    assert plan.exit_code == 0, plan.output
    assert "--model org/tiny --revision main" in json.loads(plan.output)["launch"]
    preview = CliRunner().invoke(cli, ["data", "preview", "--model", "org/tiny", "--data", write_qa(tmp_path)])
    assert preview.exit_code == 0, preview.output
    assert "with loss" in preview.output


def test_a_hub_id_not_in_the_offline_cache_is_one_sentence_and_leaves_no_run_folder(hub_cache, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--model", "org/missing", "--data", write_qa(tmp_path), *FAST,
                                      "--output", str(out)])
    assert_one_sentence(result, "'org/missing' is not a local folder, and the Hugging Face cache")
    assert "HF_HUB_OFFLINE" in result.output
    assert not out.exists()
    estimate = CliRunner().invoke(cli, ["estimate", "org/missing"])
    assert_one_sentence(estimate, "does not hold it while HF_HUB_OFFLINE is set")


def test_online_a_fully_cached_model_is_taken_from_the_cache_without_asking_the_hub(hub_cache, monkeypatch):
    """Issue 34: online but unable to reach the Hub, a cached model cost 80 s of "Retrying in 1s" before training.
    The calls to huggingface_hub are counted (``local_files_only`` or not):
    a complete snapshot is used at once and says so; MEMFIT_HUB_REFRESH=1 asks the Hub anyway."""
    import huggingface_hub
    from huggingface_hub import constants

    from memfit.integrations import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    asked = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: (asked.append(k.get("local_files_only", False)), real(*a, **k))[1])
    model = hub.fetch("org/tiny", files="model")
    assert model.cached and model.commit == COMMIT and asked == [True]
    assert "(the cached snapshot, the Hub not asked; MEMFIT_HUB_REFRESH=1" in model.describe()
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request fails at once
    monkeypatch.setenv("MEMFIT_HUB_REFRESH", "1")
    refreshed = hub.fetch("org/tiny", files="model")  # asked (and, unanswered, huggingface_hub falls back on the cache)
    assert asked[-1] is False and not refreshed.cached


def test_a_cached_config_alone_is_not_the_weights_train_needs(hub_cache, tmp_path, monkeypatch):
    """The cache-first lookup checks completeness: a snapshot holding only config.json (what ``estimate`` fetches)
    serves ``config`` but not ``model``, for which the Hub is asked (here: offline, so the one sentence)."""
    import shutil

    from huggingface_hub import constants

    from memfit.integrations import hub

    snapshot = next((hub_cache / "models--org--tiny" / "snapshots").iterdir())
    for path in snapshot.iterdir():
        if path.name != "config.json":
            path.unlink()
    shutil.rmtree(hub_cache / "models--org--tiny" / "blobs", ignore_errors=True)
    (hub_cache / "models--org--tiny" / "blobs").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hub.cached_snapshot("org/tiny", None, "config", ["config.json"]) is None  # its blob is gone too: a dangling link
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert hub.cached_snapshot("org/tiny", None, "config", ["config.json"]) == snapshot
    assert hub.cached_snapshot("org/tiny", None, "model", list(hub.PATTERNS["model"])) is None


def test_an_unknown_revision_is_one_sentence(hub_cache, tmp_path):
    result = CliRunner().invoke(cli, ["train", "--model", "org/tiny", "--revision", "v9", "--data", write_qa(tmp_path),
                                      *FAST, "--output", str(tmp_path / "run")])
    assert_one_sentence(result, "does not hold its revision 'v9'")
    assert not (tmp_path / "run").exists()
    local = CliRunner().invoke(cli, ["estimate", "tiny", "--revision", "v9"])
    assert_one_sentence(local, "--revision picks a version of a Hugging Face Hub model")


def test_pickle_only_weights_need_allow_pickle_weights(hub_cache, tmp_path):
    put_in_cache(hub_cache, "org/old", tiny_model_folder(tmp_path / "old", pickle=True))
    args = ["train", "--model", "org/old", "--data", write_qa(tmp_path), *FAST, "--max-steps", "1",
            "--output", str(tmp_path / "run")]
    refused = CliRunner().invoke(cli, args)
    assert_one_sentence(refused, "has its weights only as PyTorch pickles (pytorch_model.bin)")
    assert "--allow-pickle-weights" in refused.output and not (tmp_path / "run").exists()
    allowed = CliRunner().invoke(cli, [*args, "--allow-pickle-weights"])
    assert allowed.exit_code == 0, allowed.output


def _http_error(cls, status: int):
    import httpx2

    response = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))
    return cls("hub says no", response=response)


@pytest.mark.parametrize("make, expected", [
    (lambda e: _http_error(e.GatedRepoError, 403), "is a gated model: accept its terms"),
    (lambda e: _http_error(e.RepositoryNotFoundError, 404), "nor a model on the Hugging Face Hub"),
    (lambda e: _http_error(e.RevisionNotFoundError, 404), "has no revision 'v9'"),
    (lambda e: _http_error(e.HfHubHTTPError, 503), "answered 503"),
    (lambda e: OSError(errno.ENOSPC, "No space left on device"), "The disk filled up while downloading"),
])
def test_online_failures_are_one_sentence_each(monkeypatch, make, expected):
    """What huggingface_hub raises online (gated, not found, bad revision, server error, disk full)."""
    import huggingface_hub
    from huggingface_hub import errors

    from memfit.integrations import hub

    def failing(*args, **kwargs):
        raise make(errors)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(UserError) as caught:
        hub.fetch("org/x", "v9")
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_download_bars_are_off_for_json_and_restored_after():
    from huggingface_hub.utils import are_progress_bars_disabled

    from memfit.integrations import hub

    assert not are_progress_bars_disabled()
    with hub.progress_bars(False):
        assert are_progress_bars_disabled()
    assert not are_progress_bars_disabled()
    with hub.progress_bars(True):
        assert not are_progress_bars_disabled()


def test_a_local_lora_adapter_and_merge_load_from_another_directory(tmp_path, monkeypatch):
    """A relative --model: the adapter still names its base absolutely, so it loads from anywhere."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    tiny_model_folder(tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["train", "--model", "ckpt", "--lora-r", "4", "--data", write_qa(tmp_path),
                                      *FAST, "--max-steps", "2", "--output", "run", "--merge"])
    assert result.exit_code == 0, result.output
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "ckpt").resolve())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    AutoPeftModelForCausalLM.from_pretrained(tmp_path / "run")
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged")

"""Hugging Face Hub models by id: ``org/name`` (and a revision) -> a local snapshot folder.

``huggingface_hub.snapshot_download`` does the work and owns the rules: its cache (``HF_HUB_CACHE``, or
``HF_HOME``/hub, default ``~/.cache/huggingface/hub``), ``HF_TOKEN`` for gated and private repositories,
``HF_HUB_OFFLINE`` (then only the cache is read). memfit decides only which files a command needs
(``PATTERNS``), refuses pickled weights unless the user allows them, and turns every failure into one
sentence. estimate, plan, data preview and train all come here, so a Hub id means the same everywhere.
"""

# Inside functions: huggingface_hub's download API (0.3 s to import; python -X importtime, 2026-12-06, this shared 2-core machine), only when a Hub id is resolved.
from __future__ import annotations

import errno
import json
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.files import user_path

CONFIG = ("config.json",)
#: Tokenizer, chat template and generation settings: tokenizer.json, tokenizer_config.json,
#: special_tokens_map.json, vocab.json + merges.txt, SentencePiece's tokenizer.model, chat_template.jinja,
#: generation_config.json; the config and a sharded checkpoint's index are JSON too.
TOKENIZER = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
SAFE_WEIGHTS = ("*.safetensors",)
#: Pickles run code when unpickled: fetched and loaded only with ``--allow-pickle-weights``.
PICKLE_WEIGHTS = ("*.bin", "*.pt")
#: A model's own Python code (``auto_map``), fetched only with ``--trust-remote-code``.
CODE = ("*.py",)
#: ``from_pretrained(folder)`` reads the top level only: no copies in subfolders (``onnx/``, ``original/``).
SUBFOLDERS = ("*/*",)
#: What each use needs: estimate/plan the config, data preview the tokenizer, train the weights too.
PATTERNS = {"config": CONFIG, "tokenizer": TOKENIZER, "model": TOKENIZER + SAFE_WEIGHTS}


@dataclass(frozen=True)
class HubModel:
    """A Hub model resolved to one commit in the local cache."""

    repo_id: str
    revision: str | None
    """The revision asked for (branch, tag or commit); None: the default branch."""
    commit: str
    """The commit it resolved to (the snapshot folder's name)."""
    path: Path
    """The snapshot folder in the Hugging Face cache: what transformers loads, like any local folder."""
    cached: bool = False
    """Taken from the cache without asking the Hub (``fetch``: the cache held every file the command needs)."""

    def describe(self) -> str:
        """The preamble's line: which commit of which repository, and where its files are."""
        asked = f"revision {self.revision} = " if self.revision and self.revision != self.commit else ""
        how = (" (the cached snapshot, the Hub not asked; MEMFIT_HUB_REFRESH=1 asks it for a newer commit)"
               if self.cached and not offline() else "")
        return f"{self.repo_id} from the Hugging Face Hub, {asked}commit {self.commit[:12]}, in {self.path}{how}"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.repo_id, "revision": self.revision, "commit": self.commit, "path": str(self.path)}


def is_hub_id(model: str) -> bool:
    """``org/name`` that is not a local path: a model to look up in the Hugging Face cache or on the Hub."""
    text = str(model)
    parts = text.split("/")
    return (len(parts) == 2 and all(parts) and not text.startswith((".", "~"))
            and not user_path(text).exists())


def cache_dir() -> str:
    """The folder huggingface_hub caches models in (read at call time: ``HF_HUB_CACHE``/``HF_HOME``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def fetch(repo_id: str, revision: str | None = None, *, files: str = "model", allow_pickle: bool = False,
          trust_remote_code: bool = False) -> HubModel:
    """The snapshot of ``repo_id`` at ``revision`` holding ``files`` (``config``, ``tokenizer`` or ``model``).

    Downloads what the cache lacks (nothing when ``HF_HUB_OFFLINE`` is set). ``model``: safetensors weights,
    or pickled ones only with ``allow_pickle``; a repository with pickles alone is refused in one sentence.

    Raises:
        UserError: offline with nothing cached, repository or revision not found, gated without access,
            disk full, no weights.
    """
    from huggingface_hub import snapshot_download

    patterns = list(PATTERNS[files])
    if files == "model" and allow_pickle:
        patterns += PICKLE_WEIGHTS
    if trust_remote_code:
        patterns += CODE
    refresh = offline() or os.environ.get("MEMFIT_HUB_REFRESH") == "1"  # offline: huggingface_hub reads the cache
    path = None if refresh else cached_snapshot(repo_id, revision, files, patterns)
    cached = path is not None
    if path is None:
        with _quiet_unless_tty(), _one_sentence(repo_id, revision):
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                          ignore_patterns=list(SUBFOLDERS)))
    model = HubModel(repo_id, revision, path.name, path, cached)
    if not (path / "config.json").is_file():
        raise UserError(f"{_name(model)} has no config.json in {_where()}, so it is not a transformers model"
                        + (" (or only part of it is cached and HF_HUB_OFFLINE is set)." if offline() else "."))
    if files == "model":
        _check_weights(model, allow_pickle)
    return model


def cached_snapshot(repo_id: str, revision: str | None, files: str, patterns: list[str]) -> Path | None:
    """The cached snapshot of ``repo_id`` at ``revision`` when it holds every file ``files`` needs, else None.

    Online, ``snapshot_download`` first asks the Hub which commit the revision is; with no network it retries
    for over a minute ("Retrying in 1s", 33 lines seen) before falling back to the cache. A model already in
    the cache needs no answer: its config, tokenizer or (for ``model``) every weight shard its index lists are
    there. huggingface_hub's own ``local_files_only`` lookup finds the snapshot; memfit checks completeness,
    which that lookup does not (a config fetched by ``estimate`` is not the weights ``train`` needs).
    """
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      ignore_patterns=list(SUBFOLDERS), local_files_only=True))
    except Exception:  # noqa: BLE001 - nothing usable cached (LocalEntryNotFoundError and the like): ask the Hub
        return None
    names = [p.name for p in path.iterdir() if p.is_file()]
    needs_config, needs_tokenizer = files in ("config", "model"), files in ("tokenizer", "model")
    tokenizer = any(name in names for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if (needs_config and "config.json" not in names) or (needs_tokenizer and not tokenizer):
        return None
    if files == "model":
        index = path / "model.safetensors.index.json"
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
        except (OSError, ValueError, KeyError, AttributeError):
            return None
        weights = tuple(p for p in patterns if p in SAFE_WEIGHTS + PICKLE_WEIGHTS)  # pickles only where allowed
        if not _matching(names, weights) or not shards <= set(names):
            return None
    return path


def local_folder(model: str, revision: str | None = None, *, files: str, trust_remote_code: bool = False) -> str:
    """``model`` itself, or for a Hub id the snapshot folder holding ``files``: where a local loader reads from."""
    check_revision(model, revision)
    if not is_hub_id(model):
        return model
    return str(fetch(model, revision, files=files, trust_remote_code=trust_remote_code).path)


def check_revision(model: str, revision: str | None) -> None:
    """Refuse ``--revision`` for a model that is not a Hub id (a preset or local folder has no revisions)."""
    if revision and not is_hub_id(model):
        raise UserError(f"--revision picks a version of a Hugging Face Hub model, but {model!r} is not a Hub id "
                        "(org/name); drop --revision.")


def _check_weights(model: HubModel, allow_pickle: bool) -> None:
    """Safetensors weights in the snapshot (or pickles, when allowed); else one sentence saying why not."""
    here = [p.name for p in model.path.iterdir() if p.is_file()]
    if _matching(here, SAFE_WEIGHTS) or (allow_pickle and _matching(here, PICKLE_WEIGHTS)):
        return
    listed = [name for name in _repo_files(model) if "/" not in name] or here
    pickles = _matching(listed, PICKLE_WEIGHTS)
    if pickles and not allow_pickle and not _matching(listed, SAFE_WEIGHTS):
        raise UserError(f"{_name(model)} has its weights only as PyTorch pickles ({pickles[0]}), which can run code "
                        "when loaded; pass --allow-pickle-weights if you trust this repository.")
    if offline():
        raise UserError(f"The Hugging Face cache holds {_name(model)} without its weights and HF_HUB_OFFLINE is set; "
                        "run once online to download them.")
    raise UserError(f"{_name(model)} has no model weights (*.safetensors) on the Hugging Face Hub.")


def _repo_files(model: HubModel) -> list[str]:
    """Every file of the repository at this commit, from huggingface_hub's cached tree listing (no network);
    empty when the cache has none (a cache written by another tool)."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:  # huggingface_hub < 1.x: no tree cache
        return []
    try:
        return [entry.path for entry in get_cached_repo_tree(model.repo_id, revision=model.commit)]
    except Exception:  # noqa: BLE001 - CachedRepoTreeNotFoundError and friends: no listing to consult
        return []


def _matching(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(fnmatchcase(n, p) for p in patterns))


def _name(model: HubModel) -> str:
    return model.repo_id + (f" (revision {model.revision})" if model.revision else "")


def _where() -> str:
    return f"the Hugging Face cache ({cache_dir()})"


@contextmanager
def _one_sentence(repo_id: str, revision: str | None):
    """huggingface_hub's exceptions as one ``UserError`` sentence each."""
    from huggingface_hub import errors

    name = repo_id + (f" (revision {revision})" if revision else "")
    try:
        yield
    except errors.GatedRepoError:
        raise UserError(f"{repo_id} is a gated model: accept its terms on https://huggingface.co/{repo_id} and set "
                        "HF_TOKEN to an access token of that account.") from None
    except errors.RepositoryNotFoundError:
        raise UserError(f"{repo_id!r} is neither a local folder nor a model on the Hugging Face Hub (for a private "
                        "model, set HF_TOKEN).") from None
    except errors.RevisionNotFoundError:
        raise UserError(f"{repo_id} has no revision {revision!r} (branch, tag or commit) on the Hugging Face "
                        "Hub.") from None
    except errors.LocalEntryNotFoundError as err:  # IncompleteSnapshotError included
        partly = isinstance(err, getattr(errors, "IncompleteSnapshotError", ()))
        held = ("holds only part of " if partly else "does not hold ") + (f"its revision {revision!r}" if revision
                                                                           else "it")
        if offline():
            raise UserError(f"{repo_id!r} is not a local folder, and {_where()} {held} while HF_HUB_OFFLINE is set; "
                            "run once without HF_HUB_OFFLINE to download it.") from None
        raise UserError(f"The Hugging Face Hub cannot be reached for {repo_id!r}, and {_where()} {held}; check the "
                        "connection (or a proxy) and try again.") from None
    except errors.HFValidationError:
        raise UserError(f"{repo_id!r} is not a valid Hugging Face model id (org/name) or revision.") from None
    except errors.HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None) or "an error"
        raise UserError(f"The Hugging Face Hub answered {status} for {name}; try again later.") from None
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise UserError(f"The disk filled up while downloading {name} into {_where()}; free space there or set "
                            "HF_HUB_CACHE to a folder on a larger disk.") from None
        raise


@contextmanager
def _quiet_unless_tty():
    """No download bars where nobody watches them (stderr not a terminal: a log file, CI, a pipe)."""
    with progress_bars(sys.stderr.isatty()):
        yield


@contextmanager
def progress_bars(show: bool):
    """huggingface_hub's progress bars (on stderr) as they are when ``show``, off otherwise (``--json``,
    other ranks); the previous state is restored after."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if show or are_progress_bars_disabled():
        yield
        return

    with warnings.catch_warnings():  # HF_HUB_DISABLE_PROGRESS_BARS=0 has priority; it warns and keeps them
        warnings.simplefilter("ignore")
        disable_progress_bars()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable_progress_bars()

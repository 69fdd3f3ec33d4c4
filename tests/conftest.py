"""Shared fixtures: tiny models built from a transformers config (never downloaded)."""

from __future__ import annotations

import os
import tempfile

import pytest

# Tests run on CPU, offline, deterministic, with few threads so the 2-core CI is not oversubscribed.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ACCELERATE_USE_CPU", "true")
# Derived activation recipes (memory/derive.py) are cached per test session, never in the user's ~/.cache.
os.environ.setdefault("MEMFIT_CACHE_DIR", tempfile.mkdtemp(prefix="memfit-test-recipes-"))


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test ends with the environment it started with. ``bench/_common.set_threads`` (the in-process
    dry runs of tests/test_bench.py) set ``OMP_NUM_THREADS=1`` for good, so every later ``memfit train`` of
    the session, and the documented demo's subprocess, chose its threads "from OMP_NUM_THREADS": the demo's
    doc check failed in CI after the suite and never alone."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def tiny_llama_config():
    """A 2-layer, hidden-64 Llama config with GQA (the test-size model)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="session")
def gloo_runs(request):
    """``{name: CaseRun}``: the 2-process cases of ``_gloo_cases`` that this session's tests ask for
    (``@pytest.mark.launch_cases(NAME, ...)``), run one after the other in ONE torchrun, started in the
    background when collection ends (``pytest_collection_finish``) so it overlaps the tests before."""
    if _GLOO_LAUNCH.get(request.session) is None:  # a session that started none (not expected): start now
        _start_gloo_launch(request.session)
    return _GLOO_LAUNCH[request.session].result()


_GLOO_LAUNCH: dict = {}


def _start_gloo_launch(session) -> None:
    """Write the wanted cases' inputs here (they seed torch: never in a thread beside running tests), then
    run their one torchrun in a thread: the launch itself is a subprocess."""
    import shutil
    import threading
    from concurrent.futures import Future
    from pathlib import Path

    import _gloo_cases
    from _launch_helpers import launch_cases

    wanted = {name for item in session.items for mark in item.iter_markers("launch_cases") for name in mark.args}
    future: Future = Future()
    _GLOO_LAUNCH[session] = future
    if not wanted:
        future.set_result({})
        return
    root = Path(tempfile.mkdtemp(prefix="memfit-gloo-cases-"))
    session.config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    cases = _gloo_cases.build(sorted(wanted), root)

    def launch():
        try:
            future.set_result(launch_cases(cases, root))
        except BaseException as exc:  # noqa: BLE001 - raised in the tests that read the launch
            future.set_exception(exc)

    threading.Thread(target=launch, daemon=True, name="gloo-cases").start()


def _doc_train_argv(item) -> list[str] | None:
    """The argv of a ``tests/test_docs.py`` case that runs ``memfit train``, else None."""
    callspec = getattr(item, "callspec", None)
    if item.module.__name__ != "test_docs" or callspec is None:
        return None
    argv = callspec.params.get("argv")
    return argv if argv and argv[0] == "train" else None


def pytest_collection_modifyitems(config, items):
    """The documented train runs' checks go last, so their background runs (below) overlap the suite."""
    items.sort(key=lambda item: _doc_train_argv(item) is not None)  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Start the shared 2-process launch and the documented train runs (``tests/_doc_train_runs.py``, longest
    first) in the background: they are subprocesses, and overlap the tests that run meanwhile."""
    if session.config.option.collectonly:
        return
    _start_gloo_launch(session)
    argvs = [argv for item in session.items if (argv := _doc_train_argv(item)) is not None]
    if argvs:
        from _doc_train_runs import TRAIN_OUTPUTS

        TRAIN_OUTPUTS.start(sorted(argvs, key=lambda argv: "--max-steps" in argv))  # the 300-step demo first


def pytest_sessionfinish(session):
    import sys

    """Stop what the background started and the session did not wait for (an early stop: -x, Ctrl-C)."""
    if "_doc_train_runs" in sys.modules:
        sys.modules["_doc_train_runs"].TRAIN_OUTPUTS.stop()
    if "_launch_helpers" in sys.modules:
        sys.modules["_launch_helpers"].stop_launches()

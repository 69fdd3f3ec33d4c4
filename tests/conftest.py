"""Shared fixtures: tiny models built from a transformers config (never downloaded)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Tests run on CPU, offline, deterministic, with few threads so the 2-core CI is not oversubscribed.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ACCELERATE_USE_CPU", "true")
# Derived activation recipes (memory/derive.py) are cached per test session, never in the user's ~/.cache:
# the process that starts the session makes the folder (its xdist workers inherit the variable, so they share
# it) and removes it when it exits.
if "MEMFIT_CACHE_DIR" not in os.environ:
    os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-test-recipes-")
    atexit.register(shutil.rmtree, os.environ["MEMFIT_CACHE_DIR"], ignore_errors=True)


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
    (``@pytest.mark.launch_cases(NAME, ...)``), run one after the other in ONE torchrun. On one process it
    starts in the background when collection ends (``pytest_collection_finish``), so it overlaps the tests
    before; on xdist the worker that runs their group (``_shared_group``, scheduled first) starts it here."""
    if _GLOO_LAUNCH.get(request.session) is None:
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
    """The argv of a ``tests/test_docs.py`` case that runs ``memfit train`` in a process of its own
    (``_doc_train_runs.OWN_PROCESS``), else None."""
    callspec = getattr(item, "callspec", None)
    if item.module.__name__ != "test_docs" or callspec is None:
        return None
    from _doc_train_runs import OWN_PROCESS

    argv = callspec.params.get("argv")
    return argv if argv and tuple(argv) in OWN_PROCESS else None


def _xdist(config) -> bool:
    """Whether the session runs on pytest-xdist workers (pyproject's ``-n auto --dist loadgroup``): true in
    the controller and in each worker."""
    return hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None) not in (None, 0)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: conftest loads without xdist too
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may use, at most 4 (each holds torch and its models)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux: affinity
    return max(1, min(cores, 4))


def pytest_configure(config):
    """On an xdist worker, torch runs one thread: the workers already fill the cores, and two threads per
    worker would have torch's OpenMP threads spin on a core another worker needs."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)


def _shared_group(item) -> str | None:
    """The xdist group of a test that must share its worker with others: the 2-process cases' tests read one
    launch (``gloo_runs``, a session fixture: built once per worker that asks for it), a doc's commands run
    in one scratch folder in order, and the tests of a module or class fixture share what it builds (a
    launch, a trained run)."""
    if any(item.iter_markers("launch_cases")):
        return "gloo-launch"
    callspec = getattr(item, "callspec", None)
    if item.module.__name__ == "test_docs" and callspec is not None and _doc_train_argv(item) is None:
        return "docs:" + callspec.params["where"]  # a doc's `$ cat FILE` reads what a command above it wrote
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if defs and defs[-1].scope in ("module", "class", "package"):
            return item.nodeid.split("::")[0]
    return None


def _xdist_order(item) -> int:
    """Longest work first, so that no long test starts last and ends the run alone: the shared 2-process
    launch, then the documented demo (a 300-step run), then the tests marked ``heavy`` and the docs that show
    ``memfit train`` (a budget run: a minute), then the rest."""
    if any(item.iter_markers("launch_cases")):
        return 0
    if _doc_train_argv(item) is not None:
        return 1
    callspec = getattr(item, "callspec", None)
    trains = item.module.__name__ == "test_docs" and callspec is not None and callspec.params["argv"][0] == "train"
    return 2 if trains or any(item.iter_markers("heavy")) else 3


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """On xdist workers: the tests that share a launch or a module's fixture go to one worker, longest work
    first (``--dist loadgroup --no-loadscope-reorder`` keeps this order). On one process: the documented
    train runs' checks go last, so their background runs (below) overlap the suite."""
    if _xdist(config):
        for item in items:
            group = _shared_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
        items.sort(key=_xdist_order)  # stable: the rest keep their order
        return
    items.sort(key=lambda item: _doc_train_argv(item) is not None)


def pytest_collection_finish(session):
    """On one process, start the shared 2-process launch and the documented train runs in their own process
    (``tests/_doc_train_runs.py``) in the background: they are subprocesses, and overlap the tests that run
    meanwhile. On xdist workers the other worker overlaps them: each starts when its first test asks."""
    if session.config.option.collectonly or _xdist(session.config):
        return
    _start_gloo_launch(session)
    argvs = [argv for item in session.items if (argv := _doc_train_argv(item)) is not None]
    if argvs:
        from _doc_train_runs import TRAIN_OUTPUTS

        TRAIN_OUTPUTS.start(argvs)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test ends with torch's thread count it started with: an in-process ``memfit train`` sets it for the
    process (``training/threads.py``), and a later test on the same worker must not inherit it."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


def pytest_sessionfinish(session):
    """Stop what the background started and the session did not wait for (an early stop: -x, Ctrl-C)."""
    import sys

    if "_doc_train_runs" in sys.modules:
        sys.modules["_doc_train_runs"].TRAIN_OUTPUTS.stop()
    if "_launch_helpers" in sys.modules:
        sys.modules["_launch_helpers"].stop_launches()

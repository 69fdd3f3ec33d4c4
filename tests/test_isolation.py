"""Tests do not leak environment variables into the tests after them (``conftest._environment_restored``).

A leaked ``OMP_NUM_THREADS=1`` (set by bench/_common.set_threads in test_bench's in-process dry runs) made
every later ``memfit train`` of the session choose its threads "from OMP_NUM_THREADS", and the README demo's
doc check failed in CI after the suite while it passed alone. The two tests run in this order (file order).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The second test reads what the first recorded: on xdist workers both run on one worker, in file order.
pytestmark = pytest.mark.xdist_group("tests/test_isolation.py")

PROBE = "MEMFIT_TEST_ISOLATION_PROBE"
BEFORE: dict[str, str | None] = {}


def test_a_test_sets_environment_variables():
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import _common  # bench/_common.py, as test_bench's dry runs use it

    BEFORE["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS")
    threads = torch.get_num_threads()
    os.environ[PROBE] = "set by the test before"
    _common.set_threads(1)
    torch.set_num_threads(threads)
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_the_next_test_does_not_see_them():
    assert PROBE not in os.environ
    assert os.environ.get("OMP_NUM_THREADS") == BEFORE["OMP_NUM_THREADS"]

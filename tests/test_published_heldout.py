"""Published peak memory memfit was never tuned on stays a sound, separate, explained set.

``bench/published_heldout.yaml`` holds figures from other sources than ``bench/published_runs.yaml`` (see its header),
in the same schema; ``bench/published_check.py --runs`` prices them as it prices the main set. These tests hold the
file to the main set's validation (``published_check.problems``), keep it apart from the main set, and check that
every row is predicted and explained. No test asserts the errors: the set measures the estimator, it must not steer it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import published_check as pc  # noqa: E402

HELDOUT = BENCH / "published_heldout.yaml"


def _figure(run: dict) -> tuple[str, float]:
    """A published figure, whatever commit its address pins: the file it is read from and the number."""
    return re.sub(r"/blob/[0-9a-f]{40}/", "/blob/<commit>/", run["source"]), round(float(run["published"]), 3)


def test_the_heldout_file_passes_the_main_sets_validation():
    assert pc.problems(HELDOUT) == []
    _, runs = pc.load(HELDOUT)
    assert len(runs) >= 15
    assert len({r["project"] for r in runs}) >= 4


def test_no_heldout_run_or_figure_is_in_the_main_set():
    """Held out means unseen: no id and no (source file, figure) pair of the main set comes back here."""
    _, main_runs = pc.load()
    _, held = pc.load(HELDOUT)
    main_ids = {r["id"] for r in main_runs} | {d["id"] for d in pc.dropped()}
    assert not main_ids & ({r["id"] for r in held} | {d["id"] for d in pc.dropped(HELDOUT)})
    assert not {_figure(r) for r in main_runs} & {_figure(r) for r in held}


def test_every_heldout_run_is_predicted_and_explained(tmp_path, capsys):
    """``--runs`` prices the held-out file as the main one: a prediction, a note and the summary for every run, and
    every dropped row with its reason."""
    out = tmp_path / "heldout.json"
    assert pc.main(["--runs", str(HELDOUT), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    _, runs = pc.load(HELDOUT)
    assert [r["id"] for r in data["rows"]] == [r["id"] for r in runs]
    assert all(r["predicted"] > 0 and r["note"].strip() for r in data["rows"])
    assert data["summary"]["runs"] == len(runs)
    assert printed.count("    note: ") == len(runs)
    assert all(f"dropped {d['id']}: " in printed for d in pc.dropped(HELDOUT))
    assert f"{len(runs)} runs from " in printed

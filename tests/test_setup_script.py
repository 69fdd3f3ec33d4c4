"""scripts/setup.sh keeps a user's torch: one older than pyproject.toml's floor is refused in one sentence, never
replaced (pip would pull another torch, a multi-GB CUDA build on most machines)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_older_torch_stops_set_up_with_one_sentence_and_installs_nothing(tmp_path):
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.5.1+cu124"\n')  # a CUDA build older than 2.6
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHONPATH": str(fake.parent), "MEMFIT_VENV": str(venv), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 1, done.stderr
    said = [line for line in done.stderr.splitlines() if "older than" in line]
    assert said == ["memfit setup: the torch found (2.5.1+cu124) is older than the 2.6 memfit needs; upgrade it with "
                    "your CUDA build's index, or run with PYTHON set to an interpreter without torch."]
    assert "Traceback" not in done.stderr and not (venv / ".memfit-installed").exists()

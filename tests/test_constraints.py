"""constraints.txt, the versions set-up installs (issue 34): what it pins, and the script that writes it.

``scripts/freeze_constraints.py`` is what ``scripts/newest_check.sh --freeze`` runs once a venv passed; the
file it writes must leave torch and torch's own requirements out (a user's GPU torch is kept: pip refuses
to resolve two pins of one package) and pin what the verified range says the suite ran on.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from memfit.integrations import versions

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = PIN.match(line)
        assert match, f"{path.name}: not a pin: {line!r}"
        pins[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
    return pins


def test_the_shipped_constraints_pin_the_verified_versions_and_leave_torch_out():
    pins = _pins(ROOT / "constraints.txt")
    assert "torch" not in pins and not any(name.startswith("nvidia-") for name in pins)
    assert "memfit" not in pins
    # the estimator's verified range holds the transformers set-up installs (else a fresh clone is off it)
    assert not versions.unverified({"transformers": pins["transformers"]}), pins["transformers"]
    for package in ("accelerate", "peft", "pytest", "pytest-xdist", "trl", "bitsandbytes"):
        assert package in pins, package


@pytest.mark.heavy  # pip freeze and a subprocess importing torch: ~10 s
def test_freeze_writes_this_venvs_versions_without_torch(tmp_path):
    out = tmp_path / "constraints.txt"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "freeze_constraints.py"), sys.executable, str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pins = _pins(out)
    assert done.stdout.strip() == f"{out}: {len(pins)} pins"
    assert "torch" not in pins and "typing-extensions" not in pins and "memfit" not in pins
    assert pins["transformers"] == metadata.version("transformers")
    assert pins["accelerate"] == metadata.version("accelerate")
    header = out.read_text().splitlines()[0]
    assert metadata.version("torch") in header and metadata.version("transformers") in header

"""Write constraints.txt: the versions installed in a venv that passed the suite, for ``scripts/setup.sh``.

Usage: ``python scripts/freeze_constraints.py VENV_PYTHON [OUT]`` (OUT defaults to constraints.txt). Reads
``pip freeze`` of that interpreter and leaves out torch, the packages torch itself requires (so a torch the
user already has, with its own pins, is never contradicted: ``pip`` would refuse to resolve) and memfit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import date
from pathlib import Path

#: torch and its own requirements (torch 2.13's metadata; CUDA builds add nvidia-* and triton).
TORCH_OWN = {"torch", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "setuptools", "sympy", "mpmath",
             "typing-extensions", "triton", "pip", "wheel", "memfit"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(python: str, out: str = "constraints.txt") -> None:
    frozen = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    versions = subprocess.run([python, "-c", "import torch, transformers; print(torch.__version__, "
                               "transformers.__version__)"], capture_output=True, text=True, check=True).stdout.split()
    pins = sorted((line for line in frozen if "==" in line
                   and canonical(line.split("==")[0]) not in TORCH_OWN
                   and not canonical(line).startswith("nvidia-")), key=lambda line: canonical(line))
    header = [f"# The versions memfit's test suite passed on ({date.today().isoformat()}; torch {versions[0]}, "
              f"transformers {versions[1]}): scripts/setup.sh installs with -c {Path(out).name}.",
              "# Written by scripts/freeze_constraints.py from a venv set up with every extra CI tests; torch and its",
              "# own requirements are left out so a torch you already have is kept. Move it only after",
              "# scripts/newest_check.sh passes (README, \"Versions\")."]
    Path(out).write_text("\n".join(header + pins) + "\n")
    print(f"{out}: {len(pins)} pins")


if __name__ == "__main__":
    main(*sys.argv[1:])

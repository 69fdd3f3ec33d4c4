#!/usr/bin/env bash
# Set up memfit in ./.venv with the package versions its test suite was verified on.
#
# - constraints.txt pins every package set-up installs (transformers, accelerate, PEFT, TRL, bitsandbytes,
#   datasets, ... and theirs) to the versions the suite passed on, so a fresh clone tests what CI tested,
#   whatever PyPI released since. pyproject.toml keeps ranges, for installing memfit into your own
#   environment. `bash scripts/newest_check.sh` tries the newest releases instead (README, "Versions").
# - torch is not pinned there, and neither are its own dependencies: a torch the interpreter already has
#   (a CUDA build, say) is kept. When `$PYTHON -c "import torch"` works, the venv sees the interpreter's
#   site-packages and pip installs nothing over that torch; otherwise the venv is isolated (nothing the
#   machine happens to have leaks in) and gets $TORCH_SPEC: torch==2.13.0, on this project's machines the
#   CPU wheel lying on disk (elsewhere set TORCH_SPEC, e.g. with a CPU index in PIP_INDEX_URL). A torch found
#   older than pyproject.toml's floor (2.6) stops set-up with one sentence instead of being replaced.
# - bitsandbytes (the `quant` extra: QLoRA and 8-bit AdamW, which run on the CPU too) requires
#   torch>=2.4,<3, so it never replaces the torch found or installed above.
# - MEMFIT_EXTRAS: the extras to install (default dev,tensorboard,quant,trl; CI adds the trackers).
#   MEMFIT_CONSTRAINTS: another constraints file, or "none" for the newest releases (newest_check.sh).
# Idempotent: a second run only checks (it reinstalls when pyproject.toml or the constraints changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${MEMFIT_EXTRAS:-dev,tensorboard,quant,trl}
CONSTRAINTS=${MEMFIT_CONSTRAINTS:-constraints.txt}
VENV=${MEMFIT_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "memfit setup: keeping the torch $PYTHON already has (venv with its site-packages)" >&2
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# A torch found but older than pyproject.toml's floor (2.6: FSDP2's public torch.distributed.fsdp) is not replaced
# behind the user's back (pip would pull another, a multi-GB CUDA build on most machines): say so and stop.
if "$VENV/bin/python" -c "import torch" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import sys, torch
sys.exit(tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]) < (2, 6))" >/dev/null 2>&1; then
  echo "memfit setup: the torch found ($("$VENV/bin/python" -c "import torch; print(torch.__version__)")) is older than" \
       "the 2.6 memfit needs; upgrade it with your CUDA build's index, or run with PYTHON set to an interpreter" \
       "without torch." >&2
  exit 1
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "memfit setup: installing $TORCH_SPEC" >&2
  "${PIP[@]}" "$TORCH_SPEC" 2> >(grep -v "is ignored: it is neither" >&2)
fi
PINS=()
if [ "$CONSTRAINTS" != none ]; then
  PINS=(-c "$CONSTRAINTS")
fi
STAMP="$VENV/.memfit-installed"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$EXTRAS $CONSTRAINTS" ] || [ pyproject.toml -nt "$STAMP" ] \
   || { [ "$CONSTRAINTS" != none ] && [ "$CONSTRAINTS" -nt "$STAMP" ]; }; then
  # (this machine's pip config names local wheel folders that may be missing: its warnings say nothing)
  "${PIP[@]}" "${PINS[@]}" -e ".[$EXTRAS]" 2> >(grep -v "is ignored: it is neither" >&2)
  # installed and importable (find_spec: importing PEFT imports bitsandbytes, whose CPU backend logs)
  "$VENV/bin/python" -c "import importlib.util as u, memfit; assert u.find_spec('accelerate') and u.find_spec('peft')" \
    && echo "$EXTRAS $CONSTRAINTS" > "$STAMP"
fi
# (the versions from package metadata: importing transformers imports bitsandbytes, whose CPU backend logs)
"$VENV/bin/python" -c "from importlib.metadata import version; import torch; print(f'memfit setup: torch '
  f'{torch.__version__}, transformers {version(\"transformers\")}, cuda={torch.cuda.is_available()}')" >&2

#!/usr/bin/env bash
# Set up memfit in ./.venv and keep any torch the machine already has.
#
# - The venv sees the system's site-packages, so a GPU build of torch that the user already
#   installed satisfies memfit's `torch>=2.5` and is kept (pip installs nothing over it).
# - With no torch at all, it installs torch==2.13.0: on this project's machines that is the CPU
#   wheel lying on disk; elsewhere set TORCH_SPEC (e.g. a CPU index via PIP_INDEX_URL) first.
# - bitsandbytes (the `quant` extra: QLoRA and 8-bit AdamW, which run on the CPU too) requires
#   torch>=2.4,<3, so it never replaces the torch found or installed above.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "memfit setup: installing $TORCH_SPEC" >&2
  "${PIP[@]}" "$TORCH_SPEC"
fi
if ! .venv/bin/python -c "import memfit, accelerate, peft, pytest, xdist, bitsandbytes, trl" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.memfit-installed ]; then
  "${PIP[@]}" -e ".[dev,tensorboard,quant,trl]" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  .venv/bin/python -c "import memfit, accelerate, peft, bitsandbytes" && touch .venv/.memfit-installed
fi
.venv/bin/python -c "import torch; print(f'memfit setup: torch {torch.__version__}, cuda={torch.cuda.is_available()}')" >&2

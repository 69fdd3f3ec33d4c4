#!/usr/bin/env bash
# The newest-releases check: does memfit still hold on what a fresh install resolves today?
#
# Builds a venv with the newest releases that resolve (set-up without constraints.txt, then torch,
# transformers, peft, accelerate, trl and bitsandbytes upgraded to their newest), prints what moved against
# constraints.txt, then runs the whole recipe matrix (tests/test_recipe_paths.py with -m "slow or not slow":
# analytic = --exact within 1% for SFT, DPO, ORPO and SimPO on both recipe paths, CPU and CUDA kernels)
# and the suite, and says what broke. Move the verified range (pyproject's [tool.memfit.verified],
# integrations/versions.py) and constraints.txt only when it passes:
#     bash scripts/newest_check.sh --freeze
# writes constraints.txt from the checked venv when both steps pass.
#
# VENV (default ${TMPDIR:-/tmp}/memfit-newest) is made anew; it is removed first only if an earlier run of this
# script made it (its .memfit-newest stamp). TORCH_SPEC: the torch to test, default "torch" (the newest
# release: a multi-GB CUDA build where PyPI has one); on this project's machines pip caps torch at the builds
# lying on disk. CHECK_EXTRAS: the extras installed (default dev,tensorboard,quant,trl).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FREEZE=0
if [ "${1:-}" = "--freeze" ]; then FREEZE=1; shift; fi
VENV=${1:-${TMPDIR:-/tmp}/memfit-newest}
if [ -e "$VENV" ]; then
  if [ -f "$VENV/.memfit-newest" ]; then rm -rf "$VENV"; else
    echo "newest_check: $VENV exists and was not made by this script; name another folder." >&2; exit 1; fi
fi
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
touch "$VENV/.memfit-newest"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" -U pip 2> >(grep -v "is ignored: it is neither" >&2)
"${PIP[@]}" -U "${TORCH_SPEC:-torch}" 2> >(grep -v "is ignored: it is neither" >&2)
MEMFIT_VENV="$VENV" MEMFIT_CONSTRAINTS=none MEMFIT_EXTRAS="${CHECK_EXTRAS:-dev,tensorboard,quant,trl}" \
  TORCH_SPEC="${TORCH_SPEC:-torch}" bash scripts/setup.sh
"${PIP[@]}" -U transformers peft accelerate trl bitsandbytes 2> >(grep -v "is ignored: it is neither" >&2)

echo "== versions (newest resolved vs constraints.txt)"
"$VENV/bin/python" - <<'EOF'
import re
from importlib import metadata
pinned = dict(re.match(r"([^=]+)==(.+)", line).groups() for line in open("constraints.txt")
              if "==" in line and not line.startswith("#"))
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pinned = {canon(k): v for k, v in pinned.items()}
for name in ("torch", "transformers", "peft", "accelerate", "trl", "bitsandbytes", "datasets", "tokenizers",
             "safetensors", "huggingface-hub", "kernels"):
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = "-"
    was = pinned.get(canon(name))
    print(f"  {name:<16} {have:<22} {'(not pinned: yours is kept)' if was is None else '' if have == was else 'moved from ' + was}")
EOF

status=0
echo "== the recipe matrix: both recipe paths against --exact, every setting"
"$VENV/bin/python" -m pytest -p no:cacheprovider -q -m "slow or not slow" tests/test_recipe_paths.py \
  tests/test_estimate_accuracy.py --durations=0 || status=1
echo "== the suite"
"$VENV/bin/python" -m pytest -p no:cacheprovider -q || status=1
if [ "$status" = 0 ]; then
  echo "newest_check: passed on the newest releases above."
  if [ "$FREEZE" = 1 ]; then "$VENV/bin/python" scripts/freeze_constraints.py "$VENV/bin/python" constraints.txt; fi
else
  echo "newest_check: FAILED on the newest releases above (the failures are listed); keep the verified range." >&2
fi
exit "$status"

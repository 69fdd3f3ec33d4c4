"""The library versions memfit's estimator is verified on, and a note when the installed ones differ.

The per-family activation recipes (``memory/activations.py``) and the logits terms were read off
transformers 5's modeling code and checked to the byte against the exact tracer on torch's
``FakeTensorMode``/``MemTracker``; the test suite runs on the versions below. Outside them the
modeling code may save other tensors, so every estimate says so (``notes``).
``pyproject.toml`` mirrors ``VERIFIED`` under ``[tool.memfit.verified]`` (a test keeps them equal).
"""

# Inside functions: packaging.version (0.03 s; python -X importtime, 2026-12-06, this shared 2-core machine): `memfit --help` imports this module (0.16 s in all).
from __future__ import annotations

from functools import cache, lru_cache
from importlib import metadata

MEMFIT = "0.1.0"
"""memfit's own version (``memfit.__version__``; ``pyproject.toml`` says the same), here, in a leaf, so that
what the package imports (e.g. ``training.finish``, which records it in run.json) can read it without a cycle."""

#: Package -> (lowest verified ``major.minor``, first ``major.minor`` not verified): a half-open range.
VERIFIED: dict[str, tuple[str, str]] = {
    "transformers": ("5.24", "5.26"),
    "torch": ("2.13", "2.15"),
}


@cache
def installed_version(package: str) -> str | None:
    """The installed distribution's version (cached: reading package metadata takes ~15 ms)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return ()


def unverified(installed: dict[str, str | None] | None = None) -> dict[str, str]:
    """Packages whose installed version lies outside ``VERIFIED``: name -> installed version.

    ``installed``: versions to judge instead of the installed ones (tests)."""
    if installed is None:
        installed = {package: installed_version(package) for package in VERIFIED}
    return dict(_outside(tuple(installed.items())))


@lru_cache(maxsize=16)
def _outside(installed: tuple[tuple[str, str | None], ...]) -> tuple[tuple[str, str], ...]:
    """Cached: every estimate asks, and parsing versions costs more than the estimate itself."""
    versions = dict(installed)
    out = []
    for package, (low, high) in VERIFIED.items():
        version = versions.get(package)
        if version is None:
            continue
        if not _major_minor(low) <= _major_minor(version) < _major_minor(high):
            out.append((package, version))
    return tuple(out)


def notes(installed: dict[str, str | None] | None = None) -> list[str]:
    """One note per package outside the verified range (empty when all are inside)."""
    return [f"{package} {version} is outside the range memfit's estimator is verified on "
            f"({package} >={VERIFIED[package][0]},<{VERIFIED[package][1]}); its modeling code may save other "
            "tensors, so check with --exact." for package, version in unverified(installed).items()]

"""Several cases in one multi-process launch (tests only; started by ``_launch_helpers.launch_cases``).

Under torchrun every rank runs the cases of a JSON file one after the other in the same process group: a
case is ``memfit`` CLI arguments (what ``python -m memfit ...`` runs) or a bench script with its arguments
(run as ``__main__``), with extra environment variables for its duration. Why: each launch costs two fresh
interpreters importing torch, transformers and accelerate, and a rendezvous, which on 2 CPU cores is most
of a tiny run's time; the cases themselves are what each test launched on its own before.

Each case's stdout and stderr (file descriptors 1 and 2, so C-level output too) go to
``NAME.rank{R}.out`` / ``.err`` beside the JSON file, and its exit code to ``codes.rank{R}.json``. memfit
train (and the benches) end with ``accelerator.end_training()``, which destroys the process group: here the
group outlives the cases and is destroyed once, at the end. A case that fails stops this rank at once
(``os._exit``): the other rank may be waiting in a collective, and torchrun ends it when this one exits.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def _memfit(argv: list[str]) -> int:
    """``python -m memfit ARGV``'s exit code, as click's standalone mode gives it, but an ``Aborted!`` (click's
    answer to an EOFError or KeyboardInterrupt inside the command) shows the traceback of what raised it."""
    import click

    from memfit.cli import cli

    try:
        cli.main(args=argv, prog_name="memfit", standalone_mode=False)
    except click.exceptions.Exit as stop:
        return stop.exit_code
    except click.ClickException as err:
        err.show()
        return err.exit_code
    except click.exceptions.Abort as abort:
        traceback.print_exception(abort.__cause__ or abort)
        return 1
    return 0


def _run(case: dict) -> int:
    if case["kind"] == "memfit":
        return _memfit(case["argv"])
    else:
        script = case["script"]
        sys.argv = [script, *case["argv"]]
        sys.path.insert(0, str(Path(script).parent))  # what `python script.py` puts first (bench imports)
        runpy.run_path(script, run_name="__main__")
    return 0


def run_case(case: dict, folder: Path, rank: int) -> int:
    """Run one case with its output in its own files; its exit code (1 for an uncaught exception).

    The ranks start it together, as torchrun's rendezvous starts a fresh launch: rank 0 finishes a run later
    than the others (it exports and samples), and a rank that starts the next run seconds ahead once read
    the other's half-written tokenized cache (datasets' Arrow file: "file seems not fully written")."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    argv, path, environ = list(sys.argv), list(sys.path), dict(os.environ)
    os.environ.update(case.get("env", {}))
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(folder / f"{case['name']}.rank{rank}.out", "w") as out, \
            open(folder / f"{case['name']}.rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = _run(case)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException:  # noqa: BLE001 - reported in the case's stderr, as a crashed process would
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sys.argv[:], sys.path[:] = argv, path
            os.environ.clear()
            os.environ.update(environ)
    gc.collect()  # the previous case's model and optimizer are gone before the next one measures memory
    return code


def main() -> None:
    cases_file = Path(sys.argv[1])
    cases = json.loads(cases_file.read_text())
    rank = int(os.environ.get("RANK", "0"))
    from accelerate.state import PartialState

    destroy = PartialState.destroy_process_group
    PartialState.destroy_process_group = lambda self, group=None: None  # kept for the next case
    codes: dict[str, int] = {}
    for case in cases:
        codes[case["name"]] = run_case(case, cases_file.parent, rank)
        (cases_file.parent / f"codes.rank{rank}.json").write_text(json.dumps(codes))
        if codes[case["name"]]:
            print(f"case {case['name']} exited {codes[case['name']]} on rank {rank}", file=sys.stderr, flush=True)
            os._exit(codes[case["name"]])
    destroy(PartialState())


if __name__ == "__main__":
    main()

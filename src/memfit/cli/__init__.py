"""The ``memfit`` command line: thin subcommands over the library API.

Subcommands are imported lazily so ``memfit --help`` does not load torch. A ``UserError`` raised
anywhere below becomes one line on stderr (``error: ...``) and exit code 1, without a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import signal
import sys

import click

from memfit import __version__, quiet_import_notices
from memfit.errors import UserError, printable

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("memfit.cli.train", "Train or fine-tune a causal LM on Accelerate and measure its memory."),
    "estimate": ("memfit.cli.estimate", "Where every byte of a training step goes (analytic or --exact)."),
    "plan": ("memfit.cli.plan", "The fastest configuration that fits a memory budget."),
    "data": ("memfit.cli.data", "Show a training record as the model sees it, loss mask marked (data preview)."),
    "serve": ("memfit.cli.serve", "The estimate and the plan as a local web page (the web extra)."),
    "presets": ("memfit.cli.presets", "List the architecture presets and the GPU table."),
}


class UserFacingError(click.ClickException):
    """A ``UserError`` as click shows it: one sentence, exit 1."""

    exit_code = 1

    def show(self, file=None) -> None:  # noqa: ARG002 - click's signature
        click.echo(f"error: {printable(self.message)}", err=True)  # values in it are the user's: escaped


INTERRUPTED = 130
"""The shell's exit status for a command stopped by SIGINT (128 + 2)."""


def _exiting_on_ctrl_c() -> None:
    """The command is stopping because of a Ctrl-C: one more while it exits (a second press, often while
    torch shuts down) would kill the process by SIGINT (status -2 to its parent) instead of exit 130 with
    the sentence that says where the run stands, so from here on SIGINT is ignored (a CLI process only)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, (module, _) in SUBCOMMANDS.items() if importlib.util.find_spec(module)]

    def get_command(self, ctx: click.Context, cmd_name: str):
        if cmd_name not in SUBCOMMANDS:
            return None
        module = importlib.import_module(SUBCOMMANDS[cmd_name][0])
        return module.command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        # resolved here, not at the top: memory.derive's 140 ms that `memfit --help` need not pay (-X importtime)
        from memfit import derivation_progress

        try:
            # bitsandbytes' and DeepSpeed's import-time notices off; a line on stderr before each recipe derivation
            with quiet_import_notices(), derivation_progress(lambda line: click.echo(f"memfit: {line}", err=True)):
                return super().invoke(ctx)
        except UserError as err:
            facing = UserFacingError(str(err))
            facing.exit_code = err.exit_code  # 130 for a Ctrl-C stop, 1 otherwise
            if err.exit_code == INTERRUPTED:
                _exiting_on_ctrl_c()
            raise facing from None
        except KeyboardInterrupt:  # a Ctrl-C outside a run's guard (or in its clean-up): click would exit 1
            _exiting_on_ctrl_c()
            facing = UserFacingError("Interrupted by Ctrl-C.")
            facing.exit_code = INTERRUPTED
            raise facing from None
        except click.ClickException as err:  # click's own "Invalid value for '--lr': ..." echoes the value
            err.message = printable(err.message)
            raise


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="memfit")
def cli() -> None:
    """memfit: train causal language models within the GPU memory you have.

    \b
    Examples:
      memfit train                                  # the demo: tiny model, shipped corpus
      memfit estimate llama-2-7b --mixed-precision no
      memfit estimate llama-3-8b --compare
      memfit plan qwen2.5-0.5b --budget 8GiB --seq-len 1024 --batch 32
      memfit train --model ./my-ckpt --data notes.jsonl --lora-r 16 --budget 24GiB
    """


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="memfit")
    except KeyboardInterrupt:  # pragma: no cover - interactive (before a subcommand runs)
        _exiting_on_ctrl_c()
        click.echo("error: Interrupted by Ctrl-C.", err=True)
        sys.exit(INTERRUPTED)

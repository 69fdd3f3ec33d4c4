"""Flags that say how to read the data (``memfit train`` and ``memfit data preview``)."""

from __future__ import annotations

import click

from memfit.data_formats import FORMATS


def data_options() -> list:
    """The data flags as click options (values land in ``TrainConfig``'s fields of the same names)."""
    return [
        click.option("--data-format", type=click.Choice(FORMATS), default=None,
                     help="Force the record format instead of detecting it from the keys."),
        click.option("--train-on-prompt", is_flag=True,
                     help="Take the loss on prompts and user turns too (default: completions/assistant turns)."),
        click.option("--chat-template", type=click.Path(dir_okay=False), default=None,
                     help="Jinja chat template file for a tokenizer without one (or to replace its own)."),
        click.option("--split", default="train", show_default=True,
                     help="Split of a Hub dataset or a save_to_disk DatasetDict."),
        click.option("--data-config", default=None, help="Configuration (subset) of a Hub dataset."),
        click.option("--text-field", default=None, help="Column holding the text (default: text)."),
        click.option("--prompt-field", default=None, help="Column holding the prompt (default: prompt)."),
        click.option("--completion-field", default=None, help="Column holding the completion (default: completion)."),
        click.option("--messages-field", default=None, help="Column holding the conversation (default: messages)."),
        click.option("--num-proc", type=int, default=1, show_default=True,
                     help="Processes that tokenize a datasets source (.parquet/.csv/.json/.arrow, Hub id)."),
    ]

"""``memfit data preview``: the first training example as the model will see it, loss mask marked."""

from __future__ import annotations

import json
from typing import Any

import click

import memfit
from memfit.cli.data_options import data_options
from memfit.errors import printable, printable_lines
from memfit.settings.config import TrainConfig

EPILOG = """\b
Examples:
  memfit data preview --data chats.jsonl                       # tiny preset's byte tokenizer + template
  memfit data preview --data chats.jsonl --model ./my-instruct # the model's own chat template
  memfit data preview --data chats.jsonl --model Qwen/Qwen2.5-0.5B-Instruct   # a Hub model's tokenizer
  memfit data preview --data train.parquet --messages-field conversation --index 3
"""


@click.group(name="data", context_settings={"help_option_names": ["-h", "--help"]})
def command() -> None:
    """Look at training data the way memfit train reads it."""


@command.command(name="preview", epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", default=None, help="As for memfit train (default: the shipped corpus).")
@click.option("--model", default="tiny", show_default=True,
              help="Preset, local checkpoint or Hugging Face Hub id (org/name), for its tokenizer and chat template.")
@click.option("--revision", default=None, help="Branch, tag or commit of a Hub --model; default: its main branch.")
@click.option("--tokenizer", default=None, help="Tokenizer folder, or 'byte'; default: the model's.")
@click.option("--index", type=int, default=0, show_default=True, help="Which record (0 = the first).")
@click.option("--json", "as_json", is_flag=True, help="Print input_ids, labels and the marked text as JSON.")
def preview(**kwargs: Any) -> None:
    """Show one record rendered as training sees it; text without loss is shown as [[no loss: ...]]."""

    index, as_json = kwargs.pop("index"), kwargs.pop("as_json")
    config = TrainConfig.of(**{k: v for k, v in kwargs.items() if v is not None and v is not False}
                            | {"train_on_prompt": bool(kwargs.get("train_on_prompt"))})
    memfit.check_inputs(config.source.model, config.data, config.source.revision)  # a typo: before torch loads
    result = memfit.preview_record(config, index)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{printable(result['where'])} ({result['format']}): {result['tokens']} tokens, "
               f"{result['targets']} with loss")
    click.echo(printable_lines(result["marked"]))  # the record's own text: its control characters shown, not obeyed


for _opt in data_options():  # on a finished click Command each option is appended: in the schema's order
    preview = _opt(preview)

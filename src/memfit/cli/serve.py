"""``memfit serve``: the estimate and the plan as a local web page (thin over ``memfit.serve``)."""

from __future__ import annotations

import click

import memfit


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface, as a Hugging Face Space does).")
@click.option("--port", type=click.IntRange(1, 65535), default=7860, show_default=True, help="Port to listen on.")
@click.option("--open", "open_browser", is_flag=True, help="Open the page in the default web browser.")
def command(host, port, open_browser):
    """A local web page over memfit's estimate and plan: the model as a preset, a Hub id, a config.json or
    another trainer's config; every setting a form control with its --help text; the breakdown redrawn on
    each change; --exact on request; the plan for a budget with its train command. Needs the web extra
    (pip install 'memfit[web]'); works offline.

    \b
    Examples:
      memfit serve                      # http://127.0.0.1:7860/
      memfit serve --port 8080 --open
    """

    memfit.serve(host, port, open_browser)

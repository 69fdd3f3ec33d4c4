"""The screenshots of ``memfit serve`` in docs/ (docs/serve.md, README): the page as it answers now.

``python scripts/serve_screenshots.py`` starts the page's server in-process, drives the OS's Chromium with
Playwright (``pip install 'memfit[browser]'``, ``apt-get install chromium``; no browser download) and rewrites
docs/serve-estimate.png (llama-2-7b QLoRA, seq 2048), docs/serve-error.png (a sequence length of 0) and
docs/serve-plan.png (the whole page after planning that run for 24 GiB, written as an Axolotl config).
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
SETTINGS = "s.seq_len=2048&s.micro_batch=1&s.mixed_precision=bf16&s.dtype=bf16&s.grad_checkpointing=true" \
           "&s.lora_r=16&s.quantize=4bit"
SHOTS = {"serve-estimate.png": f"#kind=preset&preset=llama-2-7b&{SETTINGS}",
         "serve-error.png": "#kind=preset&preset=llama-2-7b&s.seq_len=0"}


def main() -> None:
    import uvicorn
    from playwright.sync_api import sync_playwright

    from memfit.web.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for name, fragment in SHOTS.items():
            page.goto(f"http://127.0.0.1:{port}/{fragment}")
            page.wait_for_function("Number(document.body.dataset.redraws || 0) > 0", timeout=120_000)
            page.wait_for_timeout(300)
            page.screenshot(path=str(DOCS / name))
            print(f"docs/{name}")
        # the plan for 24 GiB, written as an Axolotl config: the page's lower half
        page.goto(f"http://127.0.0.1:{port}/{SHOTS['serve-estimate.png']}&budget=24GiB&batch=16&emit=axolotl")
        page.wait_for_function("Number(document.body.dataset.redraws || 0) > 0", timeout=120_000)
        page.select_option("#emit", "axolotl")
        page.click("#plan-run")
        page.wait_for_selector("#launch", timeout=120_000)
        page.wait_for_timeout(300)
        page.locator("#plan-run").scroll_into_view_if_needed()
        page.screenshot(path=str(DOCS / "serve-plan.png"), full_page=True)
        print("docs/serve-plan.png")
        browser.close()
    server.should_exit = True


if __name__ == "__main__":
    main()

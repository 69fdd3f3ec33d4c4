"""``memfit serve``'s web app: a static page and a small JSON API over ``memfit.web.service`` (ASGI, Starlette).

Routes: ``/`` the page (``static/``: HTML, CSS and JavaScript shipped in the package, nothing fetched from
elsewhere, so it works offline); ``/api/form`` the form's controls and choices; ``/api/estimate`` and
``/api/plan`` (answered in the request: the analytic estimate takes about a millisecond, a plan well under a
second); ``/api/exact`` starts the exact trace as a job and ``/api/exact/{id}`` polls it.

An error the user caused answers HTTP 422 with ``{"error": sentence, "field": key}``: the CLI's sentence and
the form field it names. Endpoints are plain functions: Starlette runs them on its thread pool, so one slow
request never stalls the others.

Why Starlette and uvicorn, not Gradio: the page is one form whose every change redraws in well under 100 ms,
with its state in the URL; a plain page over a JSON API does that with two small pure-Python dependencies
(the ``web`` extra), where Gradio brings a front-end framework, a queue and dozens of packages, and ties the
layout to its components (docs/serve.md compares them).
"""

# Inside functions: starlette and uvicorn, the web extra (memfit[web]); without it `memfit serve` says which extra to install.
from __future__ import annotations

import contextlib
import json
import threading
import webbrowser
from collections.abc import Callable
from importlib import resources
from typing import Any

from memfit.errors import UserError
from memfit.integrations.versions import MEMFIT
from memfit.spec.model import load_presets
from memfit.web import form, service
from memfit.web.jobs import Jobs

MAX_BODY = 2 * service.MAX_FILE_CHARS
"""A request larger than this is refused before it is parsed (a pasted file is at most 1 MiB of text)."""
WEB_EXTRA = "memfit serve needs the web extra: pip install 'memfit[web]' (starlette and uvicorn)."


def _starlette():
    try:
        import starlette  # noqa: F401 - only to say which extra is missing
    except ImportError:
        raise UserError(WEB_EXTRA) from None


def page_data() -> dict[str, Any]:
    """What the page draws its form from: controls, presets, tools, GPUs."""
    return {"version": MEMFIT, "controls": form.run_controls(), "plan": form.plan_controls(),
            "presets": list(load_presets()), "tools": list(service.TOOLS), "kinds": list(service.KINDS)}


def create_app():
    """The ASGI app (``uvicorn memfit.web.app:create_app --factory``; the Hugging Face Space's ``app.py``)."""
    _starlette()
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    jobs = Jobs(service.field_of)
    static = resources.files("memfit.web").joinpath("static")
    types = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}

    def asset(request):
        name = request.path_params.get("name", "index.html")
        if name not in {p.name for p in static.iterdir()} or "." not in name:
            return Response("not found", status_code=404)
        return Response(static.joinpath(name).read_bytes(), media_type=types.get("." + name.rsplit(".", 1)[1]))

    def answer(work: Callable[[dict], dict], default_field: str = "model"):
        async def endpoint(request):
            body = await request.body()
            try:
                if len(body) > MAX_BODY:
                    raise UserError(f"The request is over {MAX_BODY:,} bytes; the file cannot be that large.")
                try:
                    payload = json.loads(body or b"{}")
                except json.JSONDecodeError:
                    raise UserError("The request is not JSON.") from None
                if not isinstance(payload, dict):
                    raise UserError("The request must be a JSON object.")
                return JSONResponse(await run_in_threadpool(work, payload))
            except UserError as err:
                return JSONResponse({"error": str(err), "field": service.field_of(str(err), default_field)}, 422)
        return endpoint

    def start_exact(payload: dict) -> dict:
        service.Source.from_dict(payload.get("model"))  # a request without a model is refused now, not in the job
        service.typed_settings(payload.get("settings"))
        return {"job": jobs.submit(lambda: service.exact(payload))}

    def poll(request):
        state = jobs.status(request.path_params["job"])
        return JSONResponse(state or {"state": "error", "error": "No such job (the server restarted?).", "field": "exact"},
                            status_code=200 if state else 404)

    routes = [
        Route("/", asset),
        Route("/static/{name}", asset),
        Route("/api/form", lambda request: JSONResponse(page_data())),
        Route("/api/estimate", answer(service.estimate), methods=["POST"]),
        Route("/api/plan", answer(service.plan, "budget"), methods=["POST"]),
        Route("/api/exact", answer(start_exact), methods=["POST"]),
        Route("/api/exact/{job}", poll),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        jobs.shutdown()

    return Starlette(routes=routes, lifespan=lifespan)


def serve(host: str = "127.0.0.1", port: int = 7860, open_browser: bool = False) -> None:
    """Serve the page on ``host:port`` until interrupted (``memfit serve``)."""
    _starlette()
    try:
        import uvicorn
    except ImportError:
        raise UserError(WEB_EXTRA) from None
    app = create_app()
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"
    print(f"memfit serve: {url} (Ctrl-C to stop)", flush=True)
    if open_browser:
        threading.Timer(1.0, webbrowser.open, [url]).start()
    uvicorn.run(app, host=host, port=port, log_level="warning")

"""The Hugging Face Space's entry point: memfit serve's ASGI app (``uvicorn app:app``, as space/Dockerfile runs it)."""

from memfit.web.app import create_app

app = create_app()

"""``eyas serve``: the OpenAI-compatible server (FastAPI + uvicorn) over one engine loop.

The engine never imports this package."""

from eyas.server.app import ServerSettings, build_app
from eyas.server.serve import serve

__all__ = ["ServerSettings", "build_app", "serve"]

"""``eyas serve``: the OpenAI-compatible server (FastAPI + uvicorn) over one engine loop.

The engine never imports this package."""

from eyas.server.app import build_app
from eyas.server.serve import serve
from eyas.server.service import ServerSettings

__all__ = ["ServerSettings", "build_app", "serve"]

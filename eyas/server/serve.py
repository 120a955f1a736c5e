"""Run the server: build the app over an LLM, print where it listens, serve until SIGINT/SIGTERM.

On a signal uvicorn stops taking connections and waits up to ``GRACE_SECONDS`` for the requests in
flight; whatever is still running then is aborted when the engine loop shuts down; the process exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn

from eyas.llm import LLM
from eyas.server.app import build_app
from eyas.server.service import ServerSettings

GRACE_SECONDS = 30


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM once it has shut down gracefully, so the process dies by the signal;
    eyas stops the same way and then exits 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def describe_speculation(llm: LLM) -> str:
    spec = llm.engine.config.speculative
    if spec is None:
        return "none"
    model = f", drafter {spec.options.model}" if getattr(spec.options, "model", None) else ""
    return f"{spec.method}, k = {spec.num_speculative_tokens}{model}"


def serve(llm: LLM, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000) -> None:
    app = build_app(llm, settings)
    shown = f"[{host}]" if ":" in host else host
    print(f"eyas serve: http://{shown}:{port}  model {settings.model_name}  speculation {describe_speculation(llm)}"
          f"  API key {'required' if settings.api_key else 'off'}", flush=True)
    print(f"  playground http://{shown}:{port}/  metrics http://{shown}:{port}/metrics  "
          f"OpenAI base URL http://{shown}:{port}/v1", flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_SECONDS)
    _Server(config).run()

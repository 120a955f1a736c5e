"""A live ``eyas serve`` subprocess on a free loopback port, for tests that talk HTTP to it."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *args: str, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args = ["--model", str(model), "--port", str(self.port), "--dtype", "float32", "--max-model-len", "256",
                     "--kv-cache-gb", "0.02", "--threads", "1", *args]
        self.env = env

    def __enter__(self) -> "Server":
        import os

        env = {**os.environ, **(self.env or {})}
        # the server's output goes to a file, not a pipe: a pipe nobody drains fills up, and a server that logs
        # a lot (a fuzzing run's refusals) would then block on its next write and stop answering
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "eyas.cli", "serve", *self.args], stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"eyas serve exited {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("eyas serve did not come up in 120 s")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def output(self) -> str:
        """What the server has printed so far (stdout and stderr)."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("eyas:request_success_total", 'finished_reason="abort"')."""
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def banner(text: str) -> dict:
    """The URL, model and speculation of the line ``eyas serve`` prints when it starts."""
    match = re.search(r"eyas serve: (\S+)\s+model (\S+)\s+speculation (.+?)\s+API key", text)
    return {"url": match.group(1), "model": match.group(2), "speculation": match.group(3)} if match else {}

"""The one engine loop of a server: a background thread owns the engine; HTTP handlers talk to it
through commands and per-request asyncio queues, never touching engine state.

* ``submit`` hands (request id, prompt ids, params) to the thread; the thread validates it with
  ``Engine.add_request`` and answers through a future, so a bad request is a ValueError in the
  handler and nothing changes for anyone else.
* The thread steps while there is work, and after each step puts every changed request's output
  on that request's queue (``loop.call_soon_threadsafe``). A finished output is the last one.
* ``abort`` (a client that went away) finishes the request at the next turn of the loop; its KV
  blocks are freed there.
* ``snapshot`` is what /metrics and admission control read: counts copied by the thread after
  every step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass

from eyas.engine.engine import Engine
from eyas.engine.outputs import RequestOutput
from eyas.sampling.params import SamplingParams

logger = logging.getLogger("eyas")


@dataclass(frozen=True)
class Snapshot:
    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue, plus submitted requests the thread has not taken yet
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_preemptions: int = 0  # since start


class EngineLoop:
    def __init__(self, engine: Engine, on_step=None):
        """``on_step(outputs, spec_totals)``: called by the thread after every step (the server's metrics), with
        the step's outputs and the engine-wide speculation totals (``Engine.stats()``)."""
        self.engine = engine
        self.on_step = on_step
        self.snapshot = Snapshot()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # thread-owned
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eyas-engine", daemon=True)
        self._thread.start()

    # -- called from the event loop ------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     prompt: str | None = None) -> asyncio.Queue:
        """Queue the request; its outputs arrive on the returned queue. ValueError: refused, nothing changed."""
        outputs: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (request_id, prompt_ids, params, prompt, asyncio.get_running_loop(), outputs), done))
        await asyncio.wrap_future(done)
        return outputs

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def pending(self) -> int:
        """Submissions the thread has not taken yet."""
        return self._commands.qsize()

    def shutdown(self) -> None:
        """Abort what is left and stop the thread."""
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout=30)

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            try:  # block for a command only when there is nothing to step
                command = self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            while command is not None:
                self._apply(*command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stop.is_set():
                break
            if self.engine.has_unfinished_requests():
                self._step()
        for request_id in list(self._queues):
            self._aborted(request_id)

    def _apply(self, kind: str, payload, done: concurrent.futures.Future | None) -> None:
        if kind == "add":
            request_id, prompt_ids, params, prompt, loop, outputs = payload
            try:
                self.engine.add_request(request_id, prompt_ids, params, prompt)
            except Exception as error:  # refused at the edge: the handler answers 400
                done.set_exception(error)
                return
            self._queues[request_id] = (loop, outputs)
            done.set_result(None)
        elif kind == "abort" and payload in self._queues:
            self._aborted(payload)
        self._publish()

    def _aborted(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        self._deliver(output, request_id)
        if self.on_step is not None and output is not None:
            self.on_step([output], self.engine.stats())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # an engine bug: fail the requests in flight, keep serving new ones
            logger.exception("engine step failed; aborting the requests in flight")
            for request_id in list(self._queues):
                self._aborted(request_id)
            return
        for output in outputs:
            self._deliver(output, output.request_id)
        if self.on_step is not None:
            self.on_step(outputs, self.engine.stats())
        self._publish()

    def _deliver(self, output: RequestOutput | None, request_id: str) -> None:
        target = self._queues.get(request_id)
        if target is None or output is None:
            return
        if output.finished:
            del self._queues[request_id]
        loop, outputs = target
        loop.call_soon_threadsafe(outputs.put_nowait, output)

    def _publish(self) -> None:
        scheduler, kv = self.engine.scheduler, self.engine.kv
        usable = self.engine.num_kv_blocks - 1  # block 0 is the reserved null block
        self.snapshot = Snapshot(len(scheduler.running), len(scheduler.waiting),
                                 1.0 - kv.num_free_blocks / usable, self.engine.num_preemptions)

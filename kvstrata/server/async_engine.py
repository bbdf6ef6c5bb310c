"""The engine stepping in one background thread while HTTP requests arrive on the event loop.

The thread owns the `LLMEngine` (which is not thread-safe): requests and aborts reach it through
a command queue, and each request's outputs come back on its own asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.server.metrics import ServerMetrics

log = logging.getLogger("kvstrata.server")


class QueueFullError(Exception):
    """The waiting queue is at --max-waiting: the client should retry later."""


class EngineDeadError(Exception):
    """The engine loop hit an internal error; the request could not be served."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival: float


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int, metrics: ServerMetrics):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._admitted = 0  # requests sent to the thread and not yet finished
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-engine", daemon=True)
        self._counter = 0

    # --- event-loop side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping; requests still in flight end with finish reason 'abort'."""
        self._stopping.set()
        self._thread.join()

    @property
    def num_in_flight(self) -> int:
        return self._admitted

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs; leaving early (a disconnect) aborts it."""
        if self._stopping.is_set():
            raise QueueFullError("the server is shutting down")
        # Validate on the caller's side so a bad prompt is the client's 400, not the loop's problem.
        token_ids = self.engine.tokenize(prompt)
        self.engine.check_prompt_length(token_ids)
        with self._lock:
            waiting = self._admitted - self.engine.num_running
            if waiting >= self.max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting (--max-waiting {self.max_waiting})")
            self._admitted += 1
            self._counter += 1
            request_id = f"req-{self._counter}"
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (outputs, asyncio.get_running_loop())
        self._commands.put(_Add(request_id, token_ids, params, time.perf_counter()))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    # --- engine-thread side -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # an engine bug must not take the server down with it
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineDeadError(f"internal engine error: {exc}"))
                continue
            for output in outputs:
                self.metrics.observe_output(output)
                self._deliver(output.request_id, output)
            self.metrics.observe_step(self.engine)
        self._fail_all(None)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.prompt, command.params, command.request_id, command.arrival)
                except KvstrataError as exc:
                    self._deliver(command.request_id, exc)
                except Exception as exc:  # never let one request stop the loop
                    log.exception("could not start request %s", command.request_id)
                    self._deliver(command.request_id, EngineDeadError(f"could not start the request: {exc}"))
            else:
                output = self.engine.abort(command.request_id)
                if output is not None:
                    self.metrics.observe_finished(output)
                    self._deliver(command.request_id, output)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        finished = isinstance(item, Exception) or item.finished
        stream = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
        if stream is None:
            return
        if finished:
            with self._lock:
                self._admitted -= 1
        outputs, loop = stream
        loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _fail_all(self, error: Exception | None) -> None:
        """End every request in flight: with `error`, or (at shutdown) as aborted."""
        self._apply_commands(block=False)
        for request_id in list(self._streams):
            output = self.engine.abort(request_id)
            if error is not None or output is None:
                self._deliver(request_id, error or EngineDeadError("the server stopped"))
            else:
                self._deliver(request_id, output)

"""The engine stepping in one background thread while HTTP requests arrive on the event loop.

The thread owns the `LLMEngine` (which is not thread-safe): requests, aborts and "end everything" reach
it through a command queue, and each request's outputs come back on its own asyncio queue. Nothing a
request does can stop the thread: a failure the engine can pin on one request ends that request alone,
and anything else ends the requests in flight with one error while the loop goes on.
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
from kvstrata.kv.preloaded import Preloaded
from kvstrata.server.metrics import ServerMetrics

log = logging.getLogger("kvstrata.server")


Choice = tuple[int, RequestOutput]  # a choice's index in its API request, and its latest output


class ServerError(Exception):
    """A request the server could not serve to its end; `status` and `kind` are what the client sees."""

    status = 500
    kind = "server_error"


class RequestError(ServerError):
    """The engine ended this request alone (its context is corrupt, its output could not be processed)."""


class RequestInputError(RequestError):
    """The engine ended this request alone because of what it asked (a structured output that cannot go on)."""

    status = 400
    kind = "invalid_request_error"


class EngineDeadError(ServerError):
    """The engine loop hit an internal error that it could not pin on one request."""

    kind = "internal_error"


class QueueFullError(ServerError):
    """The waiting queue is at --max-waiting: the client should retry later."""

    status = 503
    kind = "server_overloaded"


class ShuttingDownError(ServerError):
    """The server is shutting down: the request was stopped, or never started."""

    status = 503
    kind = "server_shutting_down"


@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival: float
    preloaded: list[Preloaded]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _EndAll:
    error: ServerError


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int, metrics: ServerMetrics):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        # request id -> its choices' output queue, the loop it belongs to, and its choice index
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop, int]] = {}
        self._admitted = 0  # requests sent to the thread and not yet finished
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # no new requests
        self._exiting = threading.Event()  # the thread ends once its commands are applied
        self._thread = threading.Thread(target=self._run, name="kvstrata-engine", daemon=True)
        self._counter = 0

    # --- event-loop side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def end_all(self, error: ServerError) -> None:
        """End every request in flight with `error` (the shutdown grace period is over) and take no new ones."""
        self._stopping.set()
        self._commands.put(_EndAll(error))

    def stop(self) -> None:
        """Stop stepping; requests still in flight end with ShuttingDownError."""
        self.end_all(ShuttingDownError("the server shut down before the request finished"))
        self._exiting.set()
        self._thread.join()

    @property
    def num_in_flight(self) -> int:
        return self._admitted

    async def generate(self, requests: list[tuple[list[int], SamplingParams]],
                       preloaded: list[list[Preloaded]] | None = None,
                       admitted: bool = False) -> AsyncIterator[Choice]:
        """Submit the checked (prompt token ids, sampling parameters) of one API request's choices (its prompts,
        `n` each) and yield (choice index, output) as outputs come, until every choice finished. The choices are
        accepted together or not at all (against --max-waiting); when the caller leaves early (a disconnect) or
        one choice fails, the rest are aborted. `preloaded`: each choice's KV given ready-made; `admitted`: the
        choices continue an API request already accepted (a beam search's later rounds), so --max-waiting does not
        turn them away.

        Raises a ServerError subclass when a choice cannot be served to its end."""
        if self._stopping.is_set():
            raise ShuttingDownError("the server is shutting down and takes no new requests")
        with self._lock:
            waiting = self._admitted - self.engine.num_running
            if not admitted and waiting + len(requests) > self.max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting (--max-waiting {self.max_waiting})")
            self._admitted += len(requests)
            first = self._counter + 1
            self._counter += len(requests)
        request_ids = [f"req-{first + index}" for index in range(len(requests))]
        outputs: asyncio.Queue = asyncio.Queue()
        arrival = time.perf_counter()
        for index, (request_id, (token_ids, params)) in enumerate(zip(request_ids, requests)):
            self._streams[request_id] = (outputs, asyncio.get_running_loop(), index)
            self._commands.put(_Add(request_id, token_ids, params, arrival, preloaded[index] if preloaded else []))
        unfinished = set(range(len(requests)))
        answered = False  # once an output went out, a choice that fails to start is a RequestError too
        try:
            while unfinished:
                index, item = await outputs.get()
                if isinstance(item, Exception) or item.finished:
                    unfinished.discard(index)
                if isinstance(item, Exception):
                    raise item if isinstance(item, ServerError) or not answered else RequestError(str(item))
                if item.finish_reason == "error":
                    failure = RequestInputError if item.error_caused_by_input else RequestError
                    raise failure(f"the request failed: {item.error}")
                answered = True
                yield index, item
        finally:
            for index in unfinished:
                self._commands.put(_Abort(request_ids[index]))

    # --- engine-thread side -------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._exiting.is_set() and self._commands.empty()):
            try:
                if self._apply_commands(block=not self.engine.has_unfinished_requests()):
                    self.metrics.observe_step(self.engine)  # aborts and failures change the gauges too
                if self.engine.has_unfinished_requests():
                    self._step()
            except Exception:  # the loop itself must outlive any error: end what is in flight, go on
                log.exception("engine loop error; ending the requests in flight")
                self._end_all(EngineDeadError("internal engine error; the request was stopped"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine bug outside any one request's part of the step
            log.exception("engine step failed; ending the requests in flight")
            self._end_all(EngineDeadError(f"internal engine error: {type(exc).__name__}: {exc}"))
            return
        for output in outputs:
            self.metrics.observe_output(output)
            self._deliver(output.request_id, output)
        self.metrics.observe_step(self.engine)

    def _apply_commands(self, block: bool) -> bool:
        """Apply the queued commands; True if there were any."""
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                output = self.engine.abort(command.request_id)
                if output is not None:
                    self.metrics.observe_finished(output)
                    self._deliver(command.request_id, output)
            else:
                self._end_all(command.error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        if command.request_id not in self._streams:
            return  # ended before it started (everything in flight was ended meanwhile)
        if self._stopping.is_set():
            self._deliver(command.request_id, ShuttingDownError("the server is shutting down"))
            return
        try:
            self.engine.add_request(command.token_ids, command.params, command.request_id, command.arrival,
                                    command.preloaded)
        except KvstrataError as exc:  # the client's to fix: a 400
            self._deliver(command.request_id, exc)
        except Exception as exc:  # never let one request stop the loop
            log.exception("could not start request %s", command.request_id)
            self._deliver(command.request_id, EngineDeadError(f"could not start the request: {exc}"))

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        finished = isinstance(item, Exception) or item.finished
        stream = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
        if stream is None:
            return
        if finished:
            with self._lock:
                self._admitted -= 1
        outputs, loop, index = stream
        loop.call_soon_threadsafe(outputs.put_nowait, (index, item))

    def _end_all(self, error: ServerError) -> None:
        """End every request in flight with `error`; each is answered even if the engine cannot end it cleanly."""
        for request_id in list(self._streams):
            try:
                output = self.engine.fail(request_id, str(error))
                if output is not None:
                    self.metrics.observe_finished(output)
            except Exception:
                log.exception("could not end request %s cleanly", request_id)
            self._deliver(request_id, error)
        self.metrics.observe_step(self.engine)

"""The cluster's one endpoint: picks a replica for each request, forwards it, and survives a replica's loss.

Requests reach this Ray Serve deployment as plain HTTP; it reads only what routing needs (the prompt's
first tokens) and forwards the request unchanged to the chosen replica, whose app validates and
answers it exactly as a single server would. If that replica dies before the client has received
anything, the request goes to the next replica in the policy's order; a stream that already sent
tokens ends with an error event instead (a second replica would restart the text from its beginning).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from pydantic import ValidationError
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvstrata.cluster.asgi_call import ResponseStart
from kvstrata.cluster.metrics_merge import merge_replica_metrics
from kvstrata.cluster.routing import KVAwareRouting, make_routing, prompt_blocks
from kvstrata.errors import KvstrataError
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.server.api_key import refusal
from kvstrata.server.embeddings import EmbeddingRequest
from kvstrata.server.protocol import ChatCompletionRequest, CompletionRequest
from kvstrata.server.responses import error_body, sse
from kvstrata.server.responses_output import sse_event
from kvstrata.server.responses_protocol import ResponsesRequest

log = logging.getLogger("kvstrata.cluster")
# the requests routed by their prompt (the others go where the routing policy sends a request without one)
COMPLETION_PATHS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                    "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest}
PROBE_SECONDS = 1.0  # how often a replica marked down is asked whether it is back
PROBE_TIMEOUT_SECONDS = 5.0
METRICS_TIMEOUT_SECONDS = 5.0
# How often a kv-aware front asks each replica what its prefix cache gained and lost. Requests in flight count as
# held without waiting for it, so this only delays what evictions and other traffic did; each call costs both sides.
KV_EVENTS_SECONDS = 0.5
REPLICA_HEADER = "x-kvstrata-replica"  # which replica answered: for operators and tests
disable_created_metrics()  # as the single server does: the *_created series only add noise for scrapers


@dataclass(frozen=True)
class FrontOptions:
    checkpoint: str  # the converted model directory: its tokenizer computes routing keys
    routing: str
    block_size: int
    routing_prefix_tokens: int  # how much of a prompt never seen before its consistent-hashing key covers
    max_request_bytes: int
    api_key: str | None = field(default=None, repr=False)  # the replicas' too: checked here before any routing
    chat_template: str | None = None  # the replicas' --chat-template, which a chat's routing key is rendered with
    # The replicas' --lora-modules names: a request on one is hashed in a chain of its adapter's, as the replicas
    # start its chain with the adapter's digest, so it never meets the base model's blocks.
    lora_names: tuple[str, ...] = ()


class ReplicaFailed(Exception):
    """The replica died or became unreachable before the client received anything."""


# Errors that mean the replica, not the request, failed: it died, or Serve has none to call.
REPLICA_FAILURES = (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)


class _ReleasingStream(StreamingResponse):
    """A streaming response that runs `release` once it ends, however it ends (even when the client left
    before its body was started)."""

    def __init__(self, content, release, **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class Frontend:
    def __init__(self, options: FrontOptions, *replicas):
        self.options = options
        self.replicas = replicas
        self.tokenizer = Tokenizer.from_directory(Path(options.checkpoint))
        if options.chat_template is not None and self.tokenizer is not None:
            self.tokenizer = self.tokenizer.with_chat_template(options.chat_template)
        self.routing = make_routing(options.routing, len(replicas), options.block_size,
                                    options.routing_prefix_tokens)
        self.loads = [0] * len(replicas)  # requests in flight on each replica, from this front
        self.up = [True] * len(replicas)
        # Of the model every replica must serve: set by check_replicas at deployment, or learnt from the
        # first replica that answers if Serve restarted this front.
        self.fingerprint: str | None = None
        self._probes: dict[int, asyncio.Task] = {}
        self._kv_event_tasks: list[asyncio.Task] = []  # one per replica, following its KV events (kv-aware routing)
        self._first_kv_events = asyncio.Event()  # set once a replica's events were first read (or waited for)
        self.registry = CollectorRegistry()
        self.routed = Counter("kvstrata:router_requests", "Requests sent to each replica (retries included)",
                              ["replica", "routing"], registry=self.registry)
        self.retries = Counter("kvstrata:router_retries", "Requests sent again after their replica failed",
                               registry=self.registry)
        self.replica_up = Gauge("kvstrata:replica_up", "1 while the front sends a replica requests",
                                ["replica"], registry=self.registry)
        for i in range(len(replicas)):
            self.replica_up.labels(replica=str(i)).set(1)
        self.kv_aware = isinstance(self.routing, KVAwareRouting)  # follows the replicas' KV events
        if self.kv_aware:
            self.kv_blocks = Gauge("kvstrata:router_kv_blocks", "Blocks the replica's prefix cache holds, as the "
                                   "front knows from its KV events", ["replica"], registry=self.registry)
            for i in range(len(replicas)):
                self.kv_blocks.labels(replica=str(i)).set(0)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if self.options.api_key is not None:
            header = request.headers.get("authorization")  # Starlette decodes header bytes as latin-1
            refused = refusal(self.options.api_key, path, None if header is None else header.encode("latin-1"))
            if refused is not None:
                return refused
        if path == "/metrics" and request.method in ("GET", "HEAD"):
            return await self._metrics()
        if path == "/health" and request.method in ("GET", "HEAD"):
            live = sum(self.up)
            return JSONResponse({"status": "ok" if live else "no replica up", "replicas_up": live},
                                status_code=200 if live else 503)
        if self.kv_aware:
            await self._kv_events_started()
        body = await request.body()
        if len(body) > self.options.max_request_bytes:
            return JSONResponse(error_body(f"the request body has {len(body)} bytes, more than the "
                                           f"{self.options.max_request_bytes} allowed", kind="request_too_large"),
                                status_code=413)
        blocks, streaming = None, False
        if request.method == "POST" and path in COMPLETION_PATHS:
            blocks, streaming = await asyncio.to_thread(self._route_on, COMPLETION_PATHS[path], body)
        headers = [(k, v) for k, v in request.headers.items() if k not in ("host", "content-length")]
        headers.append(("content-length", str(len(body))))
        call = (request.method, path, request.url.query, headers, body)
        # Replicas marked down are skipped: Serve would hold a request for a dead one until it restarts.
        order = [i for i in self.routing.order(blocks, self.loads, self.up) if self.up[i]]
        for attempt, index in enumerate(order):
            if attempt:
                self.retries.inc()
            try:
                response = await self._send(index, call, streaming, blocks)
            except ReplicaFailed as exc:
                log.warning("replica %d failed a request (%s); %s", index, exc,
                            "trying the next" if attempt + 1 < len(order) else "none left")
                continue
            except RayError as exc:  # the request's own failure inside the replica: trying others would repeat it
                log.error("replica %d could not serve a request: %s", index, exc)
                return JSONResponse(error_body(f"internal error: {type(exc).__name__}", kind="internal_error"),
                                    status_code=500)
            if 200 <= response.status_code < 300:
                self.routing.served(blocks, index)
            return response
        return JSONResponse(error_body("no replica could serve the request; retry later", kind="server_overloaded"),
                            status_code=503, headers={"Retry-After": "1"})

    def _route_on(self, schema, body: bytes) -> tuple[list[bytes] | None, bool]:
        """(the prompt's block hashes, streamed?) of a completion or embedding request; no hashes for a body its
        replica will refuse."""
        try:
            parsed = schema.model_validate_json(body)
            if isinstance(parsed, ResponsesRequest):
                parsed = parsed.chat_request()
            if isinstance(parsed, ChatCompletionRequest):
                token_ids = self.tokenizer.encode_chat([m.plain() for m in parsed.messages], tools=parsed.plain_tools,
                                                       template_kwargs=parsed.chat_template_kwargs)
            else:
                # a batch of prompts goes where its first one would
                prompt = (parsed.inputs if isinstance(parsed, EmbeddingRequest) else parsed.prompts)[0]
                token_ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
            root = self.routing.namespace
            if parsed.model in self.options.lora_names:
                root += f"lora/{parsed.model}/".encode()
            blocks = prompt_blocks(token_ids, self.options.block_size, parsed.cache_salt, root)
            return blocks, bool(getattr(parsed, "stream", False))
        except (ValidationError, KvstrataError, ValueError, OverflowError):  # e.g. a token id beyond 64 bits
            return None, False

    async def _send(self, index: int, call: tuple, streaming: bool, blocks: list[bytes] | None) -> Response:
        """One replica's answer. Raises ReplicaFailed while the client has received nothing yet."""
        self.routed.labels(replica=str(index), routing=self.options.routing).inc()
        self.loads[index] += 1
        self.routing.routed(blocks, index)
        messages = self.replicas[index].forward.options(stream=True).remote(*call)
        released = committed = False

        def release() -> None:  # once: the request no longer counts against the replica, and stops there
            nonlocal released
            if not released:
                released = True
                self.loads[index] -= 1
                self.routing.finished(blocks, index)
                # Best effort, a no-op once the stream ended. Serve already passes a client's leaving on to
                # the replica; this also stops a request the front itself gave up on.
                with contextlib.suppress(Exception):
                    messages.cancel()

        try:
            try:
                start = await anext(messages)
                assert isinstance(start, ResponseStart)
                first = await anext(messages, b"")
                if not streaming:
                    body = first + b"".join([chunk async for chunk in messages])
            except REPLICA_FAILURES as exc:
                self._mark_down(index)
                raise ReplicaFailed(type(exc).__name__) from exc
            headers = {k: v for k, v in start.headers if k != "content-length"}
            headers[REPLICA_HEADER] = str(index)
            if not streaming:
                return Response(body, status_code=start.status, headers=headers)
            committed = True  # from here the stream releases the request when it ends
            return _ReleasingStream(self._relay(index, first, messages, call[1] == "/v1/responses"), release,
                                    status_code=start.status, headers=headers)
        finally:
            if not committed:
                release()

    async def _relay(self, index: int, first: bytes, messages, responses_api: bool) -> AsyncIterator[bytes]:
        """A replica's stream; where the replica fails mid-stream, an error in the stream's own form (the
        Responses API's error event, or a chat or completion stream's error and end)."""
        try:
            if first:
                yield first
            async for chunk in messages:
                yield chunk
        except REPLICA_FAILURES as exc:
            self._mark_down(index)
            message = f"replica {index} failed mid-stream ({type(exc).__name__}); the text so far is incomplete"
            if responses_api:
                yield sse_event({"type": "error", "code": "server_error", "message": message, "param": None}).encode()
                return
            yield sse(json.dumps(error_body(message, kind="server_error"))).encode()
            yield sse("[DONE]").encode()

    def _mark_down(self, index: int) -> None:
        if not self.up[index]:
            return  # the other requests it held are failing too: one probe, one forget
        self.up[index] = False
        self.routing.forget(index)
        if self.kv_aware:
            self.kv_blocks.labels(replica=str(index)).set(0)
        self.replica_up.labels(replica=str(index)).set(0)
        if index not in self._probes or self._probes[index].done():
            self._probes[index] = asyncio.create_task(self._probe_until_back(index))

    async def _probe_until_back(self, index: int) -> None:
        """Ray Serve restarts a dead replica; it gets requests again once it answers with the right model."""
        while True:
            await asyncio.sleep(PROBE_SECONDS)
            try:
                identity = await asyncio.wait_for(self.replicas[index].identity.remote(), PROBE_TIMEOUT_SECONDS)
            except Exception as exc:  # noqa: BLE001 - not back yet, whatever Serve says; the probe must go on
                log.debug("replica %d not back yet: %s", index, type(exc).__name__)
                continue
            self.fingerprint = self.fingerprint or identity["fingerprint"]
            if identity["fingerprint"] != self.fingerprint:
                log.error("replica %d came back serving model %s, not %s: kept out", index, identity["fingerprint"],
                          self.fingerprint)
                continue
            self.up[index] = True
            self.replica_up.labels(replica=str(index)).set(1)
            log.info("replica %d is back", index)
            return

    async def _kv_events_started(self) -> None:
        """The first request waits for a replica's first events: until then the replicas' namespace is unknown, and a
        prompt hashed without it would meet another replica on the ring than the same prompt later. It waits once:
        where no replica answers in time, requests are routed without the picture until one does."""
        self._follow_every_replica()
        if not self._first_kv_events.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._first_kv_events.wait(), PROBE_TIMEOUT_SECONDS)
            self._first_kv_events.set()

    def _follow_every_replica(self) -> None:
        """Start following the replicas' KV events (at deployment, or at the first request of a restarted front)."""
        if not self._kv_event_tasks:
            self._kv_event_tasks = [asyncio.create_task(self._follow_kv_events(i)) for i in range(len(self.replicas))]

    async def _follow_kv_events(self, index: int) -> None:
        """Keep the kv-aware policy's picture of one replica's prefix cache current, on its own, so a slow replica
        delays no other's. A replica that does not answer in time is asked again (its events wait in its log); one
        marked down was forgotten by the policy and sends its whole picture once it is back."""
        while True:
            if self.up[index]:
                try:
                    await self._read_kv_events(index)
                except Exception:  # the picture goes stale, routing goes on; logged, tried again
                    log.exception("replica %d's KV events could not be applied", index)
            await asyncio.sleep(KV_EVENTS_SECONDS)

    async def _read_kv_events(self, index: int) -> None:
        log_id, cursor = self.routing.cursors[index]
        finished = self.routing.num_finished(index)  # requests that ended before the events were asked for
        try:
            namespace, window, events = await asyncio.wait_for(
                self.replicas[index].kv_events.remote(log_id, cursor), PROBE_TIMEOUT_SECONDS)
        except Exception as exc:  # noqa: BLE001 - a replica that cannot answer now is asked again later
            log.debug("replica %d sent no KV events: %s", index, type(exc).__name__)
            return
        if self.up[index] and self.routing.cursors[index] == (log_id, cursor):  # not forgotten meanwhile
            self.routing.apply(index, namespace, events, window)
            self.routing.settle(index, finished)
            self.kv_blocks.labels(replica=str(index)).set(self.routing.num_held(index))
            self._first_kv_events.set()

    async def check_replicas(self) -> str:
        """Called once at deployment: every replica must serve the same model; a replica that restarts must
        come back with it."""
        identities = await asyncio.gather(*(replica.identity.remote() for replica in self.replicas))
        fingerprints = {identity["fingerprint"] for identity in identities}
        if len(fingerprints) != 1:
            raise KvstrataError(f"the replicas serve different models: {sorted(fingerprints)}")
        self.fingerprint = fingerprints.pop()
        if self.kv_aware:
            self._follow_every_replica()
        return self.fingerprint

    async def _metrics(self) -> Response:
        async def page(index: int) -> tuple[int, str | None]:
            try:
                call = ("GET", "/metrics", "", [], b"")
                messages = self.replicas[index].forward.options(stream=True).remote(*call)
                parts = await asyncio.wait_for(_collect(messages), METRICS_TIMEOUT_SECONDS)
                return index, b"".join(parts[1:]).decode()
            except Exception:  # noqa: BLE001 - a replica that cannot answer is left out of this page
                return index, None

        pages = await asyncio.gather(*(page(i) for i, up in enumerate(self.up) if up))
        text = merge_replica_metrics({i: p for i, p in pages if p is not None}, own=self.registry)
        return Response(text, media_type="text/plain; version=0.0.4")


async def _collect(messages) -> list:
    return [message async for message in messages]

"""The cluster's front under kv-aware routing, with stand-in replicas (no Ray): it reads each replica's KV events
before routing its first request, hashes prompts in the namespace they bring (a LoRA adapter's in a chain of its
own), and stops counting a request's blocks as in flight once the events after its end were read."""

import asyncio

import httpx
from starlette.requests import Request

from kvstrata.cluster import frontend
from kvstrata.cluster.asgi_call import ResponseStart
from kvstrata.cluster.frontend import REPLICA_HEADER, Frontend, FrontOptions
from kvstrata.cluster.routing import prompt_blocks
from kvstrata.kv.kv_events import KVEventLog
from kvstrata.server.protocol import CompletionRequest

NAMESPACE = b"model/weights/form/"
WINDOW = 32  # the replicas' sliding window, in tokens: two blocks


class Call:
    """A deployment handle's method: `.options(...).remote(...)` as Ray Serve's."""

    def __init__(self, function):
        self.function = function

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.function(*args)


class Answer:
    """A forwarded request's reply, as the replica's stream of messages."""

    def __init__(self, messages):
        self._messages = iter(messages)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._messages)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        pass


class StandInReplica:
    def __init__(self):
        self.log = KVEventLog()
        self.forward = Call(lambda *call: Answer([ResponseStart(200, [("content-type", "application/json")]), b"{}"]))
        self.kv_events = Call(self._kv_events)

    async def _kv_events(self, log_id, cursor):
        return NAMESPACE, WINDOW, self.log.since(log_id, cursor)


def test_the_front_routes_by_the_events_it_reads_and_settles_what_it_sent(tiny_llama, monkeypatch):
    monkeypatch.setattr(frontend, "KV_EVENTS_SECONDS", 3600)  # the first read only; the test reads the next itself
    replicas = [StandInReplica(), StandInReplica()]
    front = Frontend(FrontOptions(checkpoint=str(tiny_llama), routing="kv-aware", block_size=16,
                                  routing_prefix_tokens=64, max_request_bytes=2**20, lora_names=("sql",)), *replicas)

    def by_hashing(passage: list[int], namespace: bytes) -> int:
        return front.routing.ring_order(prompt_blocks(passage, 16, None, namespace)[3])[0]

    # A passage that hashing sends to one replica, with or without the namespace; only its events name the other.
    passage = next(p for p in ([3 + (k * i) % 300 for i in range(80)] for k in range(5, 50))
                   if by_hashing(p, NAMESPACE) == by_hashing(p, b""))
    blocks = prompt_blocks(passage, 16, None, NAMESPACE)
    holder = 1 - by_hashing(passage, NAMESPACE)
    for block in blocks[2:]:  # its head handed out (a window gives it back first): reused all the same
        replicas[holder].log.stored(block)

    async def app(scope, receive, send):
        response = await front(Request(scope, receive))
        await response(scope, receive, send)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
            answer = await client.post("/v1/completions", json={"model": "m", "prompt": passage + [9]})
            assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] == str(holder)
            assert front.routing.num_finished(holder) == 1  # ended; its blocks count until the next events are read
            await front._read_kv_events(holder)
            assert front.routing.num_finished(holder) == 0 and not front.routing._in_flight[holder]
            for task in front._kv_event_tasks:
                task.cancel()

            on_adapter, _ = front._route_on(CompletionRequest, b'{"model": "sql", "prompt": "Where is Highbury?"}')
            on_base, _ = front._route_on(CompletionRequest, b'{"model": "m", "prompt": "Where is Highbury?"}')
            assert on_base == prompt_blocks(front.tokenizer.encode("Where is Highbury?"), 16, None, NAMESPACE)
            assert set(on_adapter).isdisjoint(on_base)

    asyncio.run(scenario())

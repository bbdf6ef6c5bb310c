"""use_beam_search on the server: an API request's beam searches run round by round on the async engine (each
round one request per running beam, engine/beam_search.py), and each prompt's best beams come back as its
choices, all at the end (a beam is not known to be among the best before the search ends)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from kvstrata.engine.beam_search import BeamSearch
from kvstrata.engine.outputs import RequestMetrics, RequestOutput
from kvstrata.server.async_engine import AsyncEngine, Choice, ServerError


class ClientDisconnected(ServerError):
    """The client left while its beam search ran: the search stops after the round in flight."""

    status = 499
    kind = "client_closed_request"


async def beam_search_choices(engine: AsyncEngine, searches: list[BeamSearch], tokenizer,
                              disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Choice]:
    """Run `searches` (one per prompt of the API request, each `n` beams wide) together, a round of all of them
    at a time; then yield prompt p's beam i as choice p * n + i, a finished output. A failed round request fails
    the API request, as a failed choice does (AsyncEngine.generate raises, the round's other requests aborted);
    `disconnected` is asked between rounds."""
    arrival, admitted = time.perf_counter(), False  # the first round's requests wait their turn, the later ones not
    while running := [search for search in searches if not search.done]:
        if disconnected is not None and await disconnected():
            raise ClientDisconnected("the client left before its beam search ended")
        requests = [(request, params) for search in running
                    for params in [search.round_params()] for request in search.round_requests()]
        finals: dict[int, RequestOutput] = {}
        async for index, output in engine.generate([(request.token_ids, params) for request, params in requests],
                                                   [request.preloaded for request, _ in requests],
                                                   admitted=admitted):
            if output.finished:
                finals[index] = output
        admitted = True
        now, place = time.perf_counter(), 0
        for search in running:
            beams = len(search.running)
            search.advance([finals[index] for index in range(place, place + beams)], now)
            place += beams
    end = time.perf_counter()
    for number, search in enumerate(searches):
        result = search.output(tokenizer)
        for rank, (beam, text) in enumerate(zip(result.sequences, result.texts)):
            tokens = list(beam.token_ids)
            metrics = RequestMetrics(arrival, search.first_round_end, end, len(tokens), num_preemptions=0)
            yield number * search.params.beam_width + rank, RequestOutput(
                request_id=f"beam-{number}-{rank}", prompt=None, prompt_token_ids=search.prompt_token_ids, text=text,
                finished=True, finish_reason=beam.finish_reason, num_cached_tokens=search.num_cached_prompt_tokens,
                metrics=metrics, new_text=text, new_token_ids=tokens, all_token_ids=search.prompt_token_ids + tokens)

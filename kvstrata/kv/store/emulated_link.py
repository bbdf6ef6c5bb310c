"""An emulated network link in front of a remote tier: a token bucket whose rate follows a bandwidth trace.

This is emulation, for measuring adaptation on one machine: the bytes of every read travel for real (over
loopback to a real Redis server), and the read then waits until the emulated link would have delivered
them. Only reads pay (the links emulated are full duplex, and writes go the other way, in the background).
The trace's clock restarts at every load (`restart`), so each streamed context meets the same link.

Trace syntax (`--kv-store-link-gbps`): comma-separated GBPS[:SECONDS] segments, each lasting SECONDS; the
last lasts for ever. "1" is a steady 1 Gbps; "10:0.3,0.1" is 10 Gbps for 0.3 s, then 0.1 Gbps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.errors import KvstrataError

BYTES_PER_GBIT = 1e9 / 8
BURST_BYTES = 64 * 2**10  # what an idle link may send at once (about a TCP window)
EXAMPLE = "1 (steady 1 Gbps) or 10:0.3,0.1 (10 Gbps for 0.3 s, then 0.1 Gbps)"


@dataclass(frozen=True)
class Segment:
    gbps: float
    seconds: float  # the last segment lasts for ever, whatever this says


def parse_trace(spec: str) -> list[Segment]:
    segments = []
    parts = [part.strip() for part in str(spec).split(",")]
    for index, part in enumerate(parts):
        rate, _, duration = part.partition(":")
        last = index == len(parts) - 1
        try:
            gbps, seconds = float(rate), float(duration) if duration else float("inf")
        except ValueError:
            raise KvstrataError(f"kv_store_link_gbps part {part!r} is not GBPS[:SECONDS]; e.g. {EXAMPLE}") from None
        if not 0.001 <= gbps <= 10_000:
            raise KvstrataError(f"kv_store_link_gbps part {part!r}: {gbps} Gbps is outside 0.001 .. 10000")
        if not last and not 0 < seconds < float("inf"):
            raise KvstrataError(f"kv_store_link_gbps part {part!r} needs a positive duration (every segment but "
                                f"the last); e.g. {EXAMPLE}")
        segments.append(Segment(gbps, seconds))
    return segments


class EmulatedLink:
    def __init__(self, segments: list[Segment], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.segments = segments
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self.restart()

    def restart(self) -> None:
        """The trace starts again now, with a full bucket."""
        with self._lock:
            self._origin = self._clock()
            self._tokens = BURST_BYTES  # bytes the link may send before it must wait
            self._updated = 0.0  # trace time of the last update

    def now(self) -> float:
        return self._clock()

    def transfer(self, num_bytes: int, began: float) -> None:
        """Wait until the link would have delivered `num_bytes` more, asked for at `began` (a `now()`): a read's own
        time on loopback counts, and reads queue behind each other."""
        with self._lock:
            now = self._clock() - self._origin
            start = max(began - self._origin, self._updated)
            self._tokens = min(BURST_BYTES, self._tokens + self._bytes_between(self._updated, start)) - num_bytes
            self._updated = start if self._tokens >= 0 else self._time_to_send(start, -self._tokens)
            self._tokens = max(self._tokens, 0)
            wait = self._updated - now
        if wait > 0:
            self._sleep(wait)

    def _bytes_between(self, begin: float, end: float) -> float:
        """Bytes the trace lets through between trace times `begin` and `end`."""
        total, segment_start = 0.0, 0.0
        for index, segment in enumerate(self.segments):
            segment_end = float("inf") if index == len(self.segments) - 1 else segment_start + segment.seconds
            overlap = min(end, segment_end) - max(begin, segment_start)
            if overlap > 0:
                total += overlap * segment.gbps * BYTES_PER_GBIT
            segment_start = segment_end
        return total

    def _time_to_send(self, begin: float, num_bytes: float) -> float:
        """The trace time at which `num_bytes` sent from `begin` on have gone through."""
        segment_start = 0.0
        for index, segment in enumerate(self.segments):
            last = index == len(self.segments) - 1
            segment_end = float("inf") if last else segment_start + segment.seconds
            if segment_end > begin:
                rate = segment.gbps * BYTES_PER_GBIT
                start = max(begin, segment_start)
                if last or (segment_end - start) * rate >= num_bytes:
                    return start + num_bytes / rate
                num_bytes -= (segment_end - start) * rate
            segment_start = segment_end
        raise AssertionError("the last segment lasts for ever")

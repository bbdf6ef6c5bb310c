"""A link model (`--kv-link`): turns bytes counted between host pool and compute device into a modeled time.

The bandwidths are the nominal per-direction figures of an x16 slot (PCIe 3.0: 8 GT/s x 16 lanes x 128/130,
i.e. 15.75 GB/s; each later generation doubles it); a transfer also pays a fixed start latency (10 µs, an
assumption standing for a DMA launch). Every time made with it is reported as modeled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.errors import KvstrataError

NAMED_LINKS = {"pcie3": 15.75e9, "pcie4": 31.5e9, "pcie5": 63.0e9}  # bytes per second
TRANSFER_LATENCY_S = 10e-6


@dataclass(frozen=True)
class LinkModel:
    name: str
    bytes_per_second: float
    latency_s: float = TRANSFER_LATENCY_S

    def seconds(self, num_bytes: int) -> float:
        """Modeled time of one transfer of `num_bytes` (none for nothing moved)."""
        return self.latency_s + num_bytes / self.bytes_per_second if num_bytes else 0.0


def parse_link(text: str) -> LinkModel:
    """'pcie3', 'pcie4', 'pcie5' or a bandwidth in GB/s ('12.5')."""
    if text in NAMED_LINKS:
        return LinkModel(text, NAMED_LINKS[text])
    try:
        gigabytes = float(text)
    except ValueError:
        gigabytes = float("nan")
    if not 0 < gigabytes < 1e6:
        raise KvstrataError(f"kv_link {text!r} is not one of {', '.join(NAMED_LINKS)} or a bandwidth in GB/s")
    return LinkModel(f"{gigabytes:g}GB/s", gigabytes * 1e9)

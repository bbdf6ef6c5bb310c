"""What crosses between the host pool and the compute device, counted per layer (`OffloadStats`).

`copied_bytes` are the bytes of the tensors actually copied to the device (decoded K/V, padding rows of whole
blocks included); `stored_form_bytes` are what the same rows occupy in the host pool's format, what a device-
side decoder would move. Decode reads are also counted in rows (one token of one KV head): the fraction of
the cached KV a layer fetched is `decode_fetched_rows / decode_cached_rows`.
"""

from __future__ import annotations

import numpy as np

from kvstrata.kv.offload.link import LinkModel


class OffloadStats:
    def __init__(self, num_layers: int, link: LinkModel):
        self.link = link
        self.copied_bytes = np.zeros(num_layers, dtype=np.int64)  # host pool -> device, per layer
        self.stored_form_bytes = np.zeros(num_layers, dtype=np.int64)
        self.written_bytes = np.zeros(num_layers, dtype=np.int64)  # device -> host pool (new K/V)
        self.decode_fetched_rows = np.zeros(num_layers, dtype=np.int64)
        self.decode_cached_rows = np.zeros(num_layers, dtype=np.int64)
        self.selected_per_head = np.zeros(num_layers, dtype=np.int64)  # sum over decodes of a query head's count
        self.decodes = np.zeros(num_layers, dtype=np.int64)  # decode (sequence, layer) selections counted above
        self.modeled_transfer_s = np.zeros(num_layers)  # the link model's time of every copy, per layer
        self.transfers = 0
        self.recall_mass = 0.0  # diagnostics: attention mass of the fetched keys, summed over query heads
        self.recall_heads = 0

    def fetched(self, layer: int, copied_bytes: int, stored_form_bytes: int) -> None:
        self.copied_bytes[layer] += copied_bytes
        self.stored_form_bytes[layer] += stored_form_bytes
        self.modeled_transfer_s[layer] += self.link.seconds(stored_form_bytes)
        self.transfers += 1

    def decode_rows(self, layer: int, fetched: int, cached: int) -> None:
        self.decode_fetched_rows[layer] += fetched
        self.decode_cached_rows[layer] += cached

    def summary(self) -> dict:
        cached = self.decode_cached_rows
        fraction = np.divide(self.decode_fetched_rows, cached, out=np.zeros(len(cached)), where=cached > 0)
        return {
            "link": self.link.name,
            "copied_bytes": int(self.copied_bytes.sum()),
            "stored_form_bytes": int(self.stored_form_bytes.sum()),
            "written_bytes": int(self.written_bytes.sum()),
            "modeled_transfer_s": float(self.modeled_transfer_s.sum()),
            "decode_fraction_fetched": float(self.decode_fetched_rows.sum() / max(cached.sum(), 1)),
            "decode_fraction_fetched_per_layer": [round(float(f), 4) for f in fraction],
            "tokens_per_query_head": (float(self.selected_per_head.sum() / self.decodes.sum())
                                      if self.decodes.sum() else None),
            "recall_of_attention_mass": self.recall_mass / self.recall_heads if self.recall_heads else None,
        }

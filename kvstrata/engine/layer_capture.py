"""What each layer sees and makes during a prefill, captured for calibrations and analyses: the layer's input
(the residual stream), its queries and keys after RoPE, and its attention output (before the output projection)."""

from __future__ import annotations

import torch

from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError
from kvstrata.kv.attention_policy import FullAttention


class _LayerRecorder(FullAttention):
    def __init__(self, storage, num_layers: int, keep_inputs: bool):
        super().__init__(storage)
        self.keep_inputs = keep_inputs
        self.inputs: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.queries: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.outputs: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def on_layer_input(self, layer, x, batch):
        if self.keep_inputs:
            self.inputs[layer].append(x.float().cpu())

    def attention(self, layer, q, k_new, v_new, batch):
        out = super().attention(layer, q, k_new, v_new, batch)
        self.queries[layer].append(q.float().cpu())
        if self.keep_inputs:
            self.outputs[layer].append(out.float().cpu())
        return out


def capture_layers(engine, token_ids: list[int], keep_inputs: bool = False) -> dict[str, torch.Tensor]:
    """Prefill `token_ids` on `engine` (whose KV stays on the device) and return float32 CPU tensors: "q"
    [layers, T, heads, D] and "k" [layers, T, kv_heads, D] after RoPE; with keep_inputs also "x" [layers, T,
    hidden] (each layer's input) and "attended" [layers, T, heads, D] (each layer's attention output)."""
    if engine.config.kv_offload != "none":
        raise KvstrataError("layers are captured on an engine whose KV stays on the device (kv_offload none)")
    runner = engine.runner
    recorder = _LayerRecorder(engine.kv_cache, engine.loaded.config.num_layers, keep_inputs)
    runner.policy, kept = recorder, runner.policy
    try:
        k, _ = compute_kv(engine, token_ids)
    finally:
        runner.policy = kept
    stack = lambda per_layer: torch.stack([torch.cat(chunks) for chunks in per_layer])
    captured = {"q": stack(recorder.queries), "k": k}
    if keep_inputs:
        captured.update(x=stack(recorder.inputs), attended=stack(recorder.outputs))
    return captured

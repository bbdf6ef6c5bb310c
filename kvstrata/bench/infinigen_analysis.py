"""InfiniGen's analyses on the loaded model (papers/infinigen.md §1, §5b): how alike consecutive layers' inputs
are (Table 1), how much the skew concentrates the queries and keys, and how much of each layer's true attention
mass the tokens speculated one layer ahead hold (Fig. 13), with and without the skew and against an oracle that
speculates from the layer's own input.

One prefill of a text is captured layer by layer; queries at `num_queries` positions spread over the second half
are then scored as decodes would be: each against the keys before it, the selection made by the engine's own
`select_tokens`, each KV head reading the union of what its query heads chose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kv.offload.infinigen import InfiniGenSettings
from kvstrata.kv.offload.skew import InfiniGenSkew
from kvstrata.kv.offload.speculation import select_tokens


def layer_similarity(x: torch.Tensor, attention_out: torch.Tensor, ffn_out: torch.Tensor) -> list[dict]:
    """Table 1: per layer i >= 1, the mean cosine similarity of T_i (layer i's input) with T_{i-1},
    Attn_out_{i-1} and FFN_out_{i-1} (x [L, T, hidden]; the outputs [L, T, hidden] of each layer)."""
    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return round(float(F.cosine_similarity(a, b, dim=-1).mean()), 4)

    return [{"layer": i, "t_prev": cosine(x[i], x[i - 1]), "attn_out_prev": cosine(x[i], attention_out[i - 1]),
             "ffn_out_prev": cosine(x[i], ffn_out[i - 1])} for i in range(1, x.shape[0])]


def energy_share(q: torch.Tensor, k: torch.Tensor, rotation: torch.Tensor | None, ratio: float) -> float:
    """Share of the column energy (sum of squares of Q and K per channel) in each (layer, KV head)'s top `ratio`
    of channels, averaged; after the skew when `rotation` [L, G, D, D] is given."""
    grouped_q, keys = _by_kv_head(q, k.shape[2]), k.transpose(1, 2)  # [L, G, rows, D]
    if rotation is not None:
        grouped_q, keys = grouped_q @ rotation, keys @ rotation
    energy = grouped_q.square().mean(2) + keys.square().mean(2)  # [L, G, D]
    top = energy.topk(max(1, int(ratio * energy.shape[-1])), dim=-1).values.sum(-1)
    return float((top / energy.sum(-1)).mean())


def _by_kv_head(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    layers, tokens, heads, dim = q.shape
    return q.view(layers, tokens, kv_heads, heads // kv_heads, dim).permute(0, 2, 1, 3, 4).reshape(
        layers, kv_heads, -1, dim)


def speculation_recall(captured: dict, speculated_q: torch.Tensor, skew: InfiniGenSkew,
                       settings: InfiniGenSettings, query_positions: torch.Tensor) -> dict[str, list[float]]:
    """Per layer (from 1), recall of attention mass and fraction of the cached KV fetched, for four speculations:
    "skew" (the engine's: layer i-1's input, skewed partial keys, the calibrated channels), "no_skew" (the same
    without the rotation, channels ranked on this text), "skew_per_prompt" (channels ranked on this text, as the
    paper does at prefill) and "oracle" (layer i's own queries, skewed). speculated_q [L, P, heads, D]: layer i's
    queries of layer i-1's input at the query positions."""
    q, k = captured["q"], captured["k"]
    layers, _, kv_heads, dim = k.shape
    eye = torch.eye(dim).expand(layers, kv_heads, dim, dim)
    ranked_here = lambda rotation: _column_weights(q, k, rotation)
    variants = {
        "skew": (speculated_q, skew.rotation, skew.column_weights),
        "no_skew": (speculated_q, eye, ranked_here(eye)),
        "skew_per_prompt": (speculated_q, skew.rotation, ranked_here(skew.rotation)),
        "oracle": (q[:, query_positions], skew.rotation, skew.column_weights),
    }
    out: dict[str, list[float]] = {}
    for name, (queries, rotation, weights) in variants.items():
        recall, fetched = [], []
        for layer in range(1, layers):
            r, f = _layer_recall(q[layer, query_positions], queries[layer], k[layer], rotation[layer], weights[layer],
                                 settings, query_positions)
            recall.append(round(r, 4))
            fetched.append(round(f, 4))
        out[f"{name}_recall"], out[f"{name}_fraction"] = recall, fetched
    return out


def tokens_for_mass(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                    masses: tuple[float, ...] = (0.9, 0.95, 0.99)) -> dict[str, list[float]]:
    """Per layer, the fewest keys (as a share of the keys a query sees) that hold each share of a query head's true
    attention mass, averaged over heads and query positions (the paper's Fig. 5 question): what even a perfect
    selection must fetch."""
    layers, tokens, kv_heads, dim = k.shape
    group = q.shape[2] // kv_heads
    visible = torch.arange(tokens)[None] <= positions[:, None]  # [P, T]
    seen = visible.sum(-1).float()[None, :, None]
    out: dict[str, list[float]] = {f"mass_{m}": [] for m in masses}
    for layer in range(layers):
        queries = q[layer, positions].view(len(positions), kv_heads, group, dim).transpose(0, 1)
        scores = queries @ k[layer].transpose(0, 1).transpose(-1, -2)[:, None] * dim**-0.5
        cumulative = scores.masked_fill(~visible[None, :, None], float("-inf")).softmax(-1).sort(
            -1, descending=True).values.cumsum(-1)
        for m in masses:
            needed = (cumulative < m).sum(-1).float() + 1
            out[f"mass_{m}"].append(round(float((needed / seen).mean()), 4))
    return out


def _column_weights(q: torch.Tensor, k: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    grouped_q, keys = _by_kv_head(q, k.shape[2]) @ rotation, k.transpose(1, 2) @ rotation
    return grouped_q.abs().mean(2) + keys.abs().mean(2)


def _layer_recall(true_q, spec_q, k, rotation, weights, settings: InfiniGenSettings, positions) -> tuple[float, float]:
    """true_q / spec_q [P, heads, D], k [T, G, D], rotation [G, D, D], weights [G, D]."""
    count = max(1, int(settings.partial_ratio * k.shape[-1]))
    columns = weights.topk(count, dim=-1).indices  # [G, r]
    partial = rotation.gather(-1, columns[:, None, :].expand(-1, rotation.shape[1], -1))  # [G, D, r]
    kv_heads, dim = k.shape[1], k.shape[2]
    group = true_q.shape[1] // kv_heads
    grouped = lambda x: x.view(x.shape[0], kv_heads, group, dim).transpose(0, 1)  # [G, P, group, D]
    keys = k.transpose(0, 1)  # [G, T, D]
    spec_scores = (grouped(spec_q) @ partial[:, None]) @ (keys @ partial).transpose(-1, -2)[:, None] * dim**-0.5
    key_positions = torch.arange(k.shape[0])
    cached = key_positions[None] < positions[:, None]  # [P, T]: the keys before each query
    recent = key_positions[None] >= (positions - settings.recent)[:, None] if settings.recent else None
    selection = select_tokens(spec_scores, cached, settings.alpha, settings.max_fraction, recent)
    chosen = selection.chosen.float()
    chosen[:, torch.arange(len(positions)), positions] = 1  # the query's own token is always attended
    true_scores = grouped(true_q) @ keys.transpose(-1, -2)[:, None] * dim**-0.5  # [G, P, group, T]
    visible = key_positions[None] <= positions[:, None]
    probs = true_scores.masked_fill(~visible[None, :, None], float("-inf")).softmax(-1)
    recall = float((probs * chosen[:, :, None]).sum(-1).mean())
    fraction = float(selection.chosen.sum() / (cached.sum() * kv_heads))
    return recall, fraction


@torch.inference_mode()
def analyze(engine, token_ids: list[int], skew: InfiniGenSkew, settings: InfiniGenSettings, num_queries: int) -> dict:
    """Table 1, the skew's energy share and the speculation recall on one prefill of `token_ids`."""
    from kvstrata.engine.layer_capture import capture_layers

    captured = capture_layers(engine, token_ids, keep_inputs=True)
    model = engine.loaded.model
    x, attended = captured["x"], captured["attended"]
    attention_out = torch.stack([_output_projection(layer)(attended[i].flatten(1)).float()
                                 for i, layer in enumerate(model.layers)])
    ffn_out = x[1:] - x[:-1] - attention_out[:-1]  # T_i = T_{i-1} + Attn_out_{i-1} + FFN_out_{i-1}
    tokens = len(token_ids)
    positions = torch.linspace(tokens // 2, tokens - 1, num_queries).long().unique()
    dtype = next(model.parameters()).dtype
    speculated = torch.stack([torch.zeros(len(positions), *captured["q"].shape[2:])] + [
        model.layer_queries(i, x[i - 1, positions].to(engine.device, dtype), positions.to(engine.device)).float().cpu()
        for i in range(1, len(model.layers))])
    return {
        "layer_similarity": layer_similarity(x, attention_out, ffn_out),
        "energy_share_top": {"ratio": settings.partial_ratio,
                             "before_skew": round(energy_share(captured["q"], captured["k"], None, settings.partial_ratio), 4),
                             "after_skew": round(energy_share(captured["q"], captured["k"], skew.rotation,
                                                              settings.partial_ratio), 4)},
        "query_positions": len(positions),
        "share_of_keys_needed": tokens_for_mass(captured["q"], captured["k"], positions),
        "speculation": speculation_recall(captured, speculated, skew, settings, positions),
    }


def _output_projection(layer):
    attention = layer.self_attn
    return attention.o_proj if hasattr(attention, "o_proj") else attention.out_proj


def run_infinigen_analysis(args) -> None:
    import dataclasses

    from kvstrata.bench.report import emit, engine_info, machine_info
    from kvstrata.bench.workload import read_text
    from kvstrata.cli.engine_args import engine_config_from_args
    from kvstrata.engine.kv_offload_setup import infinigen_skew_for
    from kvstrata.engine.llm_engine import LLMEngine

    config = dataclasses.replace(engine_config_from_args(args, varied=("kv_offload",)), kv_offload="none")
    engine = LLMEngine(config)
    token_ids = engine.tokenize(read_text(args.text))[args.skip_tokens : args.skip_tokens + args.context]
    settings = config.infinigen_settings()
    result = analyze(engine, token_ids, infinigen_skew_for(engine), settings, args.num_queries)
    speculated_layers = slice(settings.full_layers - 1, None)  # rows are layers 1 ..; the engine speculates from full_layers
    means = {name: round(sum(values[speculated_layers]) / len(values[speculated_layers]), 4)
             for name, values in result["speculation"].items()}
    emit({"benchmark": "infinigen-analysis", "machine": machine_info(), **engine_info(engine),
          "workload": {"text": args.text.name, "skip_tokens": args.skip_tokens, "context": len(token_ids),
                       "num_queries": result["query_positions"]},
          "mean_over_speculated_layers": means, **result}, args.json)

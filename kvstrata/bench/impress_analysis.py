"""IMPRESS's observations on the loaded model (papers/impress.md §2, §7): do a layer's heads agree on which
prefix tokens matter (O1), at every important-token ratio (O2), and how often would the probe heads' check send
a layer back to reading its whole prefix.

A prefix of `prefix` tokens of a text is followed, one at a time, by `questions` different questions (an
instruction around a passage quoted from elsewhere in the text). One prefill of prefix + question is captured
layer by layer; the question's queries score every prefix token per query head (important_tokens.prefix_scores),
and each head's top ceil(r * n) tokens are its important set.

The quality part reads what the choices cost: windows of a prefix and the text after it, whose first
`prompt_tokens` choose each layer's prefix tokens (IMPRESS, or keys-only H2O), and every new token attends over
those plus the new tokens; the perplexity of the tokens after the prompt and the greedy agreement with a full
read of the prefix (the same forward, every prefix token read).
"""

from __future__ import annotations

import math

import torch

from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError
from kvstrata.kv.context_attention import AttendOverContext
from kvstrata.kv.impress.important_tokens import (
    agreement_threshold,
    head_scores,
    important_count,
    mean_pairwise_jaccard,
    random_jaccard,
    shared_set,
    top_sets,
)
from kvstrata.kv.impress.prefix_selection import PrefixSelector, probe_heads

QUESTION_HEAD = "\n\nQuestion: Which part of the text above is closest to this passage?\n\""
QUESTION_TAIL = "\"\nAnswer:"
ALPHAS = (0.4, 0.5, 0.6, 0.8, 1.0)
FIRST_SCORED = 64  # the continuation's first tokens, nearest the prompt that chose, are also scored apart


def ratio_observations(scores: list[torch.Tensor], ratio: float, probes: int, max_probes: int) -> dict:
    """For one ratio, per layer (scores: [heads, n] per layer): the probe heads' and all heads' mean pairwise
    Jaccard, the random value and the threshold; the share of layers falling back per alpha and per number of
    probe heads (heads 0 .. p-1 at alpha 0.6; past one KV group's heads, probing reads more keys); and the share
    of each head's prefix attention mass that the probes' shared set (vote) holds, in every layer, against each
    head's own top set."""
    n = scores[0].shape[1]
    count = important_count(ratio, n)
    share = count / n
    threshold = agreement_threshold(share)
    probe, every, shared_mass, own_mass = [], [], [], []
    by_probes = {p: 0 for p in range(2, max_probes + 1)}
    for layer in scores:
        sets = top_sets(layer, count)
        probe.append(mean_pairwise_jaccard(sets[:probes]))
        every.append(mean_pairwise_jaccard(sets))
        for p in by_probes:
            by_probes[p] += mean_pairwise_jaccard(sets[:p]) < threshold
        mass = layer / layer.sum(1, keepdim=True)
        chosen = shared_set(layer[:probes], sets[:probes], count)
        shared_mass.append(float(mass[:, chosen].sum(1).mean()))
        own_mass.append(float((mass * sets).sum(1).mean()))
    layers = len(scores)
    return {
        "ratio": ratio, "share": round(share, 4), "random_jaccard": round(random_jaccard(share), 4),
        "threshold_alpha_0.6": round(threshold, 4),
        "probe_jaccard": [round(j, 4) for j in probe], "all_heads_jaccard": [round(j, 4) for j in every],
        "fallback_share_by_alpha": {str(a): round(sum(j < agreement_threshold(share, a) for j in probe) / layers, 4)
                                    for a in ALPHAS},
        "fallback_share_by_probe_heads": {str(p): round(c / layers, 4) for p, c in by_probes.items()},
        "shared_set_mass": [round(m, 4) for m in shared_mass], "own_set_mass": [round(m, 4) for m in own_mass],
    }


def question_tokens(engine, text_ids: list[int], start: int, length: int) -> list[int]:
    encode = engine.tokenizer.encode
    return encode(QUESTION_HEAD, add_special_tokens=False) + text_ids[start : start + length] + encode(
        QUESTION_TAIL, add_special_tokens=False)


@torch.inference_mode()
def analyze(engine, text_ids: list[int], prefix: int, questions: int, quote_tokens: int,
            ratios: tuple[float, ...]) -> dict:
    """Observations averaged over the questions (per layer) and over layers."""
    from kvstrata.engine.layer_capture import capture_layers

    config = engine.loaded.config
    probes = probe_heads(config.num_heads, config.num_kv_heads)
    spare = len(text_ids) - prefix - quote_tokens
    if spare < questions:
        raise KvstrataError(f"the text holds {len(text_ids)} tokens: too few for a prefix of {prefix} and "
                         f"{questions} quotes of {quote_tokens} after it")
    per_question = []
    for i in range(questions):
        start = prefix + i * (spare // questions)
        ids = text_ids[:prefix] + question_tokens(engine, text_ids, start, quote_tokens)
        captured = capture_layers(engine, ids)
        q, k = captured["q"], captured["k"]
        scores = [head_scores(q[layer, prefix:], k[layer, :prefix], k[layer, prefix:], config.num_heads)
                  for layer in range(config.num_layers)]
        per_question.append([ratio_observations(scores, r, probes, min(5, config.num_heads)) for r in ratios])
    return {"probe_heads": probes, "by_ratio": [_mean_over_questions([q[i] for q in per_question])
                                                     for i in range(len(ratios))]}


@torch.inference_mode()
def selection_quality(engine, text_ids: list[int], windows: int, prefix: int, prompt_tokens: int,
                      scored_tokens: int, ratios: tuple[float, ...], rules: tuple[str, ...] = ("vote",)) -> dict:
    """Per method (IMPRESS with each of `rules` for its shared set, keys-only H2O) and ratio, over `windows` windows
    spread over the text: perplexity against the full read's (of
    all scored tokens and of the first FIRST_SCORED), greedy agreement with it, the share of layers falling back
    and the share of the prefix's bytes read (derived)."""
    config, model = engine.loaded.config, engine.runner.model
    span = prefix + prompt_tokens + scored_tokens
    if windows < 1 or len(text_ids) < span:
        raise KvstrataError(f"the text holds {len(text_ids)} tokens: too few for one window of {span}")
    sums: dict[str, dict[str, float]] = {}
    for start in torch.linspace(0, len(text_ids) - span, windows).long().tolist():
        k, v = (list(x.to(engine.device)) for x in compute_kv(engine, text_ids[start : start + prefix]))
        new = text_ids[start + prefix : start + span]
        full = _continuation_log_probs(model, k, v, new, prefix, prompt_tokens, None)
        targets = torch.tensor(new[prompt_tokens:])
        rows = {"full": (full, None)}
        choices = [("impress", rule, f"impress-{rule}") for rule in rules] + [("h2o-keys", "vote", "h2o-keys")]
        for method, rule, name in choices:
            for ratio in ratios:
                selector = PrefixSelector(k, method, ratio, prompt_tokens, rule=rule)
                rows[f"{name} r={ratio}"] = (
                    _continuation_log_probs(model, k, v, new, prefix, prompt_tokens, selector), selector)
        for name, (logp, selector) in rows.items():
            row = sums.setdefault(name, {})
            losses = -logp.gather(1, targets[:, None])
            measures = {
                "nll": float(losses.mean()),
                "nll_first": float(losses[:FIRST_SCORED].mean()),
                "agreement": float((logp.argmax(-1) == full.argmax(-1)).float().mean()),
                "fallback_share": 0.0 if selector is None else
                sum(d.fallback for d in selector.decisions.values()) / len(selector.decisions),
                "read_share_derived": 1.0 if selector is None else selector.read_share(config.num_heads,
                                                                                       config.num_kv_heads),
            }
            for key, value in measures.items():
                row[key] = row.get(key, 0.0) + value / windows
    full = sums["full"]
    change = lambda row, key: round(math.exp(row[key] - full[key]) - 1, 4)
    return {name: {"perplexity": round(math.exp(row["nll"]), 4), "perplexity_vs_full": change(row, "nll"),
                   f"perplexity_vs_full_first_{FIRST_SCORED}": change(row, "nll_first"),
                   **{key: round(row[key], 4) for key in ("agreement", "fallback_share", "read_share_derived")}}
            for name, row in sums.items()}


def _continuation_log_probs(model, k, v, new: list[int], prefix: int, prompt_tokens: int, selector) -> torch.Tensor:
    """Log-probabilities [scored, vocab] of the new tokens after the prompt, the new tokens attending over the
    prefix's K/V (per layer, the tokens `selector` chooses) and themselves."""
    device = k[0].device
    hidden = model(torch.tensor(new, device=device), torch.arange(prefix, prefix + len(new), device=device),
                   AttendOverContext(k, v, selector), None)
    return model.compute_logits(hidden).float()[prompt_tokens - 1 : -1].log_softmax(-1).cpu()


def _mean_over_questions(rows: list[dict]) -> dict:
    def mean(values):
        if isinstance(values[0], list):
            return [round(sum(column) / len(column), 4) for column in zip(*values)]
        if isinstance(values[0], dict):
            return {key: mean([v[key] for v in values]) for key in values[0]}
        return round(sum(values) / len(values), 4)

    out = {key: mean([row[key] for row in rows]) for key in rows[0]}
    for key in ("probe_jaccard", "all_heads_jaccard", "shared_set_mass", "own_set_mass"):
        out[f"{key}_mean"] = round(sum(out[key]) / len(out[key]), 4)
    return out


def run_impress_analysis(args) -> None:
    import dataclasses

    from kvstrata.bench.report import emit, engine_info, machine_info
    from kvstrata.bench.workload import read_text
    from kvstrata.cli.engine_args import engine_config_from_args
    from kvstrata.engine.llm_engine import LLMEngine

    engine = LLMEngine(dataclasses.replace(engine_config_from_args(args, varied=("kv_offload",)), kv_offload="none"))
    text_ids = engine.tokenize(read_text(args.text))[args.skip_tokens :]
    ratios = tuple(float(r) for r in args.ratios.split(","))
    result = analyze(engine, text_ids, args.prefix, args.questions, args.quote_tokens, ratios)
    if args.quality_windows:
        rules = tuple(rule.strip() for rule in args.rules.split(","))
        result["quality"] = selection_quality(engine, text_ids, args.quality_windows, args.prefix, args.prompt_tokens,
                                              args.scored_tokens, ratios, rules)
    emit({"benchmark": "impress-analysis", "machine": machine_info(), **engine_info(engine),
          "workload": {"text": args.text.name, "skip_tokens": args.skip_tokens, "prefix": args.prefix,
                       "questions": args.questions, "quote_tokens": args.quote_tokens,
                       "question_template": QUESTION_HEAD + "<quote>" + QUESTION_TAIL,
                       "quality_windows": args.quality_windows, "prompt_tokens": args.prompt_tokens,
                       "scored_tokens": args.scored_tokens, "rules": args.rules},
          **result}, args.json)

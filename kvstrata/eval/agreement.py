"""`kvstrata eval agreement`: how far a configuration's next-token distributions drift from a reference.

The reference configuration generates a greedy continuation of each prompt; then every
configuration scores prompt + continuation teacher-forced through its own cache. Reported per
configuration: `agreement` (share of positions whose argmax is the reference's token) and `kl`
(mean KL(reference || configuration) over those positions).
"""

from __future__ import annotations

import torch

from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.eval.cache_scorer import CacheScorer


def greedy_continuations(engine: LLMEngine, prompts: list[list[int]], length: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.token_ids
    return [done[i] for i in ids]


def continuation_log_probs(engine: LLMEngine, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Log-distributions [len(continuation), vocab] predicting each continuation token, read through the cache."""
    scorer = CacheScorer(engine)
    return [
        scorer.next_token_logits(p + c, context_len=len(p)).log_softmax(-1).cpu()
        for p, c in zip(prompts, continuations)
    ]


def compare_distributions(reference: list[torch.Tensor], candidate: list[torch.Tensor], tokens: list[list[int]]) -> dict:
    agree = total = 0
    kl_sum = 0.0
    for ref, cand, toks in zip(reference, candidate, tokens):
        agree += int((cand.argmax(-1) == torch.tensor(toks)).sum())
        kl_sum += float((ref.exp() * (ref - cand)).sum(-1).clamp_min(0).sum())
        total += len(toks)
    return {"agreement": round(agree / total, 6), "kl": round(kl_sum / total, 8), "positions": total}

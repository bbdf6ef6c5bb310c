"""Drive the engine's model and cache directly, for comparisons with transformers; run one request alone."""

from __future__ import annotations

import torch

from kvstrata.bench.workload import run_together
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.sequence import Sequence


def prefill_in_chunks(engine: LLMEngine, token_ids: list[int], chunk: int,
                      seq_id: int = 10**6) -> tuple[torch.Tensor, Sequence]:
    """Logits at every position [T, vocab] from prefilling `token_ids` `chunk` tokens per step."""
    seq = Sequence(seq_id=seq_id, request_id=f"probe-{seq_id}", prompt=None, prompt_token_ids=token_ids, params=SamplingParams())
    pieces = []
    with torch.inference_mode():
        while seq.num_pending_tokens:
            n = min(chunk, seq.num_pending_tokens)
            assert engine.kv_manager.grow(seq, n)
            _, hidden = engine.runner.forward([(seq, n)])
            pieces.append(engine.runner.model.compute_logits(hidden).float())
            seq.num_computed_tokens += n
    return torch.cat(pieces), seq


def ask_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams,
              forget: bool = True) -> tuple[list[int], int]:
    """One request run to its end on an engine with a KV store, its chunks written before returning: its output
    tokens and the prompt tokens it did not compute. `forget`: with nothing in the device pool first, so that only
    the store may give them."""
    if forget:
        engine.reset_prefix_cache()
    out = run_together(engine, [prompt], [params])[0]
    engine.kv_store.flush()
    return out.token_ids, out.num_cached_tokens


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(hf_model, token_ids: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([token_ids]), attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=0,
        )
    return out[0, len(token_ids):].tolist()


# decode batches of 3, then fewer
MIXED_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(60, 97))]


def greedy_mixed_batches(engine: LLMEngine) -> list[list[int]]:
    """Greedy tokens of MIXED_PROMPTS run together (20, 9 and 14 new tokens), in the prompts' order."""
    for prompt, max_tokens in zip(MIXED_PROMPTS, (20, 9, 14)):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
    return [list(finished[key]) for key in sorted(finished)]


def use_policy(engine: LLMEngine, policy) -> None:
    """`engine` attends through `policy` (an AttentionPolicy) from its next step on."""
    engine.attention = engine.runner.policy = policy

"""IMPRESS's choice of important prefix tokens (kv/impress/): H2O scores, the probe heads' Jaccard check and
its threshold, the shared set, and attention over a per-layer subset of a fixed context."""

import math

import pytest
import torch

from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import EngineConfig, LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.kv.context_attention import AttendOverContext
from kvstrata.kv.impress.important_tokens import (
    LayerSelection,
    agreement_threshold,
    head_scores,
    mean_pairwise_jaccard,
    prefix_scores,
    random_jaccard,
    read_with,
    select_layer_tokens,
    shared_set,
    top_sets,
)
from kvstrata.kv.impress.prefix_selection import PrefixSelector, probe_heads
from tests.helpers import hf_logits


def mask(n: int, tokens: list[int]) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.bool)
    out[tokens] = True
    return out


def test_mean_pairwise_jaccard_on_hand_made_sets():
    sets = torch.stack([mask(8, [0, 1, 2, 3]), mask(8, [0, 1, 2, 4]), mask(8, [0, 1, 5, 6])])
    # |A&B| / |A|B| = 3/5, |A&C| = 2/6, |B&C| = 2/6
    assert mean_pairwise_jaccard(sets) == pytest.approx((3 / 5 + 2 / 6 + 2 / 6) / 3)
    assert mean_pairwise_jaccard(sets[:1]) == 1.0
    assert mean_pairwise_jaccard(torch.stack([mask(8, [0, 1]), mask(8, [2, 3])])) == 0.0


def test_threshold_follows_the_random_similarity():
    # the paper's table: r = 10% -> j = 0.053, t = 0.171; r = 25% -> 0.143, 0.311; r = 50% -> 0.333, 0.517
    assert random_jaccard(0.1) == pytest.approx(0.0526, abs=1e-4)
    assert agreement_threshold(0.1) == pytest.approx(0.171, abs=1e-3)
    assert agreement_threshold(0.25) == pytest.approx(0.311, abs=1e-3)
    assert agreement_threshold(0.5) == pytest.approx(0.517, abs=1e-3)
    assert agreement_threshold(0.25, alpha=1.0) == pytest.approx(random_jaccard(0.25))
    # two random sets of a quarter of 20,000 tokens land near the random value
    generator = torch.Generator().manual_seed(0)
    random_sets = torch.stack([mask(20_000, torch.randperm(20_000, generator=generator)[:5_000].tolist())
                               for _ in range(2)])
    assert mean_pairwise_jaccard(random_sets) == pytest.approx(random_jaccard(0.25), abs=0.01)


def test_agreeing_probe_heads_share_one_voted_set():
    # 10 tokens, 3 heads, top 3 each: tokens 0 and 1 are everyone's, the third place differs (2, 2, 5)
    scores = torch.tensor([
        [9, 8, 7, 0, 0, 1, 0, 0, 0, 0],
        [9, 8, 6, 0, 0, 2, 0, 0, 0, 0],
        [8, 9, 1, 0, 0, 7, 0, 0, 0, 0],
    ], dtype=torch.float)
    decision = select_layer_tokens(scores, ratio=0.3)
    # sets {0, 1, 2}, {0, 1, 2}, {0, 1, 5}: pairwise 1, 1/2, 1/2 -> 2/3 >= t(0.3) = 0.353
    assert decision.jaccard == pytest.approx(2 / 3)
    assert decision.threshold == pytest.approx(agreement_threshold(0.3))
    assert not decision.fallback
    assert decision.tokens.nonzero().flatten().tolist() == [0, 1, 2]  # 2 has two votes, 5 one
    # a smaller alpha raises the threshold (0.176 ** 0.1 = 0.84) above the same agreement
    assert select_layer_tokens(scores, ratio=0.3, alpha=0.1).fallback


def test_disagreeing_probe_heads_fall_back_to_the_whole_prefix():
    scores = torch.tensor([
        [9, 8, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 9, 8, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 9, 8, 0, 0, 0, 0],
    ], dtype=torch.float)
    decision = select_layer_tokens(scores, ratio=0.2)
    assert decision.jaccard == 0.0 and decision.fallback
    assert decision.tokens.all()


def test_vote_tops_up_by_summed_scores_and_other_rules():
    scores = torch.tensor([
        [5, 4, 3, 0, 0, 0],
        [5, 0, 0, 4, 3, 0],
        [5, 0, 0, 0, 1, 4.5],
    ])
    sets = top_sets(scores, 3)  # {0, 1, 2}, {0, 3, 4}, {0, 4, 5}
    # token 0 has three votes and token 4 two; the last place goes to the best summed score of the one-vote
    # tokens (5: 4.5 over 1 and 3: 4), though token 4's own sum (4) is lower
    assert shared_set(scores, sets, 3, "vote").nonzero().flatten().tolist() == [0, 4, 5]
    assert shared_set(scores, sets, 3, "union").nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert shared_set(scores, sets, 3, "first").nonzero().flatten().tolist() == [0, 1, 2]
    with pytest.raises(KvstrataError, match="'majority' is not one of vote, union, first, chunks"):
        shared_set(scores, sets, 3, "majority")


def test_the_chunks_rule_takes_whole_units_by_summed_score_until_it_holds_the_count():
    scores = torch.tensor([
        [5, 4, 0, 0, 1, 0, 3, 3],
        [5, 0, 0, 4, 1, 0, 3, 3],
    ])
    units = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # unit sums: 14, 4, 2, 12
    sets = top_sets(scores, 3)
    assert shared_set(scores, sets, 2, "chunks", units).nonzero().flatten().tolist() == [0, 1]
    assert shared_set(scores, sets, 3, "chunks", units).nonzero().flatten().tolist() == [0, 1, 6, 7]
    assert shared_set(scores, sets, 5, "chunks", units).nonzero().flatten().tolist() == [0, 1, 2, 3, 6, 7]
    # without units each token is its own: the tokens with the highest summed scores
    assert shared_set(scores, sets, 3, "chunks").nonzero().flatten().tolist() == [0, 6, 7]


def test_reading_with_a_chosen_token_brings_its_whole_unit():
    units = torch.tensor([3, 3, 0, 0, 1, 1, 1])
    assert read_with(mask(7, [0, 5]), units).nonzero().flatten().tolist() == [0, 1, 4, 5, 6]
    assert not read_with(mask(7, []), units).any()
    selector = PrefixSelector([torch.zeros(7, 3, 8)], "impress", 0.25, selection_rows=1, read_units=[units],
                              attend="read")
    selector.decisions = {0: LayerSelection(mask(7, [0]), 1.0, 0.3, False)}
    # with read units a chosen token costs its whole unit: 2 of 7 tokens read
    assert selector.read_share(9, 3) == pytest.approx(1 / 6 + 2 / 7 * 5 / 6)


def test_ratio_one_reads_everything_and_bad_ratios_are_named():
    scores = torch.rand(3, 17)
    decision = select_layer_tokens(scores, ratio=1.0)
    assert not decision.fallback and decision.tokens.all() and decision.jaccard == 1.0
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(KvstrataError, match=f"ratio must be in \\(0, 1\\], got {bad}"):
            select_layer_tokens(scores, ratio=bad)


def test_prefix_scores_are_column_sums_of_causal_softmax_rows():
    generator = torch.Generator().manual_seed(1)
    n, m, heads, dim = 7, 4, 3, 8
    q = torch.randn(m, heads, dim, generator=generator)
    prefix_k, new_k = torch.randn(n, dim, generator=generator), torch.randn(m, dim, generator=generator)
    expected = torch.zeros(heads, n)
    for h in range(heads):
        for i in range(m):
            keys = torch.cat((prefix_k, new_k[: i + 1]))  # new token i sees the prefix and new tokens 0 .. i
            expected[h] += (q[i, h] @ keys.T / math.sqrt(dim)).softmax(-1)[:n]
    assert torch.allclose(prefix_scores(q, prefix_k, new_k), expected, atol=1e-6)


def test_head_scores_pair_each_query_head_with_its_kv_head():
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(4, 6, 8, generator=generator)  # 6 query heads over 2 KV heads
    prefix_k, new_k = torch.randn(5, 2, 8, generator=generator), torch.randn(4, 2, 8, generator=generator)
    scores = head_scores(q, prefix_k, new_k, 6)
    assert torch.allclose(scores[4], prefix_scores(q[:, 4:5], prefix_k[:, 1], new_k[:, 1])[0])
    assert torch.allclose(scores[:3], prefix_scores(q[:, :3], prefix_k[:, 0], new_k[:, 0]))
    assert probe_heads(9, 3) == 3 and probe_heads(4, 2) == 2 and probe_heads(12, 12) == 3


def test_read_share_counts_probe_keys_and_the_chosen_tokens():
    selector = PrefixSelector([torch.zeros(4, 3, 8)], "impress", 0.25, selection_rows=1)
    selector.decisions = {0: LayerSelection(mask(4, [0]), 1.0, 0.3, False),
                          1: LayerSelection(mask(4, [0, 1, 2, 3]), 0.1, 0.3, True)}
    # 9 query heads over 3 KV heads: the probe reads KV head 0's keys, 1/6 of a layer's K and V
    assert selector.read_share(9, 3) == pytest.approx(((1 / 6 + 0.25 * 5 / 6) + 1.0) / 2)
    h2o = PrefixSelector([torch.zeros(4, 3, 8)], "h2o-keys", 0.25, selection_rows=1)
    h2o.decisions = {0: LayerSelection(mask(4, [0]), 1.0, 0.0, False)}
    assert h2o.read_share(9, 3) == pytest.approx(0.5 + 0.5 * 0.25)
    with pytest.raises(KvstrataError, match="prefix loading 'lru' is not one of impress, h2o-keys"):
        PrefixSelector([], "lru", 0.25, 1)
    with pytest.raises(KvstrataError, match="shared-set rule 'majority' is not one of vote, union, first, chunks"):
        PrefixSelector([], "impress", 0.25, 1, rule="majority")
    with pytest.raises(KvstrataError, match="attended prefix tokens 'all' are not one of read, chosen"):
        PrefixSelector([], "impress", 0.25, 1, attend="all")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), threads=1))


def continuation_logits(engine, k, v, new: list[int], selector=None) -> torch.Tensor:
    model, prefix = engine.runner.model, k.shape[1]
    with torch.inference_mode():
        hidden = model(torch.tensor(new), torch.arange(prefix, prefix + len(new)),
                       AttendOverContext(list(k), list(v), selector), None)
        return model.compute_logits(hidden).float()


def test_attending_over_a_context_matches_transformers(engine, tiny_llama):
    from transformers import AutoModelForCausalLM

    ids = [(7 * i + 3) % 250 + 3 for i in range(40)]
    k, v = compute_kv(engine, ids[:30])
    reference = hf_logits(AutoModelForCausalLM.from_pretrained(str(tiny_llama)), ids)[30:]
    assert torch.allclose(continuation_logits(engine, k, v, ids[30:]), reference, atol=1e-4)


def test_ratio_one_gives_the_full_reads_greedy_output(engine):
    prefix = [(11 * i + 5) % 250 + 3 for i in range(48)]
    k, v = compute_kv(engine, prefix)

    def greedy(method=None, ratio=1.0):
        new = [17, 42, 99, 4]
        for _ in range(12):
            selector = None if method is None else PrefixSelector(list(k), method, ratio, selection_rows=4)
            new.append(int(continuation_logits(engine, k, v, new, selector)[-1].argmax()))
        return new

    full = greedy()
    assert greedy("impress") == full and greedy("h2o-keys") == full


def test_a_subset_reads_only_the_chosen_tokens(engine):
    prefix = [(13 * i + 1) % 250 + 3 for i in range(32)]
    k, v = compute_kv(engine, prefix)
    new = [9, 8, 7, 6, 5]
    selector = PrefixSelector(list(k), "impress", 0.25, selection_rows=3)
    subset = continuation_logits(engine, k, v, new, selector)
    assert set(selector.decisions) == {0, 1, 2} and not all(d.fallback for d in selector.decisions.values())
    # reading only the chosen tokens equals a context made of just those tokens, at their own positions: set
    # every unchosen token's K/V to garbage and the output must not move
    spoiled_k, spoiled_v = k.clone(), v.clone()
    for layer, decision in selector.decisions.items():
        spoiled_k[layer, ~decision.tokens] = 1e4
        spoiled_v[layer, ~decision.tokens] = -1e4
    def replay(layer, q, k_new):  # the recorded choice (the spoiled keys would change a fresh one)
        return selector.decisions[layer].tokens

    assert torch.equal(continuation_logits(engine, spoiled_k, spoiled_v, new, replay), subset)
    assert not torch.equal(continuation_logits(engine, k, v, new), subset)

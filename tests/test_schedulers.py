"""Which tokens each policy puts in a step (no model involved)."""

import pytest

from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.scheduler import PrefillFirstScheduler, SarathiScheduler, StaticScheduler
from kvstrata.engine.sequence import Sequence
from kvstrata.kv.cache_manager import KVCacheManager


def make_seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id, str(seq_id), None, list(range(1000 * seq_id, 1000 * seq_id + prompt_len)), SamplingParams())


def run(scheduler, out, index_blocks=False):
    """Pretend the step ran: advance the cache (and with `index_blocks` index its full blocks for the prefix
    cache, as the engine does), give every finished chunk a sampled token."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        if index_blocks:
            scheduler.kv.commit(seq, n)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def shape(out):
    return [(s.seq_id, n) for s, n in out.scheduled]


def test_sarathi_fills_the_budget_with_decodes_then_prefill_chunks():
    sched = SarathiScheduler(KVCacheManager(64, 16), max_num_seqs=8, chunk_size=32)
    for i, length in enumerate([20, 50, 40]):
        sched.add(make_seq(i, length))
    out = sched.schedule()
    assert shape(out) == [(0, 20), (1, 12)]
    run(sched, out)
    out = sched.schedule()  # seq 0 decodes; seq 1 continues its prompt; seq 2 gets the rest
    assert shape(out) == [(0, 1), (1, 31)]
    run(sched, out)
    out = sched.schedule()
    assert shape(out) == [(0, 1), (1, 7), (2, 24)]
    assert out.num_tokens == 32


def test_sarathi_tile_rounds_the_step_down():
    sched = SarathiScheduler(KVCacheManager(64, 16), max_num_seqs=8, chunk_size=64, tile=16)
    sched.add(make_seq(0, 10))
    run(sched, sched.schedule())
    sched.add(make_seq(1, 100))
    out = sched.schedule()
    assert shape(out) == [(0, 1), (1, 63)]  # 64 tokens: already a multiple of 16
    run(sched, out)
    out = sched.schedule()
    assert shape(out) == [(0, 1), (1, 31)]  # 1 + 37 pending -> trimmed to 32 tokens
    assert out.num_tokens % 16 == 0


def test_prefill_first_runs_whole_prompts_alone_and_stalls_decodes():
    sched = PrefillFirstScheduler(KVCacheManager(64, 16), max_num_seqs=8, max_prefill_tokens=2048)
    sched.add(make_seq(0, 30))
    run(sched, sched.schedule())
    sched.add(make_seq(1, 300))
    out = sched.schedule()
    assert shape(out) == [(1, 300)]  # seq 0's decode waits
    run(sched, out)
    assert shape(sched.schedule()) == [(0, 1), (1, 1)]


def test_static_admits_the_next_batch_only_when_the_current_one_is_done():
    sched = StaticScheduler(KVCacheManager(64, 16), max_num_seqs=8)
    sched.add(make_seq(0, 30))
    sched.add(make_seq(1, 20))
    out = sched.schedule()
    assert shape(out) == [(0, 30), (1, 20)]
    run(sched, out)
    sched.add(make_seq(2, 10))
    out = sched.schedule()
    assert shape(out) == [(0, 1), (1, 1)]
    run(sched, out)
    for seq in list(sched.running):
        sched.finish(seq)
    assert shape(sched.schedule()) == [(2, 10)]


def test_out_of_blocks_preempts_the_newest_and_resumes_it_later():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = SarathiScheduler(kv, max_num_seqs=8, chunk_size=64)
    old, new = make_seq(0, 8), make_seq(1, 7)
    sched.add(old)
    sched.add(new)
    run(sched, sched.schedule())  # 9 + 8 tokens known: 3 + 2 blocks needed, 4 exist
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == [1]
    assert shape(out) == [(0, 1)]
    assert new.num_computed_tokens == 0 and sched.waiting[0] is new and new.num_preemptions == 1
    run(sched, out)
    sched.finish(old)
    out = sched.schedule()
    assert shape(out) == [(1, 8)]  # prompt and the token it had sampled, recomputed


def same_prompt(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), None, list(prompt), SamplingParams())


@pytest.mark.parametrize("make", [
    lambda kv: SarathiScheduler(kv, max_num_seqs=8, chunk_size=64),
    lambda kv: PrefillFirstScheduler(kv, max_num_seqs=8, max_prefill_tokens=2048),
])
def test_a_prompt_that_arrives_several_times_together_is_computed_once(make):
    sched = make(KVCacheManager(64, 16))
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks, then 8 tokens
    for i in range(3):
        sched.add(same_prompt(i, prompt))
    sched.add(make_seq(3, 10))  # another prompt behind them is not held up
    out = sched.schedule()
    assert shape(out) == [(0, 40), (3, 10)]  # 1 and 2 wait: the step computes both their full blocks for 0
    run(sched, out, index_blocks=True)
    out = sched.schedule()
    admitted = [(s.seq_id, n) for s, n in out.scheduled if s.seq_id in (1, 2)]
    assert admitted == [(1, 8), (2, 8)]  # both read the 2 blocks from the prefix cache
    assert sched.kv.prefix_stats.hit_tokens == 64


def test_the_static_baseline_computes_a_repeated_prompt_for_each_request():
    sched = StaticScheduler(KVCacheManager(64, 16), max_num_seqs=8)
    prompt = list(range(100, 140))
    for i in range(2):
        sched.add(same_prompt(i, prompt))
    assert shape(sched.schedule()) == [(0, 40), (1, 40)]


def test_a_copy_of_a_prompt_whose_first_request_was_aborted_midway_computes_the_rest_itself():
    sched = SarathiScheduler(KVCacheManager(64, 16), max_num_seqs=8, chunk_size=32)
    prompt = list(range(100, 180))  # 80 tokens: 3 chunks of 32
    first, second = same_prompt(0, prompt), same_prompt(1, prompt)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert shape(out) == [(0, 32)]
    run(sched, out, index_blocks=True)
    sched.finish(first)  # aborted midway: its 2 computed blocks stay cached, the rest is never computed
    out = sched.schedule()
    assert shape(out) == [(1, 32)] and second.num_cached_prompt_tokens == 32


def test_a_short_shared_head_is_not_worth_a_wait():
    sched = SarathiScheduler(KVCacheManager(64, 16), max_num_seqs=8, chunk_size=256)
    head = list(range(100, 116))  # one block, as a short system prompt
    sched.add(same_prompt(0, head + list(range(200, 300))))
    sched.add(same_prompt(1, head + list(range(300, 400))))  # 16 tokens to share, 100 to compute alone
    sched.add(same_prompt(2, head + list(range(200, 210))))  # the start of 0's: 16 tokens to share, 10 alone: waits
    assert shape(sched.schedule()) == [(0, 116), (1, 116)]

"""--scheduling-policy: fcfs, priority and lpm order admission and preemption (engine/scheduler/policy.py)."""

import time
from collections import deque

import httpx
import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.config import EngineConfig
from kvstrata.engine.beam_search import BeamSearchParams
from kvstrata.engine.scheduler import PrefillFirstScheduler, SarathiScheduler, StaticScheduler, policy
from kvstrata.engine.sequence import Sequence
from kvstrata.errors import KvstrataError, ParameterError
from kvstrata.kv.cache_manager import KVCacheManager
from kvstrata.kv.preloaded import PreloadedKV
from kvstrata.server.responses_protocol import ResponsesRequest
from tests.server_harness import running_server
from tests.test_schedulers import run, shape

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def seq(seq_id: int, prompt_len: int, priority: int = 0) -> Sequence:
    tokens = list(range(1000 * seq_id, 1000 * seq_id + prompt_len))
    return Sequence(seq_id, str(seq_id), None, tokens, SamplingParams(priority=priority), arrival_time=float(seq_id))


def sarathi(num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 8, chunk_size: int = 64):
    return SarathiScheduler(KVCacheManager(num_blocks, block_size), max_num_seqs, chunk_size, policy="priority")


def test_the_waiting_are_admitted_by_priority_then_arrival():
    sched = sarathi(chunk_size=32)
    for seq_id, priority in ((0, 2), (1, 0), (2, 2), (3, -1)):
        sched.add(seq(seq_id, 20, priority))
    assert [s.seq_id for s in sched.waiting] == [3, 1, 0, 2]
    assert shape(sched.schedule()) == [(3, 20), (1, 12)]


def test_fcfs_admits_in_arrival_order_whatever_the_requests_priorities():
    sched = SarathiScheduler(KVCacheManager(64, 16), max_num_seqs=8, chunk_size=32)
    sched.add(seq(0, 20, priority=5))
    sched.add(seq(1, 20, priority=0))
    assert shape(sched.schedule()) == [(0, 20), (1, 12)]


def test_a_waiting_request_short_of_blocks_preempts_a_running_one_of_worse_priority():
    sched = sarathi(num_blocks=4, block_size=4)
    low = seq(0, 11, priority=2)
    sched.add(low)
    run(sched, sched.schedule())  # 12 tokens: 3 of the 4 blocks
    middle, urgent = seq(1, 7, priority=1), seq(2, 7, priority=0)  # 2 blocks each: only 1 is free
    sched.add(middle)
    sched.add(urgent)
    out = sched.schedule()
    # low's decode, scheduled first, was dropped; low goes back behind middle, which then fits
    assert out.preempted == [low] and shape(out) == [(2, 7), (1, 7)]
    assert list(sched.waiting) == [low] and low.num_computed_tokens == 0 and low.num_preemptions == 1
    run(sched, out)
    sched.finish(urgent)
    sched.finish(middle)
    assert shape(sched.schedule()) == [(0, 12)]  # it resumes: its prompt and the token it had sampled


def test_a_waiting_request_does_not_preempt_one_of_its_own_priority():
    sched = sarathi(num_blocks=4, block_size=4)
    first = seq(0, 11, priority=1)
    sched.add(first)
    run(sched, sched.schedule())
    sched.add(seq(1, 7, priority=1))
    out = sched.schedule()
    assert not out.preempted and shape(out) == [(0, 1)]
    assert [s.seq_id for s in sched.waiting] == [1]


def test_nothing_is_preempted_in_vain():
    sched = sarathi(num_blocks=6, block_size=4)
    high, low = seq(0, 15, priority=0), seq(1, 3, priority=2)
    sched.add(high)
    sched.add(low)
    run(sched, sched.schedule())  # 16 + 4 tokens: 4 + 1 of the 6 blocks
    sched.add(seq(2, 11, priority=1))  # 3 blocks: the free one and low's would not do, high's may not be taken
    out = sched.schedule()
    assert not out.preempted and shape(out) == [(0, 1), (1, 1)]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_a_full_batch_makes_room_for_a_better_request():
    sched = sarathi(max_num_seqs=2)
    for seq_id in (0, 1):
        sched.add(seq(seq_id, 10, priority=3))
    run(sched, sched.schedule())
    sched.add(seq(2, 10, priority=1))
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == [1]  # of two alike, the later one
    assert shape(out) == [(0, 1), (2, 10)]


def test_a_running_request_short_of_blocks_preempts_the_worst_priority_not_the_newest():
    sched = sarathi(num_blocks=5, block_size=4)
    low, high = seq(0, 8, priority=2), seq(1, 8, priority=0)
    sched.add(low)
    run(sched, sched.schedule())
    sched.add(high)
    run(sched, sched.schedule())  # low's ninth token takes a third block, high's prompt two: all five
    assert [s.seq_id for s in sched.running] == [1, 0]  # best first
    out = sched.schedule()  # high's ninth token needs a sixth block: low, older but worse, gives way
    assert out.preempted == [low] and shape(out) == [(1, 1)]


def test_prefill_first_and_static_admit_by_priority():
    for sched in (PrefillFirstScheduler(KVCacheManager(64, 16), 8, 2048, policy="priority"),
                  StaticScheduler(KVCacheManager(64, 16), max_num_seqs=1, policy="priority")):
        sched.add(seq(0, 10, priority=1))
        sched.add(seq(1, 10, priority=0))
        assert shape(sched.schedule())[0] == (1, 10)


def test_a_priority_must_be_an_integer():
    with pytest.raises(ParameterError, match="priority must be an integer") as error:
        SamplingParams(priority=1.5)
    assert error.value.param == "priority"
    with pytest.raises(ParameterError, match="priority must be an integer"):
        BeamSearchParams(beam_width=2, priority="high")


def test_a_priority_needs_the_priority_policy(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    with pytest.raises(ParameterError, match="priority 2 needs the priority scheduling policy") as error:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, priority=2))
    assert error.value.param == "priority"
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, priority=0))[0].finish_reason == "length"
    with pytest.raises(KvstrataError, match="scheduling_policy 'lifo' is not one of fcfs, priority"):
        LLM(str(tiny_llama), scheduling_policy="lifo")


def test_priorities_reorder_and_preempt_but_never_change_outputs(tiny_llama):
    lengths = (5, 37, 12, 64, 3, 90, 21, 48)
    prompts = [[3 + (7 * i + j) % 300 for j in range(length)] for i, length in enumerate(lengths)]
    expected = [o.token_ids for o in LLM(str(tiny_llama), kv_cache_memory="8MiB").generate(prompts, GREEDY)]
    bytes_per_block = 16 * 2 * 3 * 2 * 16 * 4  # tokens * (K,V) * layers * kv heads * head dim * fp32
    cramped = LLM(str(tiny_llama), kv_cache_memory=10 * bytes_per_block, max_model_len=128, chunk_size=32,
                  scheduling_policy="priority")
    priorities = [3, 0, 2, 1, 0, 3, 1, 2]
    outputs = cramped.generate(prompts, GREEDY, priority=priorities)
    assert [o.token_ids for o in outputs] == expected
    assert sum(s.num_preempted for s in cramped.engine.step_stats) > 0
    assert cramped.engine.kv_manager.pool.num_used == 0
    with pytest.raises(KvstrataError, match="not a list of one priority per prompt"):
        cramped.generate(prompts, GREEDY, priority=[0])


def test_the_urgent_request_finishes_first_under_priority_and_last_under_fcfs(tiny_llama):
    prompts = [[3 + i] * 40 for i in range(4)]
    order = {}
    for name in ("fcfs", "priority"):
        llm = LLM(str(tiny_llama), kv_cache_memory="8MiB", chunk_size=48, scheduling_policy=name)
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, priority=0 if i == 3 or name ==
                                 "fcfs" else 1) for i in range(4)]
        ids = [llm.engine.add_request(prompt, one) for prompt, one in zip(prompts, params)]
        finished = []
        while llm.engine.has_unfinished_requests():
            finished += [out.request_id for out in llm.engine.step() if out.finished]
        order[name] = [ids.index(request_id) for request_id in finished]
    assert order["priority"][0] == 3
    assert order["fcfs"][-1] == 3


def test_the_server_takes_vllm_s_priority_field_where_the_policy_is_priority(tiny_llama):
    completion = {"model": "m", "prompt": "Emma Woodhouse", "max_tokens": 2}
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    with running_server(str(tiny_llama), "m", kv_cache_memory="8MiB", max_model_len=256) as (url, _):
        refused = httpx.post(f"{url}/v1/completions", json={**completion, "priority": 3}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in refused.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={**completion, "priority": 0}, timeout=60).status_code == 200
    with running_server(str(tiny_llama), "m", kv_cache_memory="8MiB", max_model_len=256,
                        scheduling_policy="priority") as (url, _):
        for path, body in (("completions", {**completion, "priority": -4}),
                           ("chat/completions", {**chat, "priority": 9}),
                           ("completions", {**completion, "priority": 2, "use_beam_search": True, "n": 2}),
                           ("responses", {"model": "m", "input": "Hello", "max_output_tokens": 2, "priority": 1})):
            assert httpx.post(f"{url}/v1/{path}", json=body, timeout=60).status_code == 200, path
        wrong = httpx.post(f"{url}/v1/completions", json={**completion, "priority": "high"}, timeout=60)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "priority"


def test_a_responses_request_keeps_its_priority():
    assert ResponsesRequest(model="m", input="hi", priority=-2).chat_request().priority == -2


def doc_seq(seq_id: int, doc: int, question: int, doc_len: int = 32) -> Sequence:
    """A prompt of a document's tokens, then a question of 8 tokens."""
    tokens = [1000 + 100 * doc + i for i in range(doc_len)] + [9000 + 10 * question + i for i in range(8)]
    return Sequence(seq_id, str(seq_id), None, tokens, SamplingParams(), arrival_time=float(seq_id))


def scheduler_with_document_0_cached(policy_choice="fcfs") -> SarathiScheduler:
    """A scheduler whose pool holds document 0's two full blocks, computed by a request that has finished."""
    sched = SarathiScheduler(KVCacheManager(64, 16), max_num_seqs=8, chunk_size=16, policy=policy_choice)
    first = doc_seq(0, doc=0, question=0)
    sched.add(first)
    for _ in range(3):
        run(sched, sched.schedule(), index_blocks=True)  # its 40 tokens, in chunks of 16
    sched.finish(first)  # its two full blocks stay cached
    return sched


def test_lpm_admits_first_the_waiting_whose_prefix_the_pool_holds_then_by_arrival():
    sched = scheduler_with_document_0_cached("lpm")
    for seq_id, doc in ((1, 1), (2, 2), (3, 0), (4, 0)):
        sched.add(doc_seq(seq_id, doc, question=seq_id))
    # requests 3 and 4 find their document's 32 tokens cached, and go ahead of 1 and 2, in arrival order
    assert shape(sched.schedule()) == [(3, 8), (4, 8)]
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_fcfs_admits_in_arrival_order_whatever_the_pool_holds():
    sched = scheduler_with_document_0_cached()
    for seq_id, doc in ((1, 1), (2, 0)):
        sched.add(doc_seq(seq_id, doc, question=seq_id))
    assert shape(sched.schedule()) == [(1, 16)]


def test_lpm_orders_a_long_queue_by_arrival(monkeypatch):
    monkeypatch.setattr(policy, "LPM_MAX_WAITING", 2)
    sched = scheduler_with_document_0_cached("lpm")
    for seq_id, doc in ((1, 1), (2, 2), (3, 0)):
        sched.add(doc_seq(seq_id, doc, question=seq_id))
    assert shape(sched.schedule()) == [(1, 16)]  # three waiting: more than 2, so by arrival


def test_lpm_computes_each_shared_document_fewer_times_for_the_same_outputs(tiny_llama):
    # 6 documents of 96 tokens, 4 questions each, sent at once in a shuffled order; the pool holds about 3 requests
    documents = [[5 + (13 * d + 7 * i) % 240 for i in range(96)] for d in range(6)]
    order = [(d, q) for q in range(4) for d in range(6)]
    order = order[::5] + order[1::5] + order[2::5] + order[3::5] + order[4::5]
    prompts = [documents[d] + [250 + q, 251 + d, 252] for d, q in order]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    bytes_per_block = 16 * 2 * 3 * 2 * 16 * 4  # tokens * (K,V) * layers * kv heads * head dim * fp32
    outputs, reused = {}, {}
    for policy_name in ("fcfs", "lpm"):
        llm = LLM(str(tiny_llama), kv_cache_memory=24 * bytes_per_block, max_model_len=128, chunk_size=64,
                  max_num_seqs=4, scheduling_policy=policy_name)
        done = llm.generate(prompts, params)
        outputs[policy_name] = [o.token_ids for o in done]
        reused[policy_name] = sum(o.num_cached_tokens for o in done)
        assert llm.engine.kv_manager.pool.num_used == 0
    assert outputs["lpm"] == outputs["fcfs"]
    assert reused["lpm"] >= reused["fcfs"] + 96 * 12, reused  # twelve documents computed fewer times


@pytest.mark.parametrize("aging, first", [(0.0, 3), (4.0, 1)])
def test_lpm_aging_lets_a_request_that_waited_overtake_a_newer_one_that_matches_more(aging, first):
    sched = scheduler_with_document_0_cached(policy.LongestPrefixMatch(aging))
    now = time.perf_counter()
    cold, hot = doc_seq(1, doc=1, question=1), doc_seq(3, doc=0, question=3)  # hot: 32 tokens cached
    cold.arrival_time, hot.arrival_time = now - 10.0, now  # 10 s x 4 tokens/s = 40 > 32
    sched.add(cold)
    sched.add(hot)
    assert shape(sched.schedule())[0][0] == first


def test_lpm_aging_must_be_a_number_of_tokens_per_second_under_lpm_with_prefix_caching():
    for wrong in (-1, float("inf"), "fast", True):
        with pytest.raises(KvstrataError, match="lpm_aging_tokens_per_s must be a number >= 0"):
            EngineConfig(scheduling_policy="lpm", lpm_aging_tokens_per_s=wrong)
    with pytest.raises(KvstrataError, match="lpm_aging_tokens_per_s 5 applies to scheduling_policy lpm; this "
                                            "engine's is fcfs"):
        EngineConfig(lpm_aging_tokens_per_s=5)
    with pytest.raises(KvstrataError, match="scheduling_policy lpm orders requests by what the prefix cache holds"):
        EngineConfig(scheduling_policy="lpm", enable_prefix_caching=False)


def test_lpm_counts_the_kv_a_store_load_brought_as_held():
    fresh, loaded = doc_seq(1, doc=1, question=1), doc_seq(2, doc=2, question=2)
    passage = torch.zeros(1, 32, 1, 1)
    loaded.preloaded = [PreloadedKV(0, passage, passage)]  # its passage, loaded from the store before admission
    waiting = deque([fresh, loaded])
    policy.LongestPrefixMatch().order(waiting, KVCacheManager(64, 16))
    assert [s.seq_id for s in waiting] == [2, 1]

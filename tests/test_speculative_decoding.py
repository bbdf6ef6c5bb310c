"""Speculative decoding by prompt lookup (--num-speculative-tokens): the drafts proposed, how they are verified, and
that the engine's output with them is the output without them."""

import json

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.config import EngineConfig
from kvstrata.engine.draft_verification import accepted_tokens, draft_histories, sequence_rows
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.ngram_proposer import NgramProposer
from kvstrata.engine.sequence import Sequence
from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.errors import KvstrataError
from kvstrata.kv.attention_batch import keys_per_sequence, whole_block_keys
from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS
from tests.helpers import hf_greedy
from tests.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.slow

# Prompts whose greedy continuations on the tiny model repeat themselves (drafts are accepted) and change (drafts
# are rejected); and a prompt that itself repeats a pattern.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(60, 97)), [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
           [100 + (i * 37) % 150 for i in range(50)]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> tuple[list[list[int]], int, int]:
    """Each prompt's output tokens, run together; and the drafts verified and accepted meanwhile."""
    llm.engine.step_stats.clear()
    outputs = [out.token_ids for out in llm.generate(prompts, params)]
    steps = llm.engine.step_stats
    return outputs, sum(s.num_draft_tokens for s in steps), sum(s.num_accepted_tokens for s in steps)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256)


@pytest.fixture(scope="module")
def speculating(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, num_speculative_tokens=3)


# --- drafts ----------------------------------------------------------------------------------------------------------

def test_the_longest_match_wins_and_its_latest_occurrence_is_followed():
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 6, 2, 3]
    assert proposer.propose(0, tokens, limit=9) == [8, 7, 6]  # "6 2 3" was never seen; "2 3" last at 4
    tokens = [4, 1, 2, 3, 5, 5, 9, 2, 3, 6, 1, 2, 3]
    assert proposer.propose(1, tokens, limit=9) == [5, 5, 9]  # "1 2 3" at 1 beats the later "2 3" at 7


def test_drafts_are_cut_at_the_limit_and_the_sequence_end():
    proposer = NgramProposer(num_tokens=4, min_n=2, max_n=2)
    assert proposer.propose(0, [1, 2, 3, 4, 5, 1, 2], limit=2) == [3, 4]
    assert proposer.propose(1, [1, 2, 3, 1, 2], limit=9) == [3, 1, 2]  # what follows, up to the sequence's end
    assert proposer.propose(2, [1, 2, 3, 1, 2], limit=0) == []


def test_no_draft_where_no_suffix_of_the_least_length_recurs():
    proposer = NgramProposer(num_tokens=3, min_n=2, max_n=4)
    assert proposer.propose(0, [1, 2, 3, 4, 5, 6, 2], limit=3) == []  # "6 2" never came before; "2" alone is too short
    assert proposer.propose(1, [8], limit=3) == []


def test_a_growing_sequence_is_read_as_a_fresh_one():
    grown, fresh = NgramProposer(3, 1, 3), NgramProposer(3, 1, 3)
    tokens = torch.randint(0, 6, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    for end in range(2, 600, 7):  # its buffer grows past its first size on the way
        assert grown.propose(0, tokens[:end], 3) == fresh.propose(end, tokens[:end], 3)
    grown.forget(0)
    assert grown.propose(0, [5, 5], 3) == [5]


# --- verification --------------------------------------------------------------------------------------------------

def test_drafts_are_accepted_while_each_equals_the_token_sampled_before_it():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all, and the token after the last
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # 9 was sampled where 5 was guessed
    assert accepted_tokens([4, 5, 6], [3, 5, 6, 7]) == [3]
    assert accepted_tokens([], [8]) == [8]


def sequence(seq_id: int, tokens: list[int], drafts: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), None, tokens, params)
    seq.draft_token_ids = drafts
    return seq


def test_a_rows_history_holds_the_drafts_before_it_where_sampling_reads_it():
    penalized = sequence(0, [1, 2], [3, 4], SamplingParams(repetition_penalty=1.2))
    plain = sequence(1, [5], [6], SamplingParams())
    rows = [penalized] * 3 + [plain] * 2
    assert list(sequence_rows(rows)) == [(penalized, 0, 3), (plain, 3, 5)]
    assert draft_histories(rows) == [[1, 2], [1, 2, 3], [1, 2, 3, 4], [5], [5]]
    assert sequence(2, [1], [2], SamplingParams(min_tokens=3)).params.reads_history


# --- the engine ----------------------------------------------------------------------------------------------------

def test_greedy_output_is_the_output_without_drafts_and_transformers(plain, speculating, tiny_llama):
    from transformers import AutoModelForCausalLM

    expected, _, _ = run(plain)
    outputs, drafted, accepted = run(speculating)
    assert outputs == expected
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()
    assert outputs[3] == hf_greedy(hf_model, PROMPTS[3], 40)


@pytest.mark.parametrize("options", [
    {"scheduler": "prefill-first"}, {"scheduler": "static"}, {"kv_format": "int8"}, {"kv_format": "int4"},
    {"kv_format": "fp8"}, {"kv_format": "int8/int4"}, {"kv_format": "fp16", "dtype": "float16"},
    {"enable_prefix_caching": False}, {"chunk_size": 16}, {"num_speculative_tokens": 1},
    {"prompt_lookup_min": 1, "prompt_lookup_max": 1},
    {"kv_offload": "full"}, {"kv_offload": "full", "paged_kernel": False}, {"kv_offload": "full", "kv_format": "int4"},
])
def test_greedy_output_is_unchanged_under_every_setting_drafts_allow(tiny_llama, options):
    kwargs = dict(kv_cache_memory="8MiB", max_model_len=256, **options)
    expected, _, _ = run(LLM(str(tiny_llama), **kwargs))
    outputs, _, accepted = run(LLM(str(tiny_llama), **{"num_speculative_tokens": 3, **kwargs}))
    assert outputs == expected
    assert accepted > 0


@pytest.mark.parametrize("kv_offload", ["none", "full"])
def test_oaken_drafts_give_the_plain_output_and_leave_no_rejected_bytes_behind(kv_offload, tiny_llama_kv64,
                                                                               oaken_calibrations):
    """Oaken appends a token's outliers to its block's sparse pages; a rejected draft's are discarded, so every
    block holds the bytes of the tokens it keeps and no more, and the tokens written in their place read back their
    own: on the device and in a host pool."""
    kwargs = {"kv_cache_memory": "8MiB", "max_model_len": 256, "kv_format": "oaken", "kv_offload": kv_offload,
              "oaken_calibration": str(oaken_calibrations[DEFAULT_RATIOS])}
    expected, _, _ = run(LLM(str(tiny_llama_kv64), **kwargs))
    speculating = LLM(str(tiny_llama_kv64), num_speculative_tokens=3, **kwargs)
    outputs, drafted, accepted = run(speculating)
    assert outputs == expected and 0 < accepted < drafted
    for pages in speculating.engine.kv_cache.sparse.values():
        per_block = pages.token_count.long().unflatten(1, (-1, pages.block_size)).sum(2)
        assert torch.equal(pages.block_fill, per_block)
        assert torch.equal((pages.block_pages >= 0).sum(2), -(-per_block // pages.page_bytes))  # no spare pages


def test_keys_per_sequence_copies_each_run_of_one_table_once_to_its_longest_row():
    """Rows A A B C C C (A and C verifying drafts, a row per token): three contexts, each to its longest row, and
    each row pointed at its own; rows that are each a sequence of their own need nothing."""
    tables = torch.tensor([[3, 4], [3, 4], [7, 0], [5, 6], [5, 6], [5, 6]])
    keys = whole_block_keys(tables, torch.tensor([20, 21, 9, 30, 32, 31]), block_size=16)  # C's longest in the middle
    runs, run_of_row = keys_per_sequence(keys)
    assert runs.block_tables.tolist() == [[3, 4], [7, 0], [5, 6]]
    assert runs.context_lens.tolist() == [21, 9, 32] and run_of_row.tolist() == [0, 0, 1, 2, 2, 2]
    assert keys_per_sequence(whole_block_keys(tables[1:4], torch.tensor([21, 9, 30]), block_size=16)) is None


def test_a_host_pool_copies_a_sequence_s_context_once_for_all_its_drafts(tiny_llama):
    """Under --kv-offload full every layer copies what its decodes read from the host pool to the device: a sequence
    verifying three drafts has four rows, and its blocks are copied once, as a plain decode's are."""
    engine = LLMEngine(EngineConfig(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, kv_offload="full",
                                    num_speculative_tokens=3, prompt_lookup_min=1))
    engine.add_request(PROMPTS[3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    pool, block_size = engine.kv_cache, engine.config.block_size
    row_bytes = 2 * pool.kv_shape[0] * pool.kv_shape[1] * 4  # K and V of a token, float32 on the device
    stats = engine.attention.stats
    drafted = 0
    while engine.has_unfinished_requests():
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        tokens_before, copied_before = (seq.num_tokens if seq else 0), stats.copied_bytes.sum()
        engine.step()
        step = engine.step_stats[-1]
        if step.num_draft_tokens:  # positions up to tokens_before + drafts - 1, in whole blocks, once per layer
            blocks = -(-(tokens_before + step.num_draft_tokens) // block_size)
            assert stats.copied_bytes.sum() - copied_before == pool.num_layers * blocks * block_size * row_bytes
            drafted += 1
    assert drafted > 3


def test_preempted_sequences_with_drafts_still_give_the_plain_output(tiny_llama):
    """A pool of 24 blocks of 16 tokens for 5 sequences of up to 130 tokens: sequences are preempted, and drafts
    find no room at times."""
    kwargs = {"kv_cache_memory": 24 * 16 * 2 * 2 * 2 * 16 * 4, "max_model_len": 256, "block_size": 16}
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    plain_llm = LLM(str(tiny_llama), **kwargs)
    expected, _, _ = run(plain_llm, params=params)
    speculating = LLM(str(tiny_llama), num_speculative_tokens=4, **kwargs)
    outputs, _, accepted = run(speculating, params=params)
    assert outputs == expected and accepted > 0
    assert sum(s.num_preempted for s in speculating.engine.step_stats) > 0


def test_max_tokens_stop_tokens_and_logprobs_are_those_of_plain_decoding(plain, speculating):
    stop = run(plain, PROMPTS[:1], GREEDY)[0][0][25]  # a token the greedy output reaches late
    for params in (SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
                   SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)):
        expected = plain.generate(PROMPTS, params)
        outputs = speculating.generate(PROMPTS, params)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        assert [o.finish_reason for o in outputs] == [o.finish_reason for o in expected]
        for out, exp in zip(outputs, expected):
            assert len(out.token_ids) <= params.max_tokens
            if params.logprobs:
                got = [(lp.token_id, lp.rank, list(lp.top)) for lp in out.logprobs]
                assert got == [(lp.token_id, lp.rank, list(lp.top)) for lp in exp.logprobs]
                assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in exp.logprobs],
                                                                            abs=1e-4)


def test_penalties_min_tokens_and_bad_words_see_the_drafts_before_each_row(plain, speculating):
    words = plain.engine.tokenizer.decode(run(plain, PROMPTS[:1], GREEDY)[0][0][4:6])
    for params in (SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, ignore_eos=False),
                   SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
                   SamplingParams(max_tokens=30, temperature=0.0, min_tokens=25),
                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, bad_words=[words])):
        assert run(speculating, params=params)[0] == run(plain, params=params)[0]


def test_seeded_sampling_gets_no_drafts_and_top_k_1_is_greedy(speculating, plain):
    """A seed gives the tokens it gives without drafts: such requests decode without them (a row after a rejected
    draft would draw from the request's generator too)."""
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    outputs, drafted, _ = run(speculating, params=seeded)
    assert drafted == 0 and outputs == run(plain, params=seeded)[0]
    top_1 = SamplingParams(max_tokens=40, temperature=1.0, top_k=1, ignore_eos=True)
    outputs, drafted, _ = run(speculating, params=top_1)
    assert drafted > 0 and outputs == run(speculating)[0]


def token_frequencies(outputs: list[list[int]], index: int) -> dict[int, float]:
    counts: dict[int, float] = {}
    for tokens in outputs:
        counts[tokens[index]] = counts.get(tokens[index], 0) + 1 / len(outputs)
    return counts


def test_sampled_tokens_keep_their_distribution(tiny_llama):
    """1,000 samples (top-k 2 at temperature 1; torch's generator seeded, so the test repeats) of three tokens after a
    prompt holding every token (so that the second token's step has a draft for the third) and ending in the
    model's own greedy output (so that the drafts are often likely): each position's tokens as frequent with drafts
    as without (total variation under 0.1; an engine that accepted every draft would put the second token on the
    draft every time)."""
    kwargs = {"kv_cache_memory": "8MiB", "max_model_len": 512}
    plain = LLM(str(tiny_llama), **kwargs)
    prompt = torch.randperm(VOCAB_SIZE, generator=torch.Generator().manual_seed(1)).tolist() + PROMPTS[0]
    prompt += plain.generate([prompt], GREEDY)[0].token_ids
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)
    torch.manual_seed(0)
    plain_outputs = [o.token_ids for o in plain.generate([prompt] * 1000, params)]
    speculating = LLM(str(tiny_llama), num_speculative_tokens=1, prompt_lookup_min=1, **kwargs)
    torch.manual_seed(0)
    outputs, drafted, accepted = run(speculating, [prompt] * 1000, params)
    assert drafted > 500 and 0 < accepted < drafted  # a few decodes find the step's token budget spent
    for index in (1, 2):
        expected, got = token_frequencies(plain_outputs, index), token_frequencies(outputs, index)
        distance = sum(abs(got.get(t, 0) - expected.get(t, 0)) for t in expected.keys() | got.keys()) / 2
        assert distance < 0.1, (index, expected, got)


def test_a_structured_output_request_gets_no_drafts(speculating, plain):
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=StructuredOutput(regex="(ab)+c"))
    prompts = [[5, 6, 7]]
    outputs, drafted, _ = run(speculating, prompts, params)
    assert drafted == 0 and outputs == run(plain, prompts, params)[0]


def test_blocks_filled_with_accepted_drafts_serve_later_prompts(speculating, tiny_llama):
    """The prefix cache indexes blocks by their tokens; a block drafts filled must hold what it is indexed by: a
    prompt continuing a speculated output reads its blocks and continues as an engine computing it all."""
    first = run(speculating, PROMPTS[3:4])[0][0]
    prompt = PROMPTS[3] + first
    speculating.engine.step_stats.clear()
    cached = speculating.generate([prompt], GREEDY)[0]
    assert cached.num_cached_tokens >= 32
    uncached = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, enable_prefix_caching=False)
    assert cached.token_ids == uncached.generate([prompt], GREEDY)[0].token_ids


def test_steps_draft_nothing_while_the_batch_is_at_the_size_that_turns_drafts_off(tiny_llama, plain, speculating):
    """Five requests of different lengths drain the batch one by one: without the limit steps of three sequences
    and more draft; with it only the steps run below three do (a step's sequences are the running ones here: every
    one decodes or prefills in it), and the output is plain decoding's."""
    params = [SamplingParams(max_tokens=12 * (i + 1), temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    run(speculating, PROMPTS, params)
    assert any(step.num_draft_tokens and step.num_seqs >= 3 for step in speculating.engine.step_stats)
    limited = LLM(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, num_speculative_tokens=3,
                  speculative_disable_by_batch_size=3)
    outputs, drafted, _ = run(limited, PROMPTS, params)
    steps = limited.engine.step_stats
    assert drafted > 0 and any(step.num_seqs >= 3 for step in steps)
    assert all(step.num_seqs < 3 for step in steps if step.num_draft_tokens)
    assert outputs == run(plain, PROMPTS, params)[0]


@pytest.mark.parametrize("options, named", [
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"), ({"num_speculative_tokens": True}, "got True"),
    ({"num_speculative_tokens": 2, "speculative_disable_by_batch_size": 1}, "speculative_disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "speculative_disable_by_batch_size": "8"}, "got '8'"),
    ({"num_speculative_tokens": 2, "kv_format": "kivi4"}, "'kivi4'"),
    ({"num_speculative_tokens": 2, "kv_offload": "infinigen"}, "'infinigen'"),
    ({"num_speculative_tokens": 2, "kv_offload": "h2o"}, "kv_offload none or full, not 'h2o'"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min 3"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
])
def test_settings_drafts_cannot_run_under_are_refused_by_name(options, named):
    with pytest.raises(KvstrataError, match=named):
        EngineConfig(**options)


def test_an_engine_without_drafts_schedules_one_token_per_decode(tiny_llama):
    engine = LLMEngine(EngineConfig(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256))
    assert engine.scheduler.propose_drafts is None


def test_the_server_counts_each_steps_drafts_and_preemptions_once():
    """Gauges are refreshed after aborts too, between steps: the counters take a step's counts only once."""
    from collections import deque
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from kvstrata.engine.llm_engine import StepStats
    from kvstrata.server.metrics import ServerMetrics

    kv_manager = SimpleNamespace(usage=0.5, prefix_stats=SimpleNamespace(hit_rate=0.0))
    engine = SimpleNamespace(num_running=1, num_waiting=0, num_loading=0, kv_manager=kv_manager, step_stats=deque())
    metrics = ServerMetrics("m")

    def totals() -> dict[str, float]:
        return {sample.name: sample.value for family in text_string_to_metric_families(metrics.render().decode())
                for sample in family.samples}

    for step in (StepStats(0, 4, 1, 1, 0.1, 3, 2), StepStats(0, 5, 1, 0, 0.1, 4, 1)):
        engine.step_stats.append(step)
        metrics.observe_step(engine)
        metrics.observe_step(engine)  # after an abort, say: the same last step
    counted = totals()
    assert counted["kvstrata:spec_decode_num_draft_tokens_total"] == 7
    assert counted["kvstrata:spec_decode_num_accepted_tokens_total"] == 3
    assert counted["kvstrata:num_preemptions_total"] == 1


def test_the_server_streams_what_plain_decoding_gives_and_counts_the_drafts(tiny_llama, plain):
    import httpx

    from tests.server_harness import running_server

    body = {"model": "test-model", "prompt": PROMPTS[3], "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}
    expected = plain.generate([PROMPTS[3]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    with running_server(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, num_speculative_tokens=3) as (
            url, _):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        metrics = httpx.get(f"{url}/metrics").text
    chunks = [json.loads(event)["choices"][0] for event in events[:-1] if json.loads(event)["choices"]]
    assert events[-1] == "[DONE]"
    assert "".join(c["text"] for c in chunks) == expected.text
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == 30
    assert len(chunks) < 30  # drafts were accepted: some chunks carry several tokens
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("kvstrata:spec_decode_num_accepted_tokens_total"))
    assert accepted > 0


def test_drafts_take_only_what_a_step_leaves_and_a_preempted_sequence_drops_them(tiny_llama):
    engine = LLMEngine(EngineConfig(str(tiny_llama), kv_cache_memory="8MiB", max_model_len=256, chunk_size=16,
                                    num_speculative_tokens=4, prompt_lookup_min=1))
    engine.add_request(PROMPTS[3], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    while not any(step.num_draft_tokens for step in engine.step_stats):
        engine.step()
    engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    assert (engine.step_stats[-1].prefill_tokens, engine.step_stats[-1].num_draft_tokens) == (15, 0)
    decoding = next(seq for seq in engine.scheduler.running if seq.num_output_tokens > 1)
    decoding.draft_token_ids = [5, 6]
    engine.scheduler.preempt(decoding)
    assert decoding.draft_token_ids == []

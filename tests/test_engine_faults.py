"""One request's failure is its own: a corrupt preloaded context, a failed forward pass, parameters that
underflow fp32 — the other requests of the step go on and their outputs stay those of a clean run."""

import math

import pytest
import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.penalties import Histories
from kvstrata.engine.pooling_params import PoolingParams
from kvstrata.engine.sampler import finite_rows, greedy_tokens, sample
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.kv.preloaded import LayerwiseKV, PreloadedKV

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BYSTANDERS = [[5, 17, 93, 40, 2, 77], [300, 12, 44], list(range(20, 60)), [9, 9, 9, 9, 101, 250, 3]]
CONTEXT = list(range(100, 150))  # 50 tokens: three full blocks of 16, then two


def new_engine(model, kv_format: str = "fp32") -> LLMEngine:
    memory = "8MiB" if kv_format.startswith("kivi") else "2MiB"  # KIVI also reserves its float16 windows
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory=memory, threads=1, kv_format=kv_format))


def run(engine: LLMEngine, add_poisoned=None) -> dict:
    """Finished outputs by request id; `add_poisoned(engine)` adds the bad request among the bystanders."""
    for i, prompt in enumerate(BYSTANDERS):
        engine.add_request(prompt, GREEDY, request_id=f"ok{i}")
        if i == 1 and add_poisoned is not None:
            add_poisoned(engine)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished


@pytest.fixture(scope="module")
def clean(tiny_llama):
    return {rid: out.token_ids for rid, out in run(new_engine(tiny_llama)).items()}


@pytest.fixture(scope="module")
def context_kv(tiny_llama):
    return new_engine(tiny_llama).compute_kv(CONTEXT)


def assert_bystanders_unharmed(finished: dict, clean: dict) -> None:
    for rid, tokens in clean.items():
        assert finished[rid].finish_reason == "length" and finished[rid].token_ids == tokens


def test_a_preloaded_context_whose_loader_fails_ends_its_request_alone(tiny_llama, clean, context_kv):
    k, v = context_kv

    def load(layer):
        if layer == 1:
            raise OSError("checksum mismatch in layer 1")
        return k[layer], v[layer]

    def add(engine):
        engine.add_request(CONTEXT + [7, 8], GREEDY, request_id="bad", cache_salt=b"file",
                           preloaded=[LayerwiseKV(0, len(CONTEXT), load, tuple(k.shape[2:]))])

    engine = new_engine(tiny_llama)
    finished = run(engine, add)
    assert finished["bad"].finish_reason == "error"
    assert "preloaded KV" in finished["bad"].error and "checksum mismatch in layer 1" in finished["bad"].error
    assert_bystanders_unharmed(finished, clean)
    assert engine.kv_manager.pool.num_used == 0


EMBED = SamplingParams(max_tokens=1, pooling=PoolingParams())


@pytest.mark.parametrize("kv_format, params", [("fp32", GREEDY), ("int8", GREEDY), ("int4", GREEDY),
                                               ("kivi4", GREEDY), ("fp32", EMBED)],
                         ids=["fp32", "int8", "int4", "kivi4", "fp32-embedding"])
def test_a_nan_context_fails_its_request_and_is_never_served_again(tiny_llama, clean, context_kv, kv_format, params):
    """A quantized cache stores NaN as NaN too (no host check per layer): the request fails alone, whether it
    generates (its logits are not finite) or embeds its prompt (its embedding is not)."""
    if kv_format != "fp32":
        clean = {rid: out.token_ids for rid, out in run(new_engine(tiny_llama, kv_format)).items()}
    k, v = context_kv
    k = k.clone()
    k[:, 10] = float("nan")

    def add(engine):
        engine.add_request(CONTEXT + [7, 8], params, request_id="bad", cache_salt=b"file",
                           preloaded=[PreloadedKV(0, k, v)])

    engine = new_engine(tiny_llama, kv_format)
    finished = run(engine, add)
    assert finished["bad"].finish_reason == "error" and "not finite" in finished["bad"].error
    assert_bystanders_unharmed(finished, clean)
    # Its blocks left the prefix cache: the same context and salt, given good KV now, is placed afresh.
    hits = engine.kv_manager.prefix_stats.hit_tokens
    engine.add_request(CONTEXT + [7, 8], params, request_id="again", cache_salt=b"file",
                       preloaded=[PreloadedKV(0, *context_kv)])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].finish_reason != "error" and engine.kv_manager.prefix_stats.hit_tokens == hits
    assert (outputs[0].embedding is not None) == (params is EMBED)
    assert outputs[0].num_cached_tokens == len(CONTEXT)  # the KV given, placed (reused, not computed)


def test_a_failed_forward_pass_ends_that_steps_requests_and_the_engine_goes_on(tiny_llama, clean):
    engine = new_engine(tiny_llama)
    engine.add_request([1, 2, 3], GREEDY, request_id="victim")
    real_execute, calls = engine.runner.execute, []

    def execute_failing_once(work):
        calls.append(len(work))
        if len(calls) == 1:
            raise RuntimeError("simulated kernel fault")
        return real_execute(work)

    engine.runner.execute = execute_failing_once
    failed = engine.step()
    assert [(o.request_id, o.finish_reason) for o in failed] == [("victim", "error")]
    assert "simulated kernel fault" in failed[0].error and engine.kv_manager.pool.num_used == 0
    assert_bystanders_unharmed(run(engine), clean)


@pytest.mark.parametrize("params", [
    {"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1e-320},
    {"top_p": 1e-46}, {"top_p": 1e-320}, {"temperature": 1e300}, {"temperature": math.inf},
    {"repetition_penalty": 0.01}, {"repetition_penalty": 100.0}, {"presence_penalty": -2, "frequency_penalty": 2},
    {"min_p": 1.0, "temperature": 1e-3},
    {"max_tokens": 30, "min_tokens": 25, "stop_token_ids": list(range(48)), "logit_bias": {48: -100}},
])
def test_no_accepted_sampling_parameter_makes_the_sampler_fail(params):
    logits = torch.randn(3, 50) * 30
    histories = Histories([list(range(40))] * 3, [20] * 3, eos_token_ids={49})  # 20 prompt tokens, 20 output
    tokens, _ = sample(logits, [SamplingParams(**params)] * 3, [None] * 3, histories)
    assert all(0 <= t < 50 for t in tokens)
    if "min_tokens" in params:  # every other token would end the output
        assert tokens == [48] * 3
    if params.get("temperature", 1.0) < 1e-5 or params.get("top_p", 1.0) < 1e-30:
        assert tokens == logits.argmax(-1).tolist()  # the limit of a vanishing temperature or nucleus


def test_greedy_tokens_are_torchs_argmax_with_ties_to_the_first():
    logits = torch.randn(5, 300)
    logits[2, [7, 40, 299]] = 50.0  # a three-way tie: the first wins
    logits[3, [0, 1]] = 60.0
    assert greedy_tokens(logits).tolist() == logits.argmax(-1).tolist()
    assert greedy_tokens(logits)[2] == 7 and greedy_tokens(logits)[3] == 0
    assert greedy_tokens(logits[:, ::2]).tolist() == logits[:, ::2].argmax(-1).tolist()  # strided rows


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_row_with_one_non_finite_logit_is_not_finite(bad):
    logits = torch.full((4, 49_152), 3e38)  # large but finite
    logits[1] *= -1
    logits[2, 7] = bad
    logits[3, :2] = torch.tensor([math.inf, -math.inf])
    assert finite_rows(logits) == [True, True, False, False]

"""Cascade attention in the engine (`cascade_min_tokens`): requests that share a prompt prefix decode over the
prefix cache's blocks of it, which the compiled readers then read once for all of them. The kernel's own tests
(test_paged_kernel.py, test_in_place_readers.py) hold its results equal to reading each sequence's copy."""

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS
from kvstrata.kv.kernels import paged_decode
from kvstrata.server.metrics import ServerMetrics

KERNEL = paged_decode.kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernels could not be built")


def shared_prefix_prompts() -> list[list[int]]:
    """Nine prompts: the same 64 tokens (4 blocks), then 3 of their own."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 300, (64,), generator=gen).tolist()
    return [prefix + torch.randint(3, 300, (3,), generator=gen).tolist() for _ in range(9)]


def generate_counting(llm: LLM, prompts: list[list[int]]) -> tuple[list, int]:
    """Greedy outputs of the prompts sent together (with each step's two likeliest tokens), and the prefixes read
    once for the decodes sharing them."""
    reads = KERNEL.shared_prefix_reads()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2))
    return outputs, KERNEL.shared_prefix_reads() - reads


# Reading a prefix once changes the order of attention's sums, so its outputs differ from the plain ones by rounding;
# where the products round their activations to int8 (GGUF blocks, the native loop), such a difference moves the
# log-probabilities by a floor of its own (docs/DESIGN.md), which can flip a near tie: of the nine requests here, one
# parted at such a tie once the weight kernels' sums were reordered.
NEAR_TIE = 0.02


def assert_same_greedy_tokens_but_near_ties(outputs, others):
    """Each output's tokens equal the other run's, or part at a near tie: where they first part, each run's token
    is the other's runner-up, within NEAR_TIE of its likeliest (after that the two continue from other tokens)."""
    for out, other in zip(outputs, others):
        for step, (token, other_token) in enumerate(zip(out.token_ids, other.token_ids)):
            if token != other_token:
                top, other_top = out.logprobs[step].top, other.logprobs[step].top
                assert other_token in top and token in other_top, (step, top, other_top)
                assert top[token] - top[other_token] < NEAR_TIE, (step, top)
                assert other_top[other_token] - other_top[token] < NEAR_TIE, (step, other_top)
                break


@pytest.mark.parametrize(("model", "kv_format"), [("tiny_gguf_style", "fp32"), ("tiny_llama_kv64", "int4"),
                                                  ("tiny_llama_kv64", "oaken")],
                         ids=["native-loop-fp32", "layers-int4", "layers-oaken"])
def test_requests_sharing_a_prefix_read_it_once_and_generate_the_same(model, kv_format, request, oaken_calibrations):
    """Nine requests sharing 64 prompt tokens: with cascade_min_tokens 32 their decodes read the prefix once for all
    (in the compiled loop over all layers, and layer by layer for the quantized formats) and give the greedy tokens
    they give with it off, where nothing is read that way, but where a near tie flips."""
    path = request.getfixturevalue(model)
    options = {"kv_format": kv_format, "threads": 2, "kv_cache_memory": "16MiB",
               "oaken_calibration": str(oaken_calibrations[DEFAULT_RATIOS]) if kv_format == "oaken" else None}
    prompts = shared_prefix_prompts()
    cascade, cascade_reads = generate_counting(LLM(str(path), cascade_min_tokens=32, **options), prompts)
    plain, plain_reads = generate_counting(LLM(str(path), cascade_min_tokens=0, **options), prompts)
    assert cascade_reads > 0 and plain_reads == 0
    assert_same_greedy_tokens_but_near_ties(cascade, plain)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_threshold_is_refused_naming_it(tiny_llama, value):
    with pytest.raises(KvstrataError, match="cascade_min_tokens must be an integer >= 0"):
        LLM(str(tiny_llama), cascade_min_tokens=value)


def test_the_server_counts_the_prefixes_read_once(tiny_gguf_style):
    """/metrics' kvstrata:cascade_prefix_reads_total goes up by what the kernels counted; an engine with it off
    has no such series."""
    def reads(metrics: ServerMetrics) -> float:
        lines = metrics.render().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kvstrata:cascade_prefix_reads"))

    llm = LLM(str(tiny_gguf_style), cascade_min_tokens=32, kv_cache_memory="16MiB")
    metrics = ServerMetrics("test-model", llm.engine)
    before = reads(metrics)
    _, counted = generate_counting(llm, shared_prefix_prompts())
    assert counted > 0 and reads(metrics) - before == counted
    off = ServerMetrics("test-model", LLM(str(tiny_gguf_style), cascade_min_tokens=0, kv_cache_memory="16MiB").engine)
    assert "cascade_prefix_reads" not in off.render().decode()

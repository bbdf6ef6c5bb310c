"""CacheGen steps per token: the importance the context's last tokens give each token, its codes, and the codec's
per-token steps (error bounds, what travels in the stream, bad input)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstrata import LLM
from kvstrata.cachegen import codec, quantize
from kvstrata.cachegen.levels import IMPORTANCE_LEVELS, CodecSettings
from kvstrata.cachegen.token_importance import observed_importance, token_codes
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.errors import KvstrataError

MEDIUM = IMPORTANCE_LEVELS["medium"]


def kv_and_codes(layers: int = 4, tokens: int = 45, channels: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, tokens, channels, generator=g) * torch.linspace(0.5, 4, channels)
    codes = torch.randint(-quantize.TOKEN_CODE_LIMIT, quantize.TOKEN_CODE_LIMIT + 1, (layers, tokens), generator=g)
    return x, codes.to(torch.int8)


def encode(x, codes, settings=MEDIUM, kind="v"):
    steps = quantize.steps_from_sensitivity(torch.ones(x.shape[0], x.shape[2]), 0.4)
    return codec.encode_tensor(x, settings, kind, steps=steps, token_codes=codes), steps


@pytest.mark.parametrize("tokens", [1, 2, 45])
def test_per_token_steps_round_trip_within_their_bounds(tokens):
    x, codes = kv_and_codes(tokens=tokens)
    sections, steps = encode(x, codes)
    decoded = codec.decode_tensor(sections, MEDIUM, tuple(x.shape), "v")
    symbols = quantize.quantize_cachegen(x, None, False, steps, codes)
    assert torch.equal(decoded, quantize.dequantize_cachegen(symbols, tokens, False))
    bound = quantize.cachegen_error_bound(symbols, tokens, False)
    assert ((decoded - x).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    # A token's code c scales its steps, and so its bound, by 2 ** (-c / 4); the first token is the 8-bit anchor.
    plain = quantize.cachegen_error_bound(quantize.quantize_cachegen(x, None, False, steps), tokens, False)
    expected = plain[:, 1:] * torch.exp2(-codes[:, 1:].float() / quantize.TOKEN_CODE_STEPS)[..., None]
    assert torch.allclose(bound[:, 1:], expected)


def test_finer_codes_cost_bytes_and_lower_the_error():
    x, _ = kv_and_codes(tokens=200)
    zeros = torch.zeros(x.shape[:2], dtype=torch.int8)
    fine = torch.full_like(zeros, 8)
    size = {}
    error = {}
    for name, codes in (("zeros", zeros), ("fine", fine)):
        sections, _ = encode(x, codes)
        size[name] = sum(len(b) for b in sections.values())
        error[name] = (codec.decode_tensor(sections, MEDIUM, tuple(x.shape), "v") - x).square().mean()
    assert size["fine"] > size["zeros"] and error["fine"] < error["zeros"] / 8


def test_token_codes_are_checked():
    x, codes = kv_and_codes()
    with pytest.raises(ValueError, match="token_steps"):
        encode(x, None)
    with pytest.raises(ValueError, match="token codes"):
        encode(x, codes[:, 1:])
    with pytest.raises(ValueError, match="token codes"):
        encode(x, codes * 2)  # beyond the limit
    with pytest.raises(KvstrataError, match="token_steps"):
        CodecSettings(bins=(1, 1, 1), differences="k", allocation="sensitivity", token_steps=True)
    sections, _ = encode(x, codes)
    sections["models"] = sections["models"][:-8]
    with pytest.raises(KvstrataError):
        codec.decode_tensor(sections, MEDIUM, tuple(x.shape), "v")


def test_codes_follow_the_log_of_importance():
    importance = torch.tensor([[50.0, 1.0, 2.0, 4.0, 0.25, 1e-9]])
    # log2 relative to the geometric mean of all but the first token (the anchor): 1, 2, 3, 0, -29 -> mean -4.6
    assert token_codes(importance, "v").tolist() == [[0, 6, 7, 8, 4, -8]]  # V's at most 4x coarser
    assert token_codes(importance, "k").tolist() == [[0, 6, 7, 8, 4, 0]]  # K's steps only grow finer
    assert token_codes(torch.ones(2, 1), "v").tolist() == [[0], [0]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory="8MiB", threads=1)


@pytest.mark.parametrize("tokens", [200, 60])
def test_importance_is_the_attention_of_the_last_tokens(llm, tiny_llama, tokens):
    """The mean over heads and over the last 128 queries (fewer in a short context) of transformers' attention."""
    ids = list(range(3, 3 + tokens))
    k, v = compute_kv(llm.engine, ids)
    importance = observed_importance(llm.engine, ids, k, v)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), attn_implementation="eager")
    with torch.no_grad():
        attentions = hf(torch.tensor([ids]), output_attentions=True).attentions
    observed = min(128, tokens - 1)
    expected = torch.stack([a[0, :, -observed:].mean(dim=(0, 1)) for a in attentions])
    assert importance.shape == (len(attentions), tokens)
    torch.testing.assert_close(importance, expected, atol=1e-5, rtol=1e-4)


def test_one_token_context_has_uniform_importance(llm):
    k, v = compute_kv(llm.engine, [5])
    assert torch.equal(observed_importance(llm.engine, [5], k, v), torch.ones(k.shape[0], 1))

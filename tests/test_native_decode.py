"""The compiled loop over all layers (model/native_decode.py) against llama.py's layer-by-layer decode step."""

import pytest
import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.kv.attention_policy import FullAttention
from kvstrata.kv.fused_decode import FusedDecode
from kvstrata.kv.kernels import paged_decode
from kvstrata.model import block_linear
from kvstrata.model.llama import LlamaForCausalLM, after_attention, before_attention, decode_all_layers
from kvstrata.model.native_decode import NativeDecode
from tests.helpers import greedy_mixed_batches, use_policy

needs_kernels = pytest.mark.skipif(paged_decode.kernel() is None or block_linear.kernel() is None,
                                   reason="no C++ compiler: the kernels could not be built")


def new_engine(model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory="2MiB", chunk_size=16, **options))


def a_step(model, lens: list[int], seed: int = 0):
    """Hidden states, their positions and a FusedDecode of pools holding random cached K/V, for sequences of `lens`
    tokens (the new one included) in blocks of 16."""
    c, gen, block = model.config, torch.Generator().manual_seed(seed), 16
    k_pools, v_pools = (torch.randn(c.num_layers, c.num_kv_heads, 24, block, c.head_dim, generator=gen) * 0.5
                        for _ in range(2))
    tables = torch.arange(len(lens) * 6).view(len(lens), 6).flip(1)  # blocks out of order
    lengths = torch.tensor(lens)
    slots = torch.stack([tables[i, (n - 1) // block] * block + (n - 1) % block for i, n in enumerate(lens)])
    x = model.embed_tokens(torch.randint(0, c.vocab_size, (len(lens),), generator=gen))
    return x, lengths - 1, FusedDecode(k_pools, v_pools, slots, tables, lengths)


@pytest.fixture(params=["tiny_gguf_style", "tiny_qwen2_gguf_style", "tiny_qwen3_gguf_style", "tiny_phi3_gguf_style",
                        "tiny_phi4_mini_gguf_style"])
def block_model(request):
    """A Llama, and Qwen2, Qwen3, Phi-3 and Phi-4-mini (their biases, head norms, fused products as shipped, a head
    of 24 channels, a RoPE over half of them), with their products on GGUF blocks."""
    return request.getfixturevalue(request.param)


@needs_kernels
@torch.inference_mode()
def test_the_loop_computes_what_the_layers_compute(block_model):
    """Sequences of 1, 16 (a full block), 17 and 80 tokens: the same final hidden states, and the same K/V written
    at the same slots of every layer's pools, as llama.py's decode step over the same block weights."""
    model = new_engine(block_model).loaded.model
    assert isinstance(model.native_decode, NativeDecode)
    x, positions, step = a_step(model, [1, 16, 17, 80])
    theirs = step._replace(k_pools=step.k_pools.clone(), v_pools=step.v_pools.clone())
    want = model.norm(decode_all_layers(model, x, *model.rotary.cos_sin(positions, x.dtype), theirs))
    got = model.native_decode(x, positions, step)
    # Both quantize each product's activations to int8 per block of 32; the loop's norms sum in another order, so a
    # code may round the other way: differences of that size, not of a wrong computation.
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(step.k_pools, theirs.k_pools, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(step.v_pools, theirs.v_pools, rtol=2e-3, atol=2e-3)
    assert not torch.equal(step.k_pools[-1], a_step(model, [1, 16, 17, 80])[2].k_pools[-1])  # the last layer stored


@needs_kernels
@torch.inference_mode()
def test_the_loop_reads_a_sliding_window_as_the_layers_do(tiny_phi3_gguf_style):
    """Given a window (FusedDecode.window), each row of the loop reads only its last `window` tokens, as the layers'
    one-operator step does; the 80-token row's output is not what it is without the window."""
    model = new_engine(tiny_phi3_gguf_style).loaded.model
    x, positions, step = a_step(model, [1, 16, 17, 80])
    windowed = step._replace(window=20)
    theirs = windowed._replace(k_pools=step.k_pools.clone(), v_pools=step.v_pools.clone())
    want = model.norm(decode_all_layers(model, x, *model.rotary.cos_sin(positions, x.dtype), theirs))
    got = model.native_decode(x, positions, windowed)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    every_key = model.native_decode(x, positions, step._replace(k_pools=step.k_pools.clone(),
                                                                v_pools=step.v_pools.clone()))
    torch.testing.assert_close(every_key[:3], got[:3], rtol=2e-3, atol=2e-3)
    assert not torch.allclose(every_key[3], got[3], atol=1e-2)


@needs_kernels
def test_the_loop_generates_what_the_layers_generate(tiny_gguf_style, monkeypatch):
    original, calls = NativeDecode.__call__, []

    def counted(self, *args):
        calls.append(len(args[0]))
        return original(self, *args)

    monkeypatch.setattr(NativeDecode, "__call__", counted)
    tokens = greedy_mixed_batches(new_engine(tiny_gguf_style))
    assert len(calls) > 10 and max(calls) == 3  # the decode steps, batches of 3 among them, took the loop
    layered = new_engine(tiny_gguf_style, native_decode=False)
    assert layered.loaded.model.native_decode is None
    assert tokens == greedy_mixed_batches(layered)


class LayeredFullAttention(FullAttention):
    """Every cached key, as FullAttention, but no one-operator step: the model runs every layer around `attention`."""


@needs_kernels
def test_a_step_around_the_policys_attention_gives_the_loops_numbers(tiny_gguf_style, monkeypatch):
    """A step of decodes beside a prompt's rows, or under a policy that hooks the layers, runs the compiled halves
    around the policy's attention; rotated by the loop's angles and ended by its final norm (torch's cos, sin and
    rms_norm round apart), its rows' final hidden states are the loop's to the bit, so a greedy request does not
    change with what joins its steps."""
    hidden = []
    original = LlamaForCausalLM.compute_logits
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", lambda model, h: hidden.append(h) or original(model, h))
    greedy_mixed_batches(new_engine(tiny_gguf_style))
    through_the_loop = hidden[:]
    hidden.clear()
    layered = new_engine(tiny_gguf_style)
    use_policy(layered, LayeredFullAttention(layered.kv_cache))
    greedy_mixed_batches(layered)
    assert len(hidden) == len(through_the_loop) > 10
    assert all(torch.equal(theirs, ours) for theirs, ours in zip(through_the_loop, hidden, strict=True))


@needs_kernels
def test_decodes_beside_a_long_prompt_chunk_run_apart_on_the_compiled_halves(tiny_gguf_style, monkeypatch):
    """A step of a long prompt chunk (dense GEMMs, activations in bfloat16) and decodes runs the decodes' rows on the
    compiled halves apart: each decode's final hidden state is the one it gets decoding alone, to the bit."""
    hidden, apart = [], []
    original, split = LlamaForCausalLM.compute_logits, LlamaForCausalLM._forward_decodes_apart
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", lambda model, h: hidden.append(h[:1]) or original(model, h))
    monkeypatch.setattr(LlamaForCausalLM, "_forward_decodes_apart",
                        lambda model, x, *args: apart.append(len(x)) or split(model, x, *args))

    def watched_rows(joining: list[int] | None) -> list[torch.Tensor]:
        engine = LLMEngine(EngineConfig(model=str(tiny_gguf_style), kv_cache_memory="2MiB", chunk_size=256))
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine.add_request(list(range(5, 40)), params)
        for step in range(12):
            engine.step()
            if step == 3 and joining is not None:
                engine.add_request(joining, params)
        rows = hidden[:12]
        hidden.clear()
        return rows

    alone = watched_rows(None)
    beside = watched_rows([5 + i % 50 for i in range(200)])
    assert apart and min(apart) >= block_linear.DENSE_FROM_ROWS  # the watched decode beside the prompt's chunks
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(alone, beside, strict=True))


@needs_kernels
def test_models_the_loop_does_not_compute_keep_the_layers(tiny_llama, tmp_path):
    from tests.tiny_models import save_tiny_checkpoint, tiny_llama_config

    assert new_engine(tiny_llama).loaded.model.native_decode is None  # float weights
    output_bias = save_tiny_checkpoint(tiny_llama_config(attention_bias=True), tmp_path / "llama-biases")
    assert new_engine(output_bias, weights="int4").loaded.model.native_decode is None  # the output product's bias


@needs_kernels
def test_bad_hidden_states_are_refused_by_name(tiny_gguf_style):
    model = new_engine(tiny_gguf_style).loaded.model
    x, positions, step = a_step(model, [5])
    with pytest.raises(RuntimeError, match=r"x must be float32 \[n, 64\]"):
        model.native_decode(x[:, :32], positions, step)
    with pytest.raises(RuntimeError, match=r"positions must be \[n\], one per row"):
        model.native_decode(x, positions.repeat(2), step)


@needs_kernels
@torch.inference_mode()
def test_the_layer_halves_compute_what_the_torch_layer_halves_compute(block_model):
    """Rows at positions 0, 15 and 70 through the first and the last layer: q, k, v before attention and the
    layer's output after it, as llama.py's before_attention and after_attention compute them over the same blocks."""
    model = new_engine(block_model).loaded.model
    gen = torch.Generator().manual_seed(1)
    x = model.embed_tokens(torch.randint(0, model.config.vocab_size, (3,), generator=gen))
    cos, sin = model.rotary.cos_sin(torch.tensor([0, 15, 70]), x.dtype)
    before, after = model.native_decode.dense_parts
    for layer in (model.layers[0], model.layers[-1]):
        for got, want in zip(before(layer, x, cos, sin), before_attention(layer, x, cos, sin), strict=True):
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # as above: an int8 code may round apart
        attended = torch.randn(3, model.config.num_heads, model.config.head_dim, generator=gen)
        torch.testing.assert_close(after(layer, x, attended), after_attention(layer, x, attended), rtol=2e-3,
                                   atol=2e-3)


@needs_kernels
@torch.inference_mode()
def test_speculated_queries_are_the_ones_the_layer_computes_in_a_step(tiny_gguf_style):
    """InfiniGen asks for layer i's queries of an earlier input (layer_queries): on rows the compiled halves take,
    they are what the compiled half computes in a step, not llama.py's torch layer (which rounds apart)."""
    model = new_engine(tiny_gguf_style).loaded.model
    x = model.embed_tokens(torch.randint(0, model.config.vocab_size, (3,), generator=torch.Generator().manual_seed(2)))
    positions = torch.tensor([4, 31, 90])
    cos, sin = model.native_decode.cos_sin(positions)  # the angles such a step rotates by
    before, _ = model.native_decode.dense_parts
    last = len(model.layers) - 1
    assert torch.equal(model.layer_queries(last, x, positions), before(model.layers[last], x, cos, sin)[0])


@needs_kernels
@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_other_formats_run_the_layer_halves_and_generate_what_the_torch_layers_generate(tiny_gguf_style, kv_format,
                                                                                         monkeypatch):
    """A quantized cache has no one-operator step: its steps run the compiled halves of each layer around the
    format's own store and reader, and generate the tokens of the torch layers."""
    calls = []
    original = NativeDecode._before_attention

    def counted(self, layer, x, *args):
        calls.append((layer.layer, len(x)))
        return original(self, layer, x, *args)

    monkeypatch.setattr(NativeDecode, "_before_attention", counted)
    engine = new_engine(tiny_gguf_style, kv_format=kv_format)
    tokens = greedy_mixed_batches(engine)
    layers = len(engine.loaded.model.layers)
    assert [layer for layer, _ in calls[:layers]] == list(range(layers))  # every layer, in order
    assert len(calls) > 10 * layers and 3 in {rows for _, rows in calls}  # every step; decodes of 3 at once among them
    assert tokens == greedy_mixed_batches(new_engine(tiny_gguf_style, kv_format=kv_format, native_decode=False))


@needs_kernels
def test_bad_layer_inputs_are_refused_by_name(tiny_gguf_style):
    model = new_engine(tiny_gguf_style).loaded.model
    x, positions, _ = a_step(model, [5, 9])
    cos, sin = model.rotary.cos_sin(positions, x.dtype)
    with pytest.raises(RuntimeError, match=r"layer 7 out of range: the model has 3"):
        model.native_decode.layers.before_attention(7, x, cos, sin)
    with pytest.raises(RuntimeError, match=r"cos and sin must be float32 \[n, \(1,\) 16\]"):
        model.native_decode.layers.before_attention(0, x, cos[:1], sin[:1])
    with pytest.raises(RuntimeError, match=r"the attention output must be float32 \[n, 4, 16\]"):
        model.native_decode.layers.after_attention(0, x, torch.zeros(2, 4, 8))


def test_many_rows_go_layer_by_layer_where_the_products_turn_dense():
    assert NativeDecode.takes(torch.zeros(block_linear.DENSE_FROM_ROWS - 1, 8))
    assert not NativeDecode.takes(torch.zeros(block_linear.DENSE_FROM_ROWS, 8))
    assert not NativeDecode.takes(torch.zeros(4, 8, dtype=torch.bfloat16))

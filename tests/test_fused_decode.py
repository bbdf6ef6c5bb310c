"""A step of decodes under full attention runs one operator per layer (kv/fused_decode.py): it stores and attends
as the layer-by-layer path does, and a policy that hooks the layers never takes it."""

import pytest
import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.kv.attention_batch import whole_block_keys
from kvstrata.kv.attention_policy import FullAttention
from kvstrata.kv.fused_decode import FusedDecode, store_and_attend
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.reference_attention import attend
from tests.helpers import MIXED_PROMPTS, greedy_mixed_batches

needs_kernel = pytest.mark.skipif(paged_decode.kernel() is None, reason="no C++ compiler: the kernels could not be built")


def new_engine(model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory="2MiB", threads=1, chunk_size=16, **options))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_operator_stores_the_new_rows_and_attends_like_the_reference(dtype):
    """Pools of three layers; the operator writes layer 1's new K/V at the sequences' slots (nothing else changes)
    and returns the reference attention over each sequence's blocks, the new token included."""
    gen = torch.Generator().manual_seed(0)
    layers, kv_heads, blocks, block, dim = 3, 3, 12, 16, 64
    k_pools, v_pools = (torch.randn(layers, kv_heads, blocks, block, dim, generator=gen).to(dtype) for _ in range(2))
    before = k_pools.clone(), v_pools.clone()
    tables = torch.tensor([[4, 0, 0], [7, 2, 9]])
    lens = torch.tensor([5, 40])
    slots = torch.stack([tables[i, (n - 1) // block] * block + (n - 1) % block for i, n in enumerate(lens.tolist())])
    q = torch.randn(2, 9, dim, generator=gen)
    k_new, v_new = torch.randn(2, kv_heads, dim, generator=gen), torch.randn(2, kv_heads, dim, generator=gen)
    got = store_and_attend(1, q, k_new, v_new, FusedDecode(k_pools, v_pools, slots, tables, lens))
    for pools, old, new in ((k_pools, before[0], k_new), (v_pools, before[1], v_new)):
        expected = old.clone()
        expected[1].view(kv_heads, -1, dim)[:, slots] = new.transpose(0, 1).to(dtype)
        assert torch.equal(pools, expected)
    k = k_pools[1][:, tables].flatten(2, 3).permute(1, 2, 0, 3).float()  # [n, tokens, kv_heads, dim]
    v = v_pools[1][:, tables].flatten(2, 3).permute(1, 2, 0, 3).float()
    mask = (whole_block_keys(tables, lens, block).positions != -1)[:, None]
    torch.testing.assert_close(got, attend(q[:, None], k, v, mask)[:, 0], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [0, 8])
def test_the_operator_traces_into_one_compiled_graph(window):
    """torch.compile traces the operator through its fake (shapes only), which is called without the trailing
    arguments left at their defaults (no shared prefix, no window): one graph, computing what the eager call does."""
    gen = torch.Generator().manual_seed(1)
    k_pools, v_pools = (torch.randn(2, 1, 4, 16, 8, generator=gen) for _ in range(2))
    q, k_new, v_new = (torch.randn(2, 1, 8, generator=gen) for _ in range(3))
    tables, lens, slots = torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 9]), torch.tensor([19, 40])
    compiled = torch.compile(store_and_attend, fullgraph=True, backend="eager", dynamic=False)
    got = compiled(0, q, k_new, v_new, FusedDecode(k_pools, v_pools, slots, tables, lens, window=window))
    want = store_and_attend(0, q, k_new, v_new, FusedDecode(k_pools, v_pools, slots, tables, lens, window=window))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_kernel
def test_a_slot_outside_the_pools_is_refused_by_name():
    k_pools, v_pools = torch.zeros(2, 1, 4, 16, 8), torch.zeros(2, 1, 4, 16, 8)
    q, rows = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    step = FusedDecode(k_pools, v_pools, torch.tensor([64]), torch.tensor([[3]]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="slot 64 is outside the pools' 64 slots"):
        store_and_attend(0, q, rows, rows, step)


@needs_kernel
def test_fused_steps_generate_what_the_layer_by_layer_path_does(tiny_llama, monkeypatch):
    """Greedy tokens are the same with decode steps fused and with them layer by layer (a K/V stored at a wrong slot
    or a key left out would move every later step's attention)."""
    offer, fused_steps = FullAttention.fused_decode, []

    def counted(self, *args):
        step = offer(self, *args)
        fused_steps.append(step is not None)
        return step

    monkeypatch.setattr(FullAttention, "fused_decode", counted)
    fused_tokens = greedy_mixed_batches(new_engine(tiny_llama))
    assert sum(fused_steps) > 10
    monkeypatch.setattr(FullAttention, "fused_decode", lambda self, *a: None)
    assert fused_tokens == greedy_mixed_batches(new_engine(tiny_llama))


def test_a_policy_that_hooks_the_layers_sees_every_layer_of_every_decode(tiny_llama):
    """A FullAttention subclass (as engine/layer_capture.py makes) is called in every layer of every step."""

    class CountingAttention(FullAttention):
        calls = 0

        def attention(self, layer, q, k_new, v_new, batch):
            CountingAttention.calls += 1
            return super().attention(layer, q, k_new, v_new, batch)

    engine = new_engine(tiny_llama)
    engine.runner.policy = CountingAttention(engine.kv_cache)
    steps = 0
    for prompt in MIXED_PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert CountingAttention.calls == steps * engine.loaded.config.num_layers

"""The engine on a CUDA GPU, where the quantized KV formats encode and decode with the Triton kernels (kv/gpu; the
compiled in-place readers are CPU-only): fp32 KV gives transformers' logits, and every format generates on the GPU
what it generates on the CPU, over batched prompts of mixed lengths with a shared prefix (prefix caching) and KIVI
blocks leaving their window. Skipped where torch sees no CUDA GPU, as on CI; run them on a GPU machine."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstrata import SamplingParams
from tests.format_cases import CASES, build
from tests.helpers import hf_logits, prefill_in_chunks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")


def test_fp32_kv_on_cuda_gives_transformers_logits(tiny_llama_kv64, oaken_calibrations):
    engine = build(tiny_llama_kv64, oaken_calibrations, "fp32", device="cuda").engine
    ids = torch.randint(3, 320, (97,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, _ = prefill_in_chunks(engine, ids, chunk=32)
    reference = hf_logits(AutoModelForCausalLM.from_pretrained(str(tiny_llama_kv64)), ids)
    torch.testing.assert_close(ours.cpu(), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_each_format_generates_on_cuda_what_it_generates_on_cpu(case, tiny_llama_kv64, oaken_calibrations):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 30, 70)]
    prompts.append(prompts[2][:64] + prompts[0])  # shares the third prompt's first 64 tokens
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    on_cuda = build(tiny_llama_kv64, oaken_calibrations, case, device="cuda")
    if not case.startswith(("fp", "bf")):  # the quantized formats' GPU kernels run
        assert on_cuda.engine.kv_cache.gpu_kernels
    on_cpu = build(tiny_llama_kv64, oaken_calibrations, case)
    assert [o.token_ids for o in on_cuda.generate(prompts, params)] == \
        [o.token_ids for o in on_cpu.generate(prompts, params)]


@pytest.mark.parametrize("case", ["fp32", "fp16", "bf16", "int8", "int4", "kivi4", "kivi2"])
def test_the_layer_loop_never_waits_for_the_gpu(case, tiny_llama_kv64, oaken_calibrations, monkeypatch):
    """Every layer's store, gather and attention is queued without the host waiting for the GPU (torch raises
    on any synchronizing call inside the model's forward), over prefill chunks, decodes and KIVI blocks leaving
    their window. Oaken is not among them: its GPU writer asks the device for the free sparse pages now and then
    (SparsePages.append_on_gpu), and its keys quantized before RoPE take the torch path, whose pages the host
    allocates."""
    llm = build(tiny_llama_kv64, oaken_calibrations, case, device="cuda")
    model = llm.engine.runner.model
    eager_forward = model.forward

    def strict_forward(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return eager_forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 45, 90)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], params)  # first calls may move constants to the GPU once
    monkeypatch.setattr(model, "forward", strict_forward)
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [40, 40, 40]

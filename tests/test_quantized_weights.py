"""--weights: GGUF blocks read exactly, int4/int8 kernels against dequantized references, and a
group-quantized checkpoint loaded in every weight format."""

import json
import logging
import shutil
import threading
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize

from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError
from kvstrata.model import block_linear
from kvstrata.model.block_linear import BlockLinear
from kvstrata.model.group_quantized import GroupQuantized
from kvstrata.model.loader import load_model
from kvstrata.model.quantized_linear import Int4Linear, Int8Linear, group_quantize
from kvstrata.model.weight_format import check_weight_format
from tests.helpers import prefill_in_chunks
from tests.tiny_models import gguf_quantized

GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]
# torch's kernels take bfloat16 activations and bfloat16 (scale, zero) pairs, the block kernels int8 activations per
# block of 32: two or three significant digits, so a product's error is a few parts in a thousand of its size.
KERNEL_RELATIVE_ERROR = 1e-2


GGUF_KINDS = {"int4 blocks": 12, "int8 blocks": 1}  # Q4_1 layers and the Q8_0 head on the block kernels


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_are_read_exactly(type_name):
    weight = torch.randn(48, 96) * 0.05
    raw, read = gguf_quantized(weight, type_name)
    want = dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(read.dequantize().numpy(), want)
    assert read.group_size == 32 and read.bits == (8 if type_name == "Q8_0" else 4)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_int4_kernel_matches_the_dequantized_weight(type_name):
    torch.manual_seed(0)
    _, read = gguf_quantized(torch.randn(80, 128) * 0.05, type_name)
    bias = torch.randn(80) * 0.01
    linear = Int4Linear(read, bias)
    assert linear.planes == (2 if type_name == "Q8_0" else 1)  # Q8_0 runs as two exact int4 planes
    x = torch.randn(5, 128)
    want = F.linear(x, read.dequantize(), bias)
    assert _relative_error(linear(x), want) < KERNEL_RELATIVE_ERROR
    assert linear(x.view(5, 1, 128)).shape == (5, 1, 80)


needs_block_kernels = pytest.mark.skipif(block_linear.kernel() is None, reason="no C++ compiler")


def _block_reference(x: torch.Tensor, read) -> torch.Tensor:
    """The block kernels' arithmetic in float64: each row of x rounded to int8 codes per block of 32 (scale
    max|x| / 127, half to even), products of codes summed exactly, then scaled."""
    blocks = x.double().view(len(x), -1, 32)
    x_scales = blocks.abs().amax(-1, keepdim=True) / 127
    x_codes = torch.where(x_scales > 0, blocks / x_scales, torch.zeros_like(blocks)).round()
    w_codes = read.codes.double().view(read.shape[0], -1, 32)
    dots = torch.einsum("mbj,nbj->mnb", x_codes, w_codes)
    out = (dots * read.scales.double()[None] * x_scales.squeeze(-1)[:, None]).sum(-1)
    if read.offsets is not None:
        out += (read.offsets.double()[None] * (x_scales.squeeze(-1) * x_codes.sum(-1))[:, None]).sum(-1)
    return out


@pytest.fixture(params=["avx512", "avx2"])
def instruction_set(request):
    """The kernels' integer dot products at every number of rows (widened rows off), on their AVX-512 path (where
    the CPU has it) or their AVX2 one."""
    with block_linear.kernel_paths(avx512=request.param == "avx512", widened_rows=False):
        yield request.param


@pytest.fixture
def widened_rows():
    """The AVX2 path with its widened rows, which it takes from 4 rows (on any CPU: AVX-512 off)."""
    with block_linear.kernel_paths(avx512=False, widened_rows=True):
        yield


def _scales_in(read, dtype: torch.dtype):
    """`read` as is (GGUF's scales and mins are float16 values, which the kernel reads as float16), or moved off
    float16's grid by a part in 2**14 (so the kernel keeps them float32)."""
    if dtype == torch.float16:
        return read
    nudge = 1 + 2**-14
    offsets = None if read.offsets is None else read.offsets * nudge
    return GroupQuantized(read.codes, read.scales * nudge, offsets, read.bits, read.group_size)


def _block_layer(type_name: str, columns: int, scale_dtype: torch.dtype, seed: int):
    """A random layer of 82 output rows (beyond the kernels' tiles of four, and of three) as GGUF blocks with its
    scales in `scale_dtype`: (the blocks read, a bias, the BlockLinear)."""
    torch.manual_seed(seed)
    _, read = gguf_quantized(torch.randn(82, columns) * 0.05, type_name)
    read = _scales_in(read, scale_dtype)
    bias = torch.randn(82) * 0.01
    return read, bias, BlockLinear(read, bias)


@needs_block_kernels
@pytest.mark.parametrize("type_name", GGUF_TYPES)
# 4-bit runs in groups of four blocks, 8-bit in pairs on AVX-512: one group; a group and a pair; three blocks;
# and 18 blocks, beyond the sixteen whose offsets the AVX-512 path adds at once
@pytest.mark.parametrize("columns", [128, 192, 96, 576])
@pytest.mark.parametrize("rows", [1, 3, 6])  # rows of activations: one, a partial group of four, more than four
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_block_kernel_computes_int8_dot_products_of_the_gguf_blocks(type_name, columns, rows, scale_dtype,
                                                                     instruction_set):
    read, bias, linear = _block_layer(type_name, columns, scale_dtype, seed=5)
    assert linear.scales.dtype == scale_dtype
    x = torch.randn(rows, columns)
    got = linear(x)
    torch.testing.assert_close(got.double(), _block_reference(x, read) + bias.double(), rtol=1e-5, atol=1e-5)
    assert _relative_error(got, F.linear(x, read.dequantize(), bias)) < KERNEL_RELATIVE_ERROR
    assert linear(x.view(rows, 1, columns)).shape == (rows, 1, 82)


@needs_block_kernels
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_a_rows_products_do_not_depend_on_the_rows_beside_it(type_name, instruction_set):
    """The dot products of one row of activations are the same bits whether it is multiplied alone or beside up to
    five others (tiles of other shapes, 82 output rows leaving tiles of four and of three incomplete): a request's
    greedy output must not change with the batch it is decoded in."""
    _, _, linear = _block_layer(type_name, 576, torch.float16, seed=7)
    x = torch.randn(6, 576)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(6)])
    for rows in range(2, 7):
        assert torch.equal(linear(x[:rows]), alone[:rows])


@needs_block_kernels
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("path", ["avx512", "avx2", "widened rows"])
def test_a_non_finite_activation_spoils_its_own_row_alone(type_name, path):
    _, read = gguf_quantized(torch.randn(16, 64) * 0.05, type_name)
    x = torch.randn(5, 64)
    x[1, 40] = float("inf")
    with block_linear.kernel_paths(avx512=path == "avx512", widened_rows=path == "widened rows"):
        out = BlockLinear(read, None)(x)
    assert out[[0, 2, 3, 4]].isfinite().all()
    # the dot products make it NaN; float32 products, inf or NaN as the weights' signs fall
    assert out[1].isnan().all() if path != "widened rows" else not out[1].isfinite().any()


@needs_block_kernels
@pytest.mark.parametrize("type_name", GGUF_TYPES)
@pytest.mark.parametrize("columns", [128, 96])
@pytest.mark.parametrize("rows", [4, 5, 7, 13])  # tiles of four rows, and one to three more
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_widened_rows_multiply_the_dequantized_weights_in_float32(type_name, columns, rows, scale_dtype,
                                                                   widened_rows):
    read, bias, linear = _block_layer(type_name, columns, scale_dtype, seed=6)
    x = torch.randn(rows, columns)
    exact = F.linear(x.double(), read.dequantize().double(), bias.double())
    # float32 sums of exact products (the int8 activations of the dot products are a hundred times further off)
    torch.testing.assert_close(linear(x).double(), exact, rtol=1e-5, atol=1e-5)
    few = x[:3]  # below four rows the dot products stay
    torch.testing.assert_close(linear(few).double(), _block_reference(few, read) + bias.double(), rtol=1e-5,
                               atol=1e-5)


@needs_block_kernels
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("widened", [torch.bfloat16, torch.float32])
def test_many_rows_take_the_widened_weights_and_few_the_dot_products(monkeypatch, type_name, scale_dtype, widened):
    torch.manual_seed(4)
    _, read = gguf_quantized(torch.randn(128, 96) * 0.05, type_name)
    read = _scales_in(read, scale_dtype)
    bias = torch.randn(128) * 0.01
    linear = BlockLinear(read, bias)
    assert linear.scales.dtype == scale_dtype
    monkeypatch.setattr(block_linear, "widened_dtype", lambda: widened)
    monkeypatch.setattr(block_linear, "_scratch", threading.local())  # no buffer left from another dtype
    exact = read.dequantize()
    in_bf16 = widened == torch.bfloat16
    # code * scale + min, rounded into the widened type (in float32 a fused multiply-add may round it once where
    # dequantize rounds twice: a few ulps of the weights' scale where min nearly cancels the product)
    tolerance = {"rtol": 2**-8, "atol": 0} if in_bf16 else {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(linear._dense_weight(), exact.to(widened), **tolerance)
    many = torch.randn(block_linear.DENSE_FROM_ROWS, 96)
    dense = linear(many)
    assert dense.dtype == torch.float32
    assert _relative_error(dense, F.linear(many, exact, bias)) < (KERNEL_RELATIVE_ERROR if in_bf16 else 1e-5)

    def refuse(self):
        raise AssertionError("a product of few rows widened the weights")

    monkeypatch.setattr(BlockLinear, "_dense_weight", refuse)
    few = many[: block_linear.DENSE_FROM_ROWS - 1]  # the dot products, or widened rows (tested above)
    assert _relative_error(linear(few), F.linear(few, exact, bias)) < KERNEL_RELATIVE_ERROR


def test_q8_as_two_planes_is_far_closer_than_requantizing_to_four_bits():
    torch.manual_seed(1)
    _, read = gguf_quantized(torch.randn(64, 256) * 0.05, "Q8_0")
    x = torch.randn(8, 256)
    want = F.linear(x, read.dequantize())
    planes = _relative_error(Int4Linear(read, None)(x), want)
    four_bit = _relative_error(Int4Linear(group_quantize(read.dequantize(), 4, 32), None)(x), want)
    assert planes < four_bit / 5


def test_group_quantize_rounds_within_half_a_step():
    weight = torch.randn(16, 64)
    quantized = group_quantize(weight, 4, 32)
    error = (quantized.dequantize() - weight).abs().view(16, 2, 32)
    assert (error <= quantized.scales.unsqueeze(-1) / 2 + 1e-6).all()


def test_int8_linear_matches_its_per_row_reference():
    torch.manual_seed(2)
    weight, bias = torch.randn(40, 96) * 0.05, torch.randn(40) * 0.01
    linear = Int8Linear(weight, bias)
    x = torch.randn(3, 96)
    reference = linear.codes.float() * linear.scales.float()[:, None]
    assert _relative_error(linear(x), F.linear(x, reference, bias)) < KERNEL_RELATIVE_ERROR
    assert _relative_error(linear(x), F.linear(x, weight, bias)) < 2 * KERNEL_RELATIVE_ERROR


def test_unknown_or_unsupported_weight_formats_are_refused():
    with pytest.raises(KvstrataError, match="int3.*auto, fp32, bf16, fp16, int8, int4"):
        check_weight_format("int3", torch.device("cpu"))
    with pytest.raises(KvstrataError, match="--weights int4 runs on torch's CPU kernels only"):
        check_weight_format("int4", torch.device("cuda"))


def test_auto_keeps_gguf_blocks_as_integer_kernels(tiny_gguf_style):
    auto = load_model(str(tiny_gguf_style), torch.device("cpu"), torch.float32, "auto")
    assert auto.weights_summary() == (GGUF_KINDS if block_linear.kernel() else {"int4": 12, "int8 as two int4 planes": 1})
    fp32 = load_model(str(tiny_gguf_style), torch.device("cpu"), torch.float32, "fp32")
    assert fp32.weights_summary() == {"float32": 13}
    assert auto.fingerprint == fp32.fingerprint  # one checkpoint, one fingerprint, whatever the form


def _logits(directory, weights: str) -> torch.Tensor:
    engine = LLM(str(directory), weights=weights, kv_cache_memory="8MiB").engine
    return prefill_in_chunks(engine, list(range(3, 67)), chunk=24)[0]


# Relative logit error against the fp32-dequantized weights: auto and bf16 keep the checkpoint's
# values (bf16 rounding only); int4 re-quantizes the Q8_0 head to 4 bits and int8 every layer per row.
@pytest.mark.parametrize(("weights", "bound", "agreement"),
                         [("auto", 0.02, 0.95), ("bf16", 0.02, 0.95), ("int8", 0.05, 0.9), ("int4", 0.15, 0.75)])
def test_every_weight_format_stays_near_the_fp32_logits(tiny_gguf_style, weights, bound, agreement):
    want = _logits(tiny_gguf_style, "fp32")
    got = _logits(tiny_gguf_style, weights)
    assert _relative_error(got, want) < bound
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= agreement


# The int8 activations of products of fewer than four rows flip greedy ties on this model as close as 0.011 (the
# prompt [5, 6, 7, 8] did at its third token once its prefill ran widened; DESIGN.md says why): these prompts'
# fp32 paths keep their top two logits more than 0.02 apart.
@pytest.mark.parametrize("prompts", [[[10, 11, 12, 13, 14], [40, 41, 42]],  # decodes of 2 rows: dot products
                                     # decodes of 4 rows: widened rows without VNNI
                                     [[10, 11, 12, 13, 14], [40, 41, 42], [21, 22, 23, 24, 25, 26], [77, 78, 79, 80]]])
def test_kernel_weights_generate_greedily_like_fp32(tiny_gguf_style, prompts):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    models = {w: LLM(str(tiny_gguf_style), weights=w, kv_cache_memory="8MiB") for w in ("fp32", "auto")}
    runs = {w: [o.token_ids for o in llm.generate(prompts, params)] for w, llm in models.items()}
    for index, (prompt, output) in enumerate(zip(prompts, runs["fp32"])):
        logits = prefill_in_chunks(models["fp32"].engine, prompt + output, chunk=64, seq_id=10**6 + index)[0]
        logits = logits[len(prompt) - 1 : -1]  # those that chose each output token
        top_two = logits.topk(2).values
        assert (top_two[:, 0] - top_two[:, 1]).min() > 0.02
    assert runs["auto"] == runs["fp32"]


def test_prefix_cache_keys_name_the_weight_form(tiny_gguf_style):
    auto = LLM(str(tiny_gguf_style), weights="auto", kv_cache_memory="8MiB").engine.kv_manager.namespace
    fp32 = LLM(str(tiny_gguf_style), weights="fp32", kv_cache_memory="8MiB").engine.kv_manager.namespace
    assert auto != fp32 and b"int4" in auto


def test_requantized_gguf_types_are_named_when_loading(tiny_llama, tmp_path, caplog):
    directory = tmp_path / "k-quants"
    shutil.copytree(tiny_llama, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "kvstrata_requantized_gguf_types": ["Q6_K"]}))
    with caplog.at_level(logging.WARNING, logger="kvstrata.model"):
        load_model(str(directory), torch.device("cpu"), torch.float32, "auto")
    assert "Q6_K have no kernel here; they were quantized again as Q8_0" in caplog.text


def test_the_converter_keeps_q4_k_and_names_the_gguf_types_it_requantizes():
    from kvstrata.model.gguf_convert import requantized_types

    tensor = lambda kind: SimpleNamespace(tensor_type=SimpleNamespace(name=kind))
    reader = SimpleNamespace(tensors=[tensor(k) for k in ("Q4_1", "F32", "Q6_K", "Q8_0", "Q4_K", "Q5_0", "F16")])
    assert requantized_types(reader) == ["Q5_0", "Q6_K"]


def random_q4_k_rows(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Raw Q4_K rows: any bytes are a valid super-block once its two float16 scales are finite."""
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 256, size=(rows, columns // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(-1, 144)
    for start in (0, 2):  # d and dmin
        scales = gen.uniform(1e-3, 1e-2, len(blocks)).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


def test_q4_k_rows_are_read_as_4_bit_groups_without_loss():
    """Each of a super-block's eight groups is an affine map of its 4-bit codes: as groups of 32 the values are the
    gguf package's dequantized ones, to the bit."""
    from kvstrata.model.gguf_convert import _read_tensor

    raw = random_q4_k_rows(6, 512)
    tensor = SimpleNamespace(tensor_type=gguf.GGMLQuantizationType.Q4_K, data=raw)
    read = _read_tensor(tensor)
    assert (read.bits, read.group_size, read.codes.shape) == (4, 32, (6, 512))
    assert np.array_equal(read.dequantize().numpy(), dequantize(raw, gguf.GGMLQuantizationType.Q4_K))


def test_other_quantized_types_are_read_as_q8_0_of_their_values():
    from gguf.quants import quantize

    from kvstrata.model.gguf_convert import _read_tensor

    weight = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    raw = quantize(weight, gguf.GGMLQuantizationType.Q5_0)
    read = _read_tensor(SimpleNamespace(tensor_type=gguf.GGMLQuantizationType.Q5_0, data=raw))
    assert (read.bits, read.group_size) == (8, 32)
    values = dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
    step = np.abs(values.reshape(4, -1, 32)).max(-1, keepdims=True) / 127  # Q8_0's step per group
    # half a step, and the step's own rounding to float16 (2**-11 of it) over up to 127 steps
    assert (np.abs(read.dequantize().numpy() - values).reshape(4, -1, 32) <= 0.57 * step).all()
    assert not np.array_equal(read.dequantize().numpy(), values)  # quantized again, not kept as floats


def test_sensitivity_needs_float_weights_and_says_so(tiny_gguf_style):
    from kvstrata.cachegen.sensitivity import context_gradients

    engine = LLM(str(tiny_gguf_style), weights="auto", kv_cache_memory="8MiB").engine
    with pytest.raises(KvstrataError, match="sensitivity needs float weights"):
        context_gradients(engine, list(range(3, 40)), 30)

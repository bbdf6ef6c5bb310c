import os
import tempfile
from pathlib import Path

import pytest

# Each xdist worker runs torch, and the engines it builds (their default --threads reads OMP_NUM_THREADS), on its
# share of the cores: two workers of two threads each on two cores made every parallel op wait for a thread that
# the other worker held, and the suite took 1.4 times as long. Set before torch is imported: it reads it then.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import torch

# The converted default model is cached per test session, away from the user's cache.
os.environ.setdefault("KVSTRATA_CACHE_DIR", str(Path(tempfile.gettempdir()) / "kvstrata-test-cache"))
# Without a GPU the GPU kernels (kv/gpu, Triton) run in Triton's interpreter, on CPU tensors: set before they are
# imported (Triton reads it when a kernel is defined). Nothing else here uses Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvstrata.data import EMMA
from kvstrata.model import block_linear
from tests.tiny_models import (
    save_gguf_style_copy,
    save_tiny_checkpoint,
    tiny_llama_config,
    tiny_opt_config,
    tiny_phi3_config,
    tiny_phi4_mini_config,
    tiny_phi35_config,
    tiny_qwen2_config,
    tiny_qwen3_config,
)


def pytest_collection_modifyitems(items):
    """Files marked slow first. `make test` hands whole files to its two workers, one at a time in this order
    (--dist loadfile --no-loadscope-reorder), so the long files start early and the short ones even out the end;
    xdist's own order (most tests first) left a few long files of few tests for last, one worker idle meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tiny_llama_config(), tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def block_products_alike_for_any_rows():
    """GGUF block products on the int8 dot products whatever the number of rows: on a CPU without AVX-512 VNNI the
    kernel otherwise widens the weights from 4 rows (float32 activations instead of int8 ones), so a request's
    greedy tokens could change with how many rows share its steps, which a test of something else must not see."""
    if block_linear.kernel() is None:  # torch's int4 kernel: one path for every number of rows
        yield
        return
    with block_linear.kernel_paths(avx512=True, widened_rows=False):
        yield


@pytest.fixture(scope="session")
def tiny_gguf_style(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama with its linear layers as Q4_1 blocks and its embeddings as Q8_0, as a GGUF checkpoint
    converts."""
    return save_gguf_style_copy(tiny_llama, tmp_path_factory.mktemp("tiny-gguf-style"))


@pytest.fixture(scope="session")
def tiny_llama_kv64(tmp_path_factory) -> Path:
    """K/V width 4 heads x 16 = 64: a multiple of Oaken's 64-value blocks and of KIVI's 32-channel groups."""
    return save_tiny_checkpoint(tiny_llama_config(num_key_value_heads=4), tmp_path_factory.mktemp("tiny-llama-kv64"),
                                seed=6)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory) -> Path:
    config = tiny_llama_config(tie_word_embeddings=True, num_key_value_heads=1)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("tiny-llama-tied"), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tiny_qwen2_config(), tmp_path_factory.mktemp("tiny-qwen2"), seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tiny_qwen3_config(), tmp_path_factory.mktemp("tiny-qwen3"), seed=7)


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tiny_phi3_config(), tmp_path_factory.mktemp("tiny-phi3"), seed=9)


@pytest.fixture(scope="session")
def tiny_qwen2_gguf_style(tiny_qwen2, tmp_path_factory) -> Path:
    """Qwen2 (q/k/v biases) with its products as Q4_1 blocks, as a GGUF file of it converts."""
    return save_gguf_style_copy(tiny_qwen2, tmp_path_factory.mktemp("tiny-qwen2-gguf-style"))


@pytest.fixture(scope="session")
def tiny_qwen3_gguf_style(tiny_qwen3, tmp_path_factory) -> Path:
    """Qwen3 (per-head q/k norms) with its products as Q4_1 blocks, as a GGUF file of it converts."""
    return save_gguf_style_copy(tiny_qwen3, tmp_path_factory.mktemp("tiny-qwen3-gguf-style"))


@pytest.fixture(scope="session")
def tiny_phi35(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tiny_phi35_config(), tmp_path_factory.mktemp("tiny-phi35"), seed=10)


@pytest.fixture(scope="session")
def tiny_phi4_mini(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tiny_phi4_mini_config(), tmp_path_factory.mktemp("tiny-phi4-mini"), seed=11)


@pytest.fixture(scope="session")
def tiny_phi3_gguf_style(tiny_phi3, tmp_path_factory) -> Path:
    """Phi-3 (q/k/v and gate/up fused as its checkpoint holds them) with its products as Q4_1 blocks."""
    return save_gguf_style_copy(tiny_phi3, tmp_path_factory.mktemp("tiny-phi3-gguf-style"))


@pytest.fixture(scope="session")
def tiny_phi4_mini_gguf_style(tiny_phi4_mini, tmp_path_factory) -> Path:
    """Phi-4-mini (RoPE over part of each head, LongRoPE, grouped queries) with its products as Q4_1 blocks."""
    return save_gguf_style_copy(tiny_phi4_mini, tmp_path_factory.mktemp("tiny-phi4-mini-gguf-style"))


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tiny_opt_config(), tmp_path_factory.mktemp("tiny-opt"), seed=3)


@pytest.fixture(scope="session")
def tiny_opt_post_norm(tmp_path_factory) -> Path:
    """OPT-350m's layout: layer norm after each block, embeddings projected from a smaller width."""
    config = tiny_opt_config(do_layer_norm_before=False, word_embed_proj_dim=32)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("tiny-opt-post-norm"), seed=4)


@pytest.fixture(scope="session")
def emma_text() -> str:
    return EMMA.read_text()


FOUR_GROUPS = (0.02, 0.03, 0.87, 0.08)  # more than 3 groups: Oaken's two-byte sparse entries


@pytest.fixture(scope="session")
def oaken_calibrations(tiny_llama_kv64, emma_text, tmp_path_factory) -> dict[tuple[float, ...], Path]:
    """Oaken thresholds of the tiny model for the default ratios and for FOUR_GROUPS, calibrated on Emma: a file each."""
    from kvstrata.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.kv.formats.oaken.thresholds import DEFAULT_RATIOS, calibrate

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_kv64), kv_cache_memory="8MiB", threads=1))
    token_ids = engine.tokenize(emma_text[:6000])
    ratio_sets = [DEFAULT_RATIOS, FOUR_GROUPS]
    files = {}
    for ratios, thresholds in zip(ratio_sets, calibrate(engine, token_ids, ratio_sets, 3, 48, progress=False,
                                                        source="emma.txt")):
        files[ratios] = tmp_path_factory.mktemp("oaken") / "thresholds.json"
        thresholds.save(files[ratios])
    return files


@pytest.fixture(scope="session")
def skew_files(tiny_llama, tiny_opt, tiny_gguf_style, tmp_path_factory) -> dict[str, Path]:
    """Each tiny model's InfiniGen skew, calibrated on random token ids (the real calibration's code path); "gguf"
    is the tiny Llama on GGUF blocks, whose decode steps run the compiled layer halves."""
    from kvstrata.engine.kv_offload_setup import calibrate_skew
    from tests.infinigen_cases import engine_for, random_prompts

    directory = tmp_path_factory.mktemp("skews")
    paths = {}
    for name, model in (("llama", tiny_llama), ("opt", tiny_opt), ("gguf", tiny_gguf_style)):
        skew = calibrate_skew(engine_for(model), random_prompts(9, 600)[0], windows=2, window_tokens=200,
                              progress=False)
        paths[name] = directory / f"{name}.npz"
        skew.save(paths[name])
    return paths


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server on a free loopback port, killed after the test."""
    from kvstrata.bench.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.stop()

"""--compile: the layers' dense parts through torch.compile give the eager path's greedy output."""

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.errors import KvstrataError

pytestmark = pytest.mark.slow


def test_compiled_and_eager_layers_generate_the_same_tokens(tiny_llama):
    # Prompts of different lengths, decoded together: prefill chunks and decode batches of several
    # sizes go through the one compiled graph.
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(60, 90))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eager = LLM(str(tiny_llama), kv_cache_memory="8MiB", chunk_size=16)
    compiled = LLM(str(tiny_llama), kv_cache_memory="8MiB", chunk_size=16, compile=True)
    assert [o.token_ids for o in compiled.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    assert compiled.engine.loaded.model.layers[0].dense_parts[0].compiled is not None  # it did compile


def test_compile_is_refused_for_models_without_compiled_parts(tiny_opt):
    with pytest.raises(KvstrataError, match="--compile supports Llama-family models, not opt"):
        LLM(str(tiny_opt), kv_cache_memory="8MiB", compile=True)

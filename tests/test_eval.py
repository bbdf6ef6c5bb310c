"""Quality evaluations on a tiny model: structure, internal consistency, agreement with a direct forward."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvstrata.cli.main import main
from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.eval.cache_scorer import CacheScorer
from kvstrata.eval.compare import configurations
from kvstrata.eval.perplexity import evaluate_perplexity, window_starts
from tests.helpers import prefill_in_chunks


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", chunk_size=32))


def test_decode_mode_scoring_equals_one_forward(engine, emma_text):
    ids = engine.tokenize(emma_text[:3000])[:150]
    direct, seq = prefill_in_chunks(engine, ids, chunk=150)
    engine.kv_manager.free(seq)
    for per_step in (1, 7):
        scored = CacheScorer(engine).next_token_logits(ids, context_len=100, tokens_per_step=per_step)
        assert scored.shape[0] == 50
        assert torch.allclose(scored, direct[99:149], atol=1e-4)
    assert engine.kv_manager.pool.num_used == 0


def test_perplexity_figures_are_consistent(engine, emma_text):
    ids = engine.tokenize(emma_text[:40000])
    result = evaluate_perplexity(engine, ids, context_len=64, score_len=300, windows=3)
    assert result["scored_tokens"] == 900 and len(result["windows"]) == 3
    assert [s["to"] - s["from"] for s in result["segments"]] == [256, 44]
    assert result["perplexity"] == pytest.approx(math.exp(result["mean_nll"]), rel=1e-4)
    start = result["windows"][1]["start_token"]
    piece = ids[start : start + 364]
    logits = CacheScorer(engine).next_token_logits(piece, 64)
    nll = F.cross_entropy(logits, torch.tensor(piece[64:]))
    assert result["windows"][1]["perplexity"] == pytest.approx(math.exp(nll.item()), rel=1e-3)


def test_window_placement_and_bad_sizes(engine):
    assert window_starts(1000, 100, 3) == [0, 450, 900]
    with pytest.raises(KvstrataError, match="fewer than one window"):
        window_starts(50, 100, 1)
    with pytest.raises(KvstrataError, match="context_len must be in"):
        CacheScorer(engine).next_token_logits([1, 2, 3], context_len=3)


def test_compare_specs():
    base = EngineConfig()
    labels = [(label, c.dtype, c.block_size) for label, c in configurations(base, "dtype=bfloat16,block_size=32+dtype=float16")]
    assert labels == [("dtype=bfloat16", "bfloat16", 16), ("block_size=32+dtype=float16", "float16", 32)]
    assert configurations(base, None)[0][1] is base
    with pytest.raises(KvstrataError, match="is not OPTION=VALUE"):
        configurations(base, "colour=blue")
    with pytest.raises(KvstrataError, match="takes an integer"):
        configurations(base, "block_size=big")


def test_eval_ppl_command(tiny_llama, tmp_path, capsys):
    plot = tmp_path / "ppl.png"
    code = main(["eval", "ppl", "--model", str(tiny_llama), "--kv-cache-memory", "8MiB", "--context-len", "32",
                 "--score-len", "40", "--windows", "2", "--json", "--plot", str(plot),
                 "--compare", "block_size=16,block_size=8"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["evaluation"] == "ppl" and len(report["results"]) == 2
    first, second = report["results"]
    assert first["perplexity"] == pytest.approx(second["perplexity"], rel=1e-4)  # block size changes nothing
    assert report["perplexity"] == first["perplexity"] and set(report["ratios_to_first"]) == {"block_size=16", "block_size=8"}
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_eval_agreement_command(tiny_llama, tmp_path, capsys):
    plot = tmp_path / "agreement.png"
    code = main(["eval", "agreement", "--model", str(tiny_llama), "--kv-cache-memory", "8MiB", "--prompts", "3",
                 "--prompt-len", "40", "--gen-len", "12", "--json", "--plot", str(plot),
                 "--compare", "block_size=16,dtype=bfloat16"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    same, coarse = report["results"]
    assert same["agreement"] == 1.0 and same["kl"] < 1e-6 and same["positions"] == 36
    assert coarse["kl"] > same["kl"]  # bfloat16 weights and cache move the distributions
    assert report["agreement"] == 1.0 and plot.read_bytes()[:4] == b"\x89PNG"


def test_needle_prompt_has_the_exact_length_and_the_key_at_its_depth(engine, emma_text):
    from kvstrata.eval.needle import NEEDLE, needle_prompt

    haystack = engine.tokenize(emma_text[:20000])
    for depth in (0.0, 0.5, 1.0):
        prompt = needle_prompt(engine, haystack, 300, depth, "12345")
        assert len(prompt) == 300
        text = engine.tokenizer.decode(prompt)
        assert NEEDLE.format(key="12345").strip() in text
        position = text.index("12345") / len(text)
        assert abs(position - depth) < 0.2
    with pytest.raises(KvstrataError, match="cannot build a 10-token needle prompt"):
        needle_prompt(engine, haystack, 10, 0.5, "12345")


def test_eval_needle_command(tiny_llama, tmp_path, capsys):
    plot = tmp_path / "needle.png"
    code = main(["eval", "needle", "--model", str(tiny_llama), "--kv-cache-memory", "8MiB", "--lengths", "128,256",
                 "--depths", "0,0.5,1", "--trials", "2", "--json", "--plot", str(plot)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    result = report["results"][0]
    assert len(result["grid"]) == 6 and len(result["cases"]) == 12
    assert result["accuracy"] == pytest.approx(sum(c["correct"] for c in result["cases"]) / 12, abs=1e-4)
    assert all(len(c["key"]) == 5 for c in result["cases"])
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "needle", "--model", str(tiny_llama), "--depths", "2"]) == 2

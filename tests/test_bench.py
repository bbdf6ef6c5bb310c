"""The engine benchmarks on a tiny model: each runs, prints one JSON document, draws its plot,
and its figures hang together (no timing is asserted)."""

import json
from pathlib import Path

import pytest
import torch

from kvstrata.cli.main import main

pytestmark = pytest.mark.slow

TINY = ["--kv-cache-memory", "8MiB"]


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_roofline(tiny_llama, tmp_path, capsys):
    plot = tmp_path / "roofline.png"
    report = run_json(capsys, "bench", "roofline", "--model", str(tiny_llama), *TINY, "--prompt-len", "64",
                      "--decode-context", "16", "--decode-steps", "4", "--concurrent", "3",
                      "--concurrent-prompt-len", "16", "--concurrent-output-len", "4", "--json", "--plot", str(plot))
    assert report["benchmark"] == "roofline" and report["gemm_gflops"] > 0 and report["read_bandwidth_gbs"] > 0
    assert report["decode_fraction"] == pytest.approx(report["decode_step_limit_ms"] / report["decode_step_ms"], rel=0.02)
    assert report["prefill_fraction"] == pytest.approx(
        report["prefill_tokens_per_s"] / report["prefill_limit_tokens_per_s"], rel=0.02)
    assert report["flops_per_token_decode"] > report["flops_per_token_prefill"] - 2 * 64 * 64  # logits cost more
    assert 0 < report["concurrent_fraction"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_roofline_counts_the_bytes_the_weight_form_reads(tiny_llama, capsys):
    argv = ["bench", "roofline", "--model", str(tiny_llama), *TINY, "--prompt-len", "16", "--decode-context", "8",
            "--decode-steps", "2", "--concurrent", "0", "--json"]
    fp32 = run_json(capsys, *argv, "--weights", "fp32")
    int4 = run_json(capsys, *argv, "--weights", "int4")
    assert int4["weights"] in ({"int4 blocks": 13}, {"int4": 13}) and fp32["weights"] == {"float32": 13}
    # 4-bit codes plus a (scale, min) per 32 values: 0.625 to 0.75 of a byte per weight, against 4.
    assert int4["decode_read_bytes"] < 0.4 * fp32["decode_read_bytes"]
    assert int4["flops_per_token_decode"] == fp32["flops_per_token_decode"]


@pytest.mark.real_model
def test_decode_against_the_baselines_on_the_default_gguf(capsys):
    report = run_json(capsys, "bench", "decode", "--context", "32", "--steps", "4", "--no-llama-cpp", "--json",
                      "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--rounds", "2")
    assert report["weights"] in ({"int4 blocks": 120, "int8 blocks": 1},  # the compiled block kernels
                                 {"int4": 120, "int8 as two int4 planes": 1})  # torch's int4 kernel
    assert report["kvstrata_tokens_per_s"] > 0 and report["transformers_tokens_per_s"] > 0
    rounds = report["rounds"]
    assert len(rounds) == 2 and "llama_cpp_tokens_per_s" not in report
    for one in rounds:
        assert one["ratio_to_transformers"] == pytest.approx(
            one["kvstrata_tokens_per_s"] / one["transformers_tokens_per_s"], rel=0.01)
    for figure in ("transformers_tokens_per_s", "ratio_to_transformers"):
        assert report[figure] == pytest.approx(sum(one[figure] for one in rounds) / 2, rel=0.01)  # median of 2
    # kvstrata's own rate: over the decode steps of both rounds
    assert min(o["kvstrata_tokens_per_s"] for o in rounds) <= report["kvstrata_tokens_per_s"] * 1.01
    assert report["kvstrata_tokens_per_s"] <= max(o["kvstrata_tokens_per_s"] for o in rounds) * 1.01
    assert 0 <= report["greedy_agreement_with_transformers"] <= 1
    assert report["resident_weight_bytes"] < 0.3 * 538_060_032  # the fp32-dequantized model's bytes
    split = report["kvstrata_step_split_ms"]
    assert 0 < split["layers"] < split["step"] and 0 < split["head"] < split["step"]
    # Each figure is rounded to 4 significant digits, so the three roundings add up to about 1.5e-3 of the step.
    assert split["rest"] == pytest.approx(split["step"] - split["layers"] - split["head"], abs=2e-3 * split["step"])
    assert split["step"] == pytest.approx(1000 / report["kvstrata_tokens_per_s"], rel=0.01)


def test_decode_needs_a_gguf_file(tiny_llama, capsys):
    assert main(["bench", "decode", "--model", str(tiny_llama), *TINY, "--steps", "2"]) == 2
    assert "is not a .gguf file" in capsys.readouterr().err


def test_throughput(tiny_llama, tmp_path, capsys):
    plot = tmp_path / "throughput.png"
    report = run_json(capsys, "bench", "throughput", "--model", str(tiny_llama), *TINY, "--requests", "5",
                      "--prompt-len", "uniform:8:40", "--output-len", "6", "--json", "--plot", str(plot))
    systems = [r.get("scheduler", r["system"]) for r in report["results"]]
    assert systems == ["sarathi", "prefill-first", "static", "transformers"]
    assert report["workload"]["output_tokens"] == 30
    for r in report["results"]:
        assert r["total_tokens_per_s"] == pytest.approx(r["prefill_tokens_per_s"] + r["decode_tokens_per_s"], rel=2e-3)
        assert r["p50_ttft_ms"] <= r["p99_ttft_ms"] and r["p50_e2e_ms"] >= r["p50_ttft_ms"] and r["peak_rss_mib"] > 0
        if "scheduler" in r:  # kvstrata's rows say how far the KV pools grew past the budget: fp32's never do
            assert r["kv_grown_bytes"] == 0
            # and how many sequences ran at once (the budget holds all 5), with none taken out to make room
            assert 1 <= r["most_sequences_in_a_step"] <= 5 and r["preemptions"] == 0
    rates = {s: r["total_tokens_per_s"] for s, r in zip(systems, report["results"])}
    # Rates and ratios are each rounded to 4 significant digits: relative tolerances (a ratio of 5 moves by 0.005).
    assert report["ratios"]["sarathi_vs_transformers"] == pytest.approx(rates["sarathi"] / rates["transformers"], rel=2e-3)
    assert report["speedup_vs_transformers"] == pytest.approx(
        max(rates[s] for s in systems[:3]) / rates["transformers"], rel=2e-3)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_sarathi(tiny_llama, tmp_path, capsys):
    plot = tmp_path / "sarathi.png"
    report = run_json(capsys, "bench", "sarathi", "--model", str(tiny_llama), *TINY, "--batches", "1,2",
                      "--decodes", "1,3", "--ratios", "1,3", "--chunks", "16,32", "--seq-len", "64", "--batch", "3",
                      "--requests", "4", "--overhead-prompt-len", "64", "--overhead-chunks", "16,64", "--chunk", "32",
                      "--context", "32", "--prompt-len", "32", "--json", "--plot", str(plot))
    assert [r["batch"] for r in report["per_token_cost"]] == [1, 2]
    for r in report["piggyback"]:
        assert r["prefill_tokens"] + r["decodes"] == 32
        assert r["piggybacked_ms_per_decode"] == pytest.approx(
            (r["decode_maximal_ms"] - r["prefill_only_ms"]) / r["decodes"], abs=0.02)
    assert [r["pd_ratio"] for r in report["pd_sweep"]] == [1.0, 3.0]
    assert {"sarathi_c16_tokens_per_s", "prefill-first_tokens_per_s", "static_tokens_per_s"} <= set(report["pd_sweep"][0])
    assert report["chunk_overhead"][-1]["slowdown_vs_one_piece"] == 1.0
    assert report["pd_sweep_predicted_peak"] == {"16": 8.0, "32": 16.0}
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_bad_benchmark_flags(tiny_llama):
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--prompt-len", "lots"]) == 2
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--schedulers", "fifo"]) == 2
    assert main(["bench", "sarathi", "--model", str(tiny_llama), "--only", "fig99"]) == 2


@pytest.mark.parametrize("bench", ["cascade", "speculative", "lpm", "offload"])
def test_a_benchmark_that_draws_nothing_refuses_plot(bench, tiny_llama, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["bench", bench, "--model", str(tiny_llama), "--plot", str(tmp_path / "out.png")])
    assert refused.value.code == 2 and "unrecognized arguments: --plot" in capsys.readouterr().err


def test_missing_text_file_is_a_clear_error(tiny_llama, tmp_path, capsys):
    for argv in (["bench", "throughput"], ["bench", "sarathi"], ["eval", "ppl"], ["eval", "needle"]):
        assert main([*argv, "--model", str(tiny_llama), "--text", str(tmp_path / "none.txt")]) == 2
        assert "cannot read text file" in capsys.readouterr().err


def test_lognormal_lengths_are_clipped_heavy_tailed_and_reproducible():
    import random

    from kvstrata.bench.workload import parse_length
    from kvstrata.errors import KvstrataError

    draw = parse_length("lognormal:256:1.0:32:2048", "prompt-len")
    lengths = [draw(random.Random(seed)) for seed in range(2000)]
    assert min(lengths) == 32 and max(lengths) == 2048  # both clips are reached
    assert 230 <= sorted(lengths)[1000] <= 280  # the median is MEDIAN
    assert sum(lengths) / len(lengths) > 1.3 * 256  # the tail pulls the mean above the median
    assert lengths == [draw(random.Random(seed)) for seed in range(2000)]
    for bad in ("lognormal:256:1.0:32", "lognormal:0:1:1:2", "lognormal:9:1:5:4", "lognormal:9:-1:1:4"):
        with pytest.raises(KvstrataError, match="lognormal:MEDIAN:SIGMA:LOW:HIGH"):
            parse_length(bad, "prompt-len")


def test_offload_speed_grid(tiny_llama, capsys):
    """none vs full vs infinigen per (context, batch): the fraction fetched, bytes moved and modeled steps add up."""
    report = run_json(capsys, "bench", "offload", "--model", str(tiny_llama), *TINY, "--contexts", "64,128",
                      "--batches", "2", "--steps", "3", "--infinigen-full-layers", "1", "--json")
    assert [(row["context"], row["batch"]) for row in report["rows"]] == [(64, 2), (128, 2)]
    for row in report["rows"]:
        assert row["full"]["fraction_fetched"] == 1.0 and 0 < row["infinigen"]["fraction_fetched"] < 1
        assert row["infinigen"]["stored_form_bytes_per_step"] < row["full"]["stored_form_bytes_per_step"]
        assert row["infinigen_vs_full"] == pytest.approx(
            row["infinigen"]["tokens_per_s"] / row["full"]["tokens_per_s"], rel=0.01)
        assert row["modeled_pcie3_infinigen_vs_full"] > 0
    assert set(report["infinigen_faster_than_none_from_context"]) == {"2"}


def test_offload_speed_in_rounds(tiny_llama, capsys):
    """--rounds: each round runs the three modes (in another order) and has its own ratios; a cell reports their
    medians, and each mode's run with the median step."""
    report = run_json(capsys, "bench", "offload", "--model", str(tiny_llama), *TINY, "--contexts", "64",
                      "--batches", "2", "--steps", "2", "--rounds", "3", "--infinigen-full-layers", "1", "--json")
    (row,) = report["rows"]
    assert len(row["rounds"]) == 3
    for key in ("infinigen_vs_full", "infinigen_vs_none", "modeled_pcie3_infinigen_vs_full"):
        assert row[key] == sorted(turn[key] for turn in row["rounds"])[1]
    for turn in row["rounds"]:
        assert turn["infinigen_vs_full"] == pytest.approx(
            turn["infinigen"]["tokens_per_s"] / turn["full"]["tokens_per_s"], rel=0.01)
    for mode in ("none", "full", "infinigen"):
        assert row[mode]["step_s"] == sorted(turn[mode]["step_s"] for turn in row["rounds"])[1]
    assert main(["bench", "offload", "--model", str(tiny_llama), *TINY, "--contexts", "64", "--rounds", "0"]) == 2
    assert "rounds must be at least 1; got 0" in capsys.readouterr().err


def test_impress_analysis(tiny_llama, capsys):
    report = run_json(capsys, "bench", "impress-analysis", "--model", str(tiny_llama), *TINY, "--prefix", "120",
                      "--questions", "2", "--quote-tokens", "8", "--ratios", "0.1,0.5,1", "--quality-windows", "2",
                      "--prompt-tokens", "8", "--scored-tokens", "16", "--json")
    assert report["probe_heads"] == 2  # the tiny model's 4 query heads share 2 KV heads
    low, half, everything = report["by_ratio"]
    assert len(low["probe_jaccard"]) == 3 and low["random_jaccard"] < half["random_jaccard"]
    assert everything["probe_jaccard_mean"] == 1.0 and everything["shared_set_mass_mean"] == pytest.approx(1.0)
    for row in (low, half):
        assert all(0 <= j <= 1 for j in row["all_heads_jaccard"])
        assert all(s <= o + 1e-6 for s, o in zip(row["shared_set_mass"], row["own_set_mass"]))  # own top set is best
    quality = report["quality"]
    assert quality["full"]["perplexity_vs_full"] == 0.0 and quality["full"]["agreement"] == 1.0
    # the union of the probe heads' sets reads at least as much as their vote
    assert quality["impress-union r=0.1"]["read_share_derived"] >= quality["impress-vote r=0.1"]["read_share_derived"]
    # r = 1 reads everything and changes nothing
    for method in ("impress-vote", "impress-union", "h2o-keys"):
        assert quality[f"{method} r=1.0"]["agreement"] == 1.0
        assert quality[f"{method} r=1.0"]["perplexity_vs_full"] == pytest.approx(0.0, abs=1e-4)


def test_infinigen_analysis(tiny_llama, capsys):
    report = run_json(capsys, "bench", "infinigen-analysis", "--model", str(tiny_llama), *TINY, "--context", "200",
                      "--num-queries", "8", "--infinigen-full-layers", "1", "--json")
    assert [row["layer"] for row in report["layer_similarity"]] == [1, 2]
    speculation = report["speculation"]
    for name in ("skew", "no_skew", "skew_per_prompt", "oracle"):
        assert all(0 < r <= 1 for r in speculation[f"{name}_recall"])
    needed = report["share_of_keys_needed"]
    assert all(a <= b <= c for a, b, c in zip(needed["mass_0.9"], needed["mass_0.95"], needed["mass_0.99"]))


def test_a_block_head_sharing_the_embeddings_codes_is_read_every_step(tiny_gguf_style):
    from kvstrata.bench.roofline import decode_read_bytes
    from kvstrata.model.loader import load_model

    tied = load_model(str(tiny_gguf_style), torch.device("cpu"), torch.float32, "auto").model
    head = tied.lm_head
    tied.lm_head.codes = tied.embed_tokens.codes  # as a tied checkpoint's Q8_0 head and embedding share them
    assert head.codes is tied.embed_tokens.codes
    layers = sum(t.numel() * t.element_size() for m in tied.layers for t in [*m.parameters(), *m.buffers()])
    head_bytes = sum(t.numel() * t.element_size() for t in head.buffers())
    final_norm = tied.norm.weight.numel() * 4
    assert decode_read_bytes(tied) == layers + head_bytes + final_norm


def test_machine_info_names_the_cpu_model_and_the_features_that_pick_kernel_paths():
    from kvstrata.bench.report import machine_info

    info = machine_info()
    assert isinstance(info["cpu_capability"], str) and info["cpu_capability"]
    assert set(info["cpu_features"]) <= {"vnni", "avx512_bf16", "amx_tile"}
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    assert info["cpu_model"] == (names[0] if names else None)


def test_a_run_counts_the_sequences_at_once_and_the_preemptions(tiny_llama):
    """A budget of 8 blocks (128 tokens) and four requests of 60 tokens: the scheduler admits more than the budget
    holds at their full length, then takes sequences out to make room, and the run's figures say so."""
    from kvstrata.bench.throughput import run_kvstrata
    from kvstrata.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine

    token_bytes = 3 * 2 * 32 * 4  # the tiny model's layers x (K, V) x 2 KV heads of 16 x float32
    config = EngineConfig(model=str(tiny_llama), kv_cache_memory=8 * 16 * token_bytes, max_model_len=64, threads=1,
                          enable_prefix_caching=False)
    loaded = LLMEngine(config).loaded
    gen = torch.Generator().manual_seed(0)
    requests = [(torch.randint(3, 320, (30,), generator=gen).tolist(), 30) for _ in range(4)]
    figures = run_kvstrata(config, loaded, requests)
    assert figures["most_sequences_in_a_step"] > 2 and figures["preemptions"] > 0


def test_beam_search_against_transformers(tiny_llama, capsys):
    """The tiny model's fp32 weights give both the same beams; kvstrata computes the fewest tokens a search needs (the
    prompts, then a token a beam and round)."""
    report = run_json(capsys, "bench", "beam-search", "--model", str(tiny_llama), *TINY, "--prompts", "2",
                      "--prompt-len", "40", "--beam-width", "3", "--max-tokens", "5", "--rounds", "2", "--json")
    assert report["fewest_tokens_computed"] == 2 * (40 + 3 * 4)
    assert len(report["rounds"]) == 2
    for turn in report["rounds"]:
        assert turn["prompts_with_the_same_beams"] == 2
        assert turn["computed_over_fewest"] == 1
        assert turn["ratio_to_transformers"] == pytest.approx(turn["transformers_s"] / turn["kvstrata_s"], rel=0.01)
    assert main(["bench", "beam-search", "--model", str(tiny_llama), *TINY, "--rounds", "0"]) == 2
    assert "--rounds and --prompts must be at least 1" in capsys.readouterr().err


def test_speculative_decoding_against_plain_decoding_and_transformers(tiny_llama, capsys):
    report = run_json(capsys, "bench", "speculative", "--model", str(tiny_llama), *TINY, "--tasks", "rewrite,free",
                      "--prompts", "2", "--max-tokens", "24", "--speculative-tokens", "1,3", "--prompt-lookup-min", "1",
                      "--json")
    assert set(report["tasks"]) == {"rewrite", "free"}
    for task in report["tasks"].values():
        runs = task["kvstrata"]
        assert set(runs) == {"plain", "speculative_1", "speculative_3"}
        assert runs["plain"]["draft_tokens"] == 0
        for name in ("speculative_1", "speculative_3"):
            assert runs[name]["outputs_equal_to_plain"] == 2  # the tiny model's float32 weights
            assert runs[name]["output_tokens"] == runs["plain"]["output_tokens"]
            assert runs[name]["ratio_to_plain"] == pytest.approx(
                runs[name]["tokens_per_s"] / runs["plain"]["tokens_per_s"], rel=0.01)
        assert runs["speculative_3"]["draft_tokens"] > 0
        hf = task["transformers"]
        assert hf["plain"]["output_tokens"] > 0 and hf["prompt_lookup"]["output_tokens"] > 0
    assert main(["bench", "speculative", "--model", str(tiny_llama), *TINY, "--speculative-tokens", "0,2"]) == 2
    assert "--speculative-tokens takes positive integers" in capsys.readouterr().err
    batched = ["bench", "speculative", "--model", str(tiny_llama), *TINY, "--tasks", "rewrite", "--prompts", "3",
               "--batch", "2", "--max-tokens", "16", "--speculative-tokens", "3", "--prompt-lookup-min", "1", "--json"]
    once = run_json(capsys, *batched)
    assert "transformers" not in once["tasks"]["rewrite"]  # its prompt lookup takes one sequence at a time
    runs = once["tasks"]["rewrite"]["kvstrata"]
    assert runs["speculative_3"]["outputs_equal_to_plain"] == 3 and runs["speculative_3"]["draft_tokens"] > 0
    twice = run_json(capsys, *batched, "--rounds", "2")["tasks"]["rewrite"]["kvstrata"]
    for name, run in runs.items():  # the same greedy work each round, counted over both
        assert [twice[name][key] for key in ("output_tokens", "steps", "draft_tokens")] == \
            [2 * run[key] for key in ("output_tokens", "steps", "draft_tokens")]
    offloaded = run_json(capsys, *batched, "--kv-offload", "full")["tasks"]["rewrite"]["kvstrata"]
    assert "kv_copied_bytes" not in runs["plain"]
    assert 0 < offloaded["speculative_3"]["kv_copied_bytes_per_token"] < offloaded["plain"]["kv_copied_bytes_per_token"]
    assert offloaded["plain"]["modeled_transfer_s_per_token"] > 0
    assert main(["bench", "speculative", "--model", str(tiny_llama), *TINY, "--rounds", "0"]) == 2
    assert "--batch and --rounds must be at least 1" in capsys.readouterr().err
    assert main(["bench", "speculative", "--model", str(tiny_llama), *TINY, "--tasks", "poem"]) == 2
    assert "--tasks takes rewrite, extract, free (got 'poem')" in capsys.readouterr().err


def test_lora_adapters_against_the_base_model_and_transformers_merged_weights(tiny_llama, capsys):
    report = run_json(capsys, "bench", "lora", "--model", str(tiny_llama), *TINY, "--adapters", "2", "--rank", "4",
                      "--requests", "4", "--prompt-tokens", "32", "--max-tokens", "8", "--json")
    runs = report["kvstrata"]
    assert set(runs) == {"base", "one_adapter", "mixed"}
    # per layer, rank 4: A 4 x 64 for q, k, v, o, gate and up, 4 x 128 for down; B 64 + 32 + 32 + 64 + 128 + 128 + 64
    # rows of 4; three layers, float64
    assert report["adapter_bytes"] == 3 * 4 * (6 * 64 + 128 + 512) * 8
    for run in runs.values():
        assert run["output_tokens"] == 4 * 8
        assert run["ratio_to_base"] == pytest.approx(run["tokens_per_s"] / runs["base"]["tokens_per_s"], rel=0.01)
    for name in ("base", "mixed"):  # the tiny model's float32 weights: transformers' outputs exactly
        assert runs[name]["outputs_equal_to_transformers"] == 4
        assert report["transformers"][name]["output_tokens"] == 4 * 8
    assert main(["bench", "lora", "--model", str(tiny_llama), *TINY, "--rank", "0"]) == 2
    assert "--rank" in capsys.readouterr().err


def test_priority_serves_the_urgent_requests_sooner_than_fcfs(tiny_llama, capsys):
    report = run_json(capsys, "bench", "priority", "--model", str(tiny_llama), "--background", "6",
                      "--background-running", "2", "--background-prompt-tokens", "32", "--background-max-tokens", "16",
                      "--urgent", "2", "--urgent-prompt-tokens", "8", "--urgent-max-tokens", "4", "--urgent-after", "3",
                      "--urgent-every", "5", "--rounds", "1", "--json")
    assert report["workload"]["urgent_arrival_steps"] == [3, 8]
    fcfs, priority = report["medians"]["fcfs"], report["medians"]["priority"]
    # steps, not seconds: under fcfs each urgent request waits for background requests to finish; under priority it
    # preempts one and has its first token the next step
    assert priority["urgent_ttft_steps_mean"] == 1 < fcfs["urgent_ttft_steps_mean"]
    assert priority["preemptions"] >= 1 and priority["recomputed_tokens"] > 0
    assert report["fcfs_over_priority"]["urgent_ttft_steps_mean"] == fcfs["urgent_ttft_steps_mean"]
    assert main(["bench", "priority", "--model", str(tiny_llama), "--urgent", "0"]) == 2
    assert "--urgent" in capsys.readouterr().err
    assert main(["bench", "priority", "--model", str(tiny_llama), "--urgent-every", "0"]) == 2
    assert "--urgent-every at least 1" in capsys.readouterr().err


def test_priority_sends_urgent_requests_due_after_the_background_finished(tiny_llama, capsys):
    report = run_json(capsys, "bench", "priority", "--model", str(tiny_llama), "--background", "1",
                      "--background-running", "1", "--background-prompt-tokens", "8", "--background-max-tokens", "2",
                      "--urgent", "2", "--urgent-prompt-tokens", "8", "--urgent-max-tokens", "2", "--urgent-after",
                      "20", "--urgent-every", "3", "--rounds", "1", "--json")
    for policy in ("fcfs", "priority"):  # nothing else runs by then: each has its first token the next step
        assert report["medians"][policy]["urgent_ttft_steps_mean"] == 1


def test_lpm_computes_less_of_the_shared_documents_than_fcfs_for_the_same_outputs(tiny_llama, capsys):
    report = run_json(capsys, "bench", "lpm", "--model", str(tiny_llama), "--documents", "4", "--document-tokens",
                      "64", "--questions", "3", "--question-tokens", "8", "--max-tokens", "4", "--documents-held", "2",
                      "--rounds", "1", "--json")
    fcfs, lpm = report["medians"]["fcfs"], report["medians"]["lpm"]
    assert report["outputs_compared"] == {"lpm": {"requests": 12, "same": 12, "first_difference_at": []}}
    # every request's prompt is computed at least in part; a document shared by its questions at most once each
    # under lpm, where it is read from the prefix cache by the others
    assert 4 * (64 + 3 * 8) <= lpm["computed_prompt_tokens"] < fcfs["computed_prompt_tokens"]
    assert lpm["prefix_hit_share"] > fcfs["prefix_hit_share"]
    assert report["fcfs_over"]["lpm"]["computed_prompt_tokens"] == pytest.approx(
        fcfs["computed_prompt_tokens"] / lpm["computed_prompt_tokens"], rel=1e-3)
    assert main(["bench", "lpm", "--model", str(tiny_llama), "--questions", "0"]) == 2
    assert "--questions must be at least 1, got 0" in capsys.readouterr().err
    assert main(["bench", "lpm", "--model", str(tiny_llama), "--documents", "1000"]) == 2
    assert "fewer than the 1152000 of 1000 passages of 1024 and 4000 questions of 32" in capsys.readouterr().err


def test_cascade_reads_each_shared_prefix_once_for_the_same_outputs(tiny_llama, capsys):
    report = run_json(capsys, "bench", "cascade", "--model", str(tiny_llama), *TINY, "--requests", "16", "--prefixes",
                      "1,2", "--prefix-tokens", "32", "--question-tokens", "8", "--max-tokens", "4",
                      "--cascade-min-tokens", "32", "--kv-formats", "fp32,int8", "--rounds", "2", "--json")
    cases = report["cases"]
    assert [(case["kv_format"], case["prefixes"]) for case in cases] == [("fp32", 1), ("fp32", 2), ("int8", 1),
                                                                         ("int8", 2)]
    for case in cases:
        # 16 requests over one prefix or 8 over each of two: every decode step reads each prefix once per layer
        assert all(run["shared_prefix_reads"] > 0 for run in case["runs"]["cascade"])
        assert all(run["shared_prefix_reads"] == 0 for run in case["runs"]["plain"])
        assert case["plain_same_every_round"] == 16 and case["same_greedy_outputs"] == 16
        medians = case["medians"]
        assert case["cascade_over_plain"]["decode_tokens_per_s"] == pytest.approx(
            medians["cascade"]["decode_tokens_per_s"] / medians["plain"]["decode_tokens_per_s"], rel=2e-3)
    assert main(["bench", "cascade", "--model", str(tiny_llama), "--prefixes", "0"]) == 2
    assert "--prefixes takes positive integers, comma-separated, got '0'" in capsys.readouterr().err
    assert main(["bench", "cascade", "--model", str(tiny_llama), "--cascade-min-tokens", "0"]) == 2
    assert "the benchmark compares it with that" in capsys.readouterr().err
    assert main(["bench", "cascade", "--model", str(tiny_llama), "--max-tokens", "1"]) == 2
    assert "--max-tokens must be at least 2, got 1" in capsys.readouterr().err


def test_lpm_with_cold_requests_arriving_one_by_one_and_aging(tiny_llama, capsys):
    report = run_json(capsys, "bench", "lpm", "--model", str(tiny_llama), "--documents", "2", "--document-tokens",
                      "48", "--questions", "4", "--question-tokens", "8", "--max-tokens", "4", "--documents-held", "2",
                      "--cold", "2", "--arrive-every", "2", "--lpm-aging-tokens-per-s", "100", "--rounds", "1",
                      "--json")
    assert set(report["medians"]) == {"fcfs", "lpm", "lpm_aging"}
    assert report["config"]["lpm_aging_tokens_per_s"] == {"fcfs": 0.0, "lpm": 0.0, "lpm_aging": 100.0}
    assert report["workload"]["cold"] == 2
    for name in ("lpm", "lpm_aging"):
        assert report["outputs_compared"][name] == {"requests": 10, "same": 10, "first_difference_at": []}
        assert report["medians"][name]["max_cold_ttft_s"] >= report["medians"][name]["p50_cold_ttft_s"] > 0
        assert "max_cold_ttft_s" in report["fcfs_over"][name]


def test_embed_against_transformers_on_distinct_and_shared_prefix_texts(tiny_llama, capsys):
    report = run_json(capsys, "bench", "embed", "--model", str(tiny_llama), *TINY, "--texts", "6", "--length",
                      "uniform:8:40", "--prefix-tokens", "48", "--suffix-tokens", "8", "--hf-batch-size", "4",
                      "--json")
    for name in ("distinct", "shared_prefix"):
        row = report[name]
        assert row["texts"] == 6 and row["min_cosine_to_transformers"] > 0.9999  # float32 weights: the same states
        assert row["ratio_to_transformers"] == pytest.approx(
            row["kvstrata"]["texts_per_s"] / row["transformers"]["texts_per_s"], rel=0.01)
    shared = report["shared_prefix"]
    assert shared["prompt_tokens"] == 6 * 56
    assert shared["kvstrata"]["computed_tokens"] == 56 + 5 * (56 - 48)  # the passage's 3 blocks computed once
    assert report["distinct"]["kvstrata"]["computed_tokens"] == report["distinct"]["prompt_tokens"]

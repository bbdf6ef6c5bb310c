"""`kvstrata bench ...`: performance benchmarks."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstrata.bench.serve import add_bench_serve_arguments
from kvstrata.cli.engine_args import add_engine_arguments
from kvstrata.data import EMMA


def _add_output_flags(parser: argparse.ArgumentParser, plot: bool = False) -> None:
    """--json and --text; and --plot where the benchmark draws one (elsewhere argparse refuses it)."""
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    if plot:
        parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    parser.add_argument("--text", type=Path, default=EMMA, help="UTF-8 text the prompts are cut from")


def add_bench_commands(commands) -> None:
    bench = commands.add_parser("bench", help="performance benchmarks").add_subparsers(dest="bench", required=True)
    serve = bench.add_parser(
        "serve", help="load generator against a running server",
        description="Open-loop (Poisson arrivals at --request-rate) or closed-loop (--concurrency clients) "
                    "streaming load against a running kvstrata (or any OpenAI-compatible) server.",
    )
    add_bench_serve_arguments(serve)

    roofline = bench.add_parser(
        "roofline", help="the engine's decode and prefill against this machine's bandwidth and GEMM limits",
        description="Measures fp32 GEMM GFLOP/s and memory read bandwidth, derives the model's limits, and reports "
                    "`decode_fraction` (limit / measured batch-1 decode step) and `prefill_fraction` (measured "
                    "prefill tokens/s / GEMM limit), plus the same for --concurrent requests run together.",
    )
    roofline.add_argument("--prompt-len", type=int, default=1024, help="prefill prompt length (default: 1024)")
    roofline.add_argument("--decode-context", type=int, default=128, help="context of the decode steps (default: 128)")
    roofline.add_argument("--decode-steps", type=int, default=32, help="decode steps timed (default: 32)")
    roofline.add_argument("--concurrent", type=int, default=32, help="requests run together; 0 skips (default: 32)")
    roofline.add_argument("--concurrent-prompt-len", type=int, default=256)
    roofline.add_argument("--concurrent-output-len", type=int, default=128)
    _add_output_flags(roofline, plot=True)
    add_engine_arguments(roofline)

    decode = bench.add_parser(
        "decode", help="batch-1 decode tokens/s against llama.cpp and transformers on the same GGUF file",
        description="Greedy decoding after one prompt of --context tokens, --steps tokens: kvstrata (with the "
                    "engine options given, e.g. --weights), llama.cpp through llama-cpp-python when it is "
                    "installed (same GGUF file, as many threads as torch), and transformers (the GGUF dequantized "
                    "to fp32), one after another in each of --rounds rounds. Reports each round's tokens/s (1 / "
                    "median step), ratios and how long the greedy tokens agree, their medians over the rounds, and "
                    "the weight bytes a decode step reads.",
    )
    decode.add_argument("--context", type=int, default=128, help="prompt tokens before decoding (default: 128)")
    decode.add_argument("--steps", type=int, default=128, help="decode steps timed (default: 128)")
    decode.add_argument("--rounds", type=int, default=3,
                        help="rounds of kvstrata then each baseline; a ratio compares one round's runs (default: 3)")
    decode.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    decode.add_argument("--no-transformers", action="store_true", help="skip transformers")
    _add_output_flags(decode)
    add_engine_arguments(decode)

    beam = bench.add_parser(
        "beam-search", help="beam search against transformers' generate(num_beams=...) on the same prompts",
        description="Each round: kvstrata's beam search over --prompts prompts of --prompt-len tokens at once (its "
                    "prefix cache emptied first), then transformers' generate with the same num_beams over them "
                    "in one batch, both to exactly --max-tokens tokens (end tokens ignored). Reports seconds, the "
                    "ratio, the prompts given the same beams by both, and the tokens kvstrata computed against the "
                    "fewest a search needs.",
    )
    beam.add_argument("--beam-width", type=int, default=4, help="beams (default: 4)")
    beam.add_argument("--max-tokens", type=int, default=32, help="tokens each beam generates (default: 32)")
    beam.add_argument("--prompts", type=int, default=4, help="prompts searched together (default: 4)")
    beam.add_argument("--prompt-len", type=int, default=128, help="tokens of each prompt (default: 128)")
    beam.add_argument("--rounds", type=int, default=3, help="rounds of kvstrata then transformers (default: 3)")
    _add_output_flags(beam)
    add_engine_arguments(beam)

    speculative = bench.add_parser(
        "speculative", help="speculative decoding by prompt lookup against plain decoding and transformers'",
        description="For each of --tasks (rewrite, extract, free: chat requests about paragraphs of --text), greedy "
                    "decoding one request at a time: kvstrata plain, then with each --speculative-tokens value "
                    "(--prompt-lookup-min/max as given), then transformers plain and with prompt_lookup_num_tokens. "
                    "Reports tokens/s, ratios, drafts verified and accepted, and the outputs equal to plain "
                    "decoding's.",
    )
    speculative.add_argument("--tasks", default="rewrite,extract,free",
                             help="comma-separated: rewrite, extract, free (default: all)")
    speculative.add_argument("--speculative-tokens", default="2,3,4",
                             help="drafts per step to compare, comma-separated (default: 2,3,4)")
    speculative.add_argument("--prompts", type=int, default=6, help="paragraphs, one request each (default: 6)")
    speculative.add_argument("--skip-passages", type=int, default=0,
                             help="paragraphs of the text passed over first (default: 0)")
    speculative.add_argument("--max-tokens", type=int, default=160, help="tokens per request at most (default: 160)")
    speculative.add_argument("--batch", type=int, default=1,
                             help="requests sent at once, each group run to its end (default: 1; above 1 without "
                                  "transformers, whose prompt lookup takes one sequence)")
    speculative.add_argument("--rounds", type=int, default=1,
                             help="runs of every engine per task, in an order reversed each round; tokens/s over all "
                                  "of them (default: 1)")
    speculative.add_argument("--no-transformers", action="store_true", help="skip transformers")
    _add_output_flags(speculative)
    add_engine_arguments(speculative)

    lora = bench.add_parser(
        "lora", help="LoRA adapters: base model, one adapter and mixed adapters, against transformers' merged weights",
        description="--adapters random LoRA adapters of --rank on every projection; --requests prompts of "
                    "--prompt-tokens tokens generated together, greedy to --max-tokens tokens: all on the base model, "
                    "all on one adapter, and spread over the adapters (every step mixes them). Then transformers "
                    "generates the base workload in a batch, and each adapter's requests of the mixed one in a batch "
                    "on its merged weights. Reports tokens/s, ratios and outputs equal to transformers'.",
    )
    lora.add_argument("--adapters", type=int, default=4, help="adapters the mixed run spreads over (default: 4)")
    lora.add_argument("--rank", type=int, default=16, help="rank of every adapter (default: 16)")
    lora.add_argument("--requests", type=int, default=16, help="requests generated together (default: 16)")
    lora.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each prompt (default: 256)")
    lora.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default: 64)")
    lora.add_argument("--no-transformers", action="store_true", help="skip transformers")
    _add_output_flags(lora)
    add_engine_arguments(lora)

    embed = bench.add_parser(
        "embed", help="embeddings against transformers' forward pass, on distinct texts and texts sharing a prefix",
        description="--texts texts of --length tokens (distinct), and --texts texts of one --prefix-tokens passage "
                    "followed by --suffix-tokens of their own (shared_prefix), embedded by kvstrata together and by "
                    "transformers in left-padded batches of --hf-batch-size. Reports texts/s, kvstrata's ratio, the "
                    "prompt tokens it computed and the lowest cosine similarity between the two engines' embeddings.",
    )
    embed.add_argument("--texts", type=int, default=32, help="texts per workload (default: 32)")
    embed.add_argument("--length", default="lognormal:256:0.8:32:1024",
                       help="distinct texts' tokens: N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA:LOW:HIGH "
                            "(default: lognormal:256:0.8:32:1024)")
    embed.add_argument("--prefix-tokens", type=int, default=512, help="the shared passage's tokens (default: 512)")
    embed.add_argument("--suffix-tokens", type=int, default=64, help="each text's own tokens after it (default: 64)")
    embed.add_argument("--hf-batch-size", type=int, default=8, help="transformers' batch (default: 8)")
    embed.add_argument("--no-transformers", action="store_true", help="skip transformers")
    _add_output_flags(embed)
    add_engine_arguments(embed)

    priority = bench.add_parser(
        "priority", help="urgent requests behind a batch job: --scheduling-policy priority against fcfs",
        description="--background requests (priority 1) sent at once to a KV budget that holds --background-running "
                    "of them; --urgent shorter requests (priority 0) arriving before step --urgent-after and every "
                    "--urgent-every steps after it. The same workload under fcfs and under priority, alternately "
                    "for --rounds rounds. Reports the urgent requests' time to first token and latency, the "
                    "background's latency, tokens/s, preemptions and recomputed tokens, and fcfs over priority.",
    )
    priority.add_argument("--background", type=int, default=16, help="background requests (default: 16)")
    priority.add_argument("--background-running", type=int, default=8,
                          help="background requests the KV budget holds at full length (default: 8)")
    priority.add_argument("--background-prompt-tokens", type=int, default=256, help="(default: 256)")
    priority.add_argument("--background-max-tokens", type=int, default=128, help="(default: 128)")
    priority.add_argument("--urgent", type=int, default=4, help="urgent requests (default: 4)")
    priority.add_argument("--urgent-prompt-tokens", type=int, default=64, help="(default: 64)")
    priority.add_argument("--urgent-max-tokens", type=int, default=16, help="(default: 16)")
    priority.add_argument("--urgent-after", type=int, default=16, help="step before which the first arrives "
                                                                       "(default: 16)")
    priority.add_argument("--urgent-every", type=int, default=32, help="steps between arrivals (default: 32)")
    priority.add_argument("--rounds", type=int, default=2, help="rounds of fcfs then priority (default: 2)")
    _add_output_flags(priority)
    add_engine_arguments(priority)

    lpm = bench.add_parser(
        "lpm", help="documents each asked several questions, all at once: --scheduling-policy lpm against fcfs",
        description="--documents passages of --document-tokens, each asked --questions questions of --question-tokens, "
                    "all sent at once in a shuffled order (--seed) to a KV budget that holds --documents-held "
                    "requests; --cold requests over passages of their own among them; with --arrive-every K one "
                    "sent every K steps. The same workload under fcfs, lpm, and lpm with --lpm-aging-tokens-per-s "
                    "where given, in turn for --rounds rounds. Reports seconds, tokens/s, prompt tokens computed, "
                    "the prefix-cache hit share, time to first token, latency and preemptions, how many outputs agree "
                    "with fcfs's, and fcfs over each lpm configuration.",
    )
    lpm.add_argument("--documents", type=int, default=8, help="(default: 8)")
    lpm.add_argument("--document-tokens", type=int, default=1024, help="(default: 1024)")
    lpm.add_argument("--questions", type=int, default=4, help="questions per document (default: 4)")
    lpm.add_argument("--question-tokens", type=int, default=32, help="(default: 32)")
    lpm.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per request (default: 32)")
    lpm.add_argument("--documents-held", type=int, default=3,
                     help="requests the KV budget holds at full length (default: 3)")
    lpm.add_argument("--cold", type=int, default=0,
                     help="more requests, each over a passage of its own, spread through the order (default: 0)")
    lpm.add_argument("--arrive-every", type=int, default=0,
                     help="send request i before step i x this (default: 0, all at once)")
    lpm.add_argument("--seed", type=int, default=0, help="the requests' order (default: 0)")
    lpm.add_argument("--rounds", type=int, default=2, help="rounds of fcfs then lpm (default: 2)")
    _add_output_flags(lpm)
    add_engine_arguments(lpm)

    cascade = bench.add_parser(
        "cascade", help="decodes sharing a long prefix: read once for all (cascade attention) against once each",
        description="--prefixes prefixes of --prefix-tokens tokens of the text, request i reading prefix i mod "
                    "--prefixes and a question of its own; all --requests sent at once, exactly --max-tokens greedy "
                    "tokens each (several values of any of the three: every combination). For each of --kv-formats, "
                    "engines with the options' --cascade-min-tokens and with 0 take turns for --rounds rounds. "
                    "Reports decode and output tokens/s, cascade's over plain's, and the requests given the same "
                    "greedy tokens by both.",
    )
    cascade.add_argument("--requests", default="32", help="requests, comma-separated (default: 32)")
    cascade.add_argument("--prefixes", default="1", help="prefixes the requests share, comma-separated (default: 1)")
    cascade.add_argument("--prefix-tokens", default="2048",
                         help="tokens of the prefix, comma-separated (default: 2048)")
    cascade.add_argument("--question-tokens", type=int, default=32, help="each request's own tokens (default: 32)")
    cascade.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (default: 64)")
    cascade.add_argument("--kv-formats", default="fp32,int4,oaken",
                         help="KV formats compared (default: fp32,int4,oaken)")
    cascade.add_argument("--rounds", type=int, default=2, help="rounds of cascade then plain (default: 2)")
    _add_output_flags(cascade)
    add_engine_arguments(cascade)

    throughput = bench.add_parser(
        "throughput", help="offline workload: each scheduler against transformers generate",
        description="N requests arrive at once (prompts cut from --text, greedy, fixed seed). kvstrata runs them "
                    "under each of --schedulers, Hugging Face transformers with generate in left-padded static "
                    "batches of --hf-batch-size on the same weights. Reports tokens/s, TTFT / TPOT / end-to-end "
                    "percentiles, peak memory, and the ratios (`speedup_vs_transformers`, sarathi vs the others).",
    )
    throughput.add_argument("--requests", type=int, default=32, help="number of requests (default: 32)")
    throughput.add_argument("--prompt-len", default="256",
                            help="N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA:LOW:HIGH tokens (default: 256)")
    throughput.add_argument("--output-len", default="128",
                            help="N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA:LOW:HIGH tokens (default: 128)")
    throughput.add_argument("--schedulers", default="sarathi,prefill-first,static", help="comma-separated")
    throughput.add_argument("--hf-batch-size", type=int, default=None, help="transformers batch (default: all)")
    throughput.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    throughput.add_argument("--seed", type=int, default=0)
    _add_output_flags(throughput, plot=True)
    add_engine_arguments(throughput)

    sarathi = bench.add_parser(
        "sarathi", help="the SARATHI paper's experiments on this machine",
        description="per_token_cost (Fig. 3), piggyback (Table 2, marginal-time method), pd_sweep (Fig. 9, batch "
                    "capped by the KV budget, sarathi chunk sizes vs prefill-first and static) and chunk_overhead "
                    "(Fig. 13). --only runs a subset.",
    )
    sarathi.add_argument("--only", default="per_token_cost,piggyback,pd_sweep,chunk_overhead")
    sarathi.add_argument("--batches", default="1,2,4,8,16,32", help="per_token_cost batch sizes")
    sarathi.add_argument("--prompt-len", type=int, default=256, help="per_token_cost prompt length (default: 256)")
    sarathi.add_argument("--context", type=int, default=256, help="decode context of per_token_cost / piggyback")
    sarathi.add_argument("--chunk", type=int, default=256, help="piggyback token count C (default: 256)")
    sarathi.add_argument("--decodes", default="1,3,7,15", help="piggyback decode counts")
    sarathi.add_argument("--seq-len", type=int, default=256, help="pd_sweep prompt + output length (default: 256)")
    sarathi.add_argument("--batch", type=int, default=8, help="pd_sweep batch the KV budget holds (default: 8)")
    sarathi.add_argument("--requests", type=int, default=16, help="pd_sweep requests per run (default: 16)")
    sarathi.add_argument("--ratios", default="1,3,7,15,31", help="pd_sweep prefill:decode ratios")
    sarathi.add_argument("--chunks", default="64,128,256", help="pd_sweep sarathi chunk sizes")
    sarathi.add_argument("--overhead-prompt-len", type=int, default=1024, help="chunk_overhead prompt length")
    sarathi.add_argument("--overhead-chunks", default="64,128,256,512,1024", help="chunk_overhead chunk sizes")
    _add_output_flags(sarathi, plot=True)
    add_engine_arguments(sarathi)
    _add_infinigen_commands(bench)
    _add_impress_commands(bench)


def _add_infinigen_commands(bench) -> None:
    analysis = bench.add_parser(
        "infinigen-analysis", help="InfiniGen's analyses: layer similarity, skew, speculation recall",
        description="One prefill of --context tokens of --text, captured layer by layer: the cosine similarity of "
                    "each layer's input with the previous layer's input, attention output and FFN output (the "
                    "paper's Table 1); the share of column energy in the top partial-ratio channels before and after "
                    "the skew; and for --num-queries positions in the second half, per layer, the share of the true "
                    "attention mass held by the tokens speculated one layer ahead (with the engine's --infinigen-* "
                    "settings), with and without the skew and against an oracle speculating from the layer's own "
                    "input (Fig. 13).",
    )
    analysis.add_argument("--context", type=int, default=2048, help="tokens of text (default: 2048)")
    analysis.add_argument("--skip-tokens", type=int, default=0, help="tokens of the text skipped first (default: 0)")
    analysis.add_argument("--num-queries", type=int, default=64, help="query positions scored (default: 64)")
    _add_output_flags(analysis)
    add_engine_arguments(analysis)

    offload = bench.add_parser(
        "offload", help="decode speed with the KV in a host pool: full vs infinigen vs none",
        description="For each --contexts length one prefill of --text gives real K/V; each of --batches sequences "
                    "starts from it as preloaded KV and decodes --steps tokens under --kv-offload none, full and "
                    "infinigen (the other engine options as given). Reports measured tokens/s (median step), the "
                    "fraction of the KV fetched, bytes moved, and the step modeled over PCIe 3 and 4 (measured copy "
                    "time replaced by the link model's).",
    )
    offload.add_argument("--contexts", default="512,1024,2048,4096,7936",
                         help="context lengths, comma-separated; each plus --steps + 1 within max_model_len")
    offload.add_argument("--batches", default="1,4,8,16", help="batch sizes (comma-separated)")
    offload.add_argument("--steps", type=int, default=8, help="decode steps timed per run (default: 8)")
    offload.add_argument("--rounds", type=int, default=1,
                         help="rounds of the three modes per cell, each in another order; ratios are each round's "
                              "and their medians (default: 1)")
    offload.add_argument("--skip-tokens", type=int, default=0, help="tokens of the text skipped first (default: 0)")
    _add_output_flags(offload)
    add_engine_arguments(offload)


def _add_impress_commands(bench) -> None:
    analysis = bench.add_parser(
        "impress-analysis", help="IMPRESS's observations: heads' agreement on important prefix tokens, fallbacks",
        description="A prefix of --prefix tokens of --text followed, one at a time, by --questions questions (a "
                    "passage of --quote-tokens tokens quoted from after the prefix, inside a fixed instruction), "
                    "each prefilled and captured layer by layer. Per layer and --ratios r: the mean pairwise "
                    "Jaccard similarity of the probe heads' (the query heads of KV head 0) and of all heads' top "
                    "r*n prefix tokens by H2O score, against the random value r/(2-r) (the paper's O1/O2); the "
                    "share of layers falling back to a full read per alpha and per number of probe heads; and the "
                    "share of each head's prefix attention mass the probes' shared set holds. Then, over "
                    "--quality-windows windows of a prefix and the text after it, what reading only the chosen "
                    "tokens costs: the first --prompt-tokens new tokens choose each layer's prefix tokens (IMPRESS "
                    "at alpha 0.6 with each of --rules, and keys-only H2O) and the perplexity of the --scored-tokens "
                    "after them is compared with reading the whole prefix.",
    )
    analysis.add_argument("--prefix", type=int, default=2048, help="prefix tokens (default: 2048)")
    analysis.add_argument("--questions", type=int, default=8, help="questions per prefix (default: 8)")
    analysis.add_argument("--quote-tokens", type=int, default=48, help="tokens quoted per question (default: 48)")
    analysis.add_argument("--ratios", default="0.05,0.1,0.25,0.5", help="important-token ratios (comma-separated)")
    analysis.add_argument("--skip-tokens", type=int, default=0, help="tokens of the text skipped first (default: 0)")
    analysis.add_argument("--quality-windows", type=int, default=4, help="windows of the quality part (0: skip it)")
    analysis.add_argument("--prompt-tokens", type=int, default=64, help="new tokens that choose (default: 64)")
    analysis.add_argument("--scored-tokens", type=int, default=512, help="tokens scored after them (default: 512)")
    analysis.add_argument("--rules", default="vote,union",
                          help="IMPRESS's shared-set rules in the quality part: vote, union, first (comma-separated)")
    _add_output_flags(analysis)
    add_engine_arguments(analysis)


def run_bench(args: argparse.Namespace) -> None:
    from kvstrata.bench.beam_search import run_beam_search_bench
    from kvstrata.bench.cascade import run_cascade_bench
    from kvstrata.bench.embed import run_embed_bench
    from kvstrata.bench.impress_analysis import run_impress_analysis
    from kvstrata.bench.infinigen_analysis import run_infinigen_analysis
    from kvstrata.bench.lora import run_lora_bench
    from kvstrata.bench.lpm import run_lpm_bench
    from kvstrata.bench.offload import run_offload
    from kvstrata.bench.priority import run_priority_bench
    from kvstrata.bench.run import run_decode, run_roofline, run_sarathi, run_throughput
    from kvstrata.bench.serve import run_bench_serve
    from kvstrata.bench.speculative import run_speculative_bench

    commands = {"serve": run_bench_serve, "roofline": run_roofline, "throughput": run_throughput, "sarathi": run_sarathi,
                "decode": run_decode, "infinigen-analysis": run_infinigen_analysis,
                "offload": run_offload, "impress-analysis": run_impress_analysis,
                "beam-search": run_beam_search_bench, "speculative": run_speculative_bench, "lora": run_lora_bench,
                "priority": run_priority_bench, "embed": run_embed_bench, "lpm": run_lpm_bench,
                "cascade": run_cascade_bench}
    commands[args.bench](args)

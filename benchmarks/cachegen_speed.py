"""CacheGen encode and decode speed on 2 cores, against prefilling the same text; resume TTFT.

    .venv/bin/python -m benchmarks.cachegen_speed > benchmarks/results/cachegen_speed.json

Per level, for one 1,536-token chunk of Emma: encode and decode time (best of 3), as MB/s of the
fp16-equivalent KV and tokens/s, against recomputing the chunk from text (the second chunk of a
3,072-token context, prefilled on top of the first). Then time to first token of a question after
the 3,072-token context: prefilled from text, and resumed from a saved file at each level (measured
locally: read + decode + place + question prefill). Over 1, 3 and 10 Gbps links the transfer time
is modeled as bytes / bandwidth and added to the measured decode and question times.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from benchmarks.cachegen_common import Window
from kvstrata.bench.report import engine_info, machine_info, sig
from kvstrata.cachegen.codec import decode_tensor, encode_tensor
from kvstrata.cachegen.levels import LEVELS, settings_for
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.llm import LLM

CHUNK = 1536
REPEATS = 3
LINKS_GBPS = (1, 3, 10)
SPEED_LEVELS = (*LEVELS, "uniform8", "uniform8-ac", "uniform4-ac")
QUESTION = " Who was the last person mentioned, and what did they want?"


def best_of(fn, repeats: int = REPEATS):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def codec_speed(window: Window, level: str) -> dict:
    settings = settings_for(level)
    chunk = {name: x[:, CHUNK : 2 * CHUNK].reshape(x.shape[0], CHUNK, -1) for name, x in (("k", window.k), ("v", window.v))}
    encode_s, sections = best_of(lambda: {n: encode_tensor(x, settings, n) for n, x in chunk.items()})
    decode_s, _ = best_of(lambda: [decode_tensor(sections[n], settings, tuple(x.shape), n) for n, x in chunk.items()])
    fp16_bytes = 2 * sum(x.numel() for x in chunk.values())
    size = sum(len(d) for s in sections.values() for d in s.values())
    return {"bytes": size, "encode_s": sig(encode_s), "decode_s": sig(decode_s),
            "encode_mb_per_s": sig(fp16_bytes / encode_s / 1e6), "decode_mb_per_s": sig(fp16_bytes / decode_s / 1e6),
            "encode_tokens_per_s": sig(CHUNK / encode_s), "decode_tokens_per_s": sig(CHUNK / decode_s)}


def main() -> None:
    llm = LLM(threads=2, enable_prefix_caching=False)
    engine = llm.engine
    window = Window(engine, "emma")
    context = window.token_ids[: 2 * CHUNK]
    first_s, _ = best_of(lambda: compute_kv(engine, context[:CHUNK]), 2)
    both_s, _ = best_of(lambda: compute_kv(engine, context), 2)
    recompute_s = both_s - first_s  # the second chunk, attending to the first
    speed = {level: codec_speed(window, level) for level in SPEED_LEVELS}
    for row in speed.values():
        row["decode_speedup_vs_recompute"] = sig(recompute_s / row["decode_s"])

    question = engine.tokenize(QUESTION)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(**context_args) -> float:
        """The whole one-token call: for a saved context it includes reading and decoding the file."""
        prompt = question if context_args else context + question
        return best_of(lambda: llm.generate(prompt, one_token, **context_args), 2)[0]

    text_ttft = ttft()
    resume = {}
    with tempfile.TemporaryDirectory() as directory:
        for level in SPEED_LEVELS:
            path = Path(directory) / f"{level}.kv"
            report = llm.save_context(context, path, levels=[level], chunk_tokens=CHUNK)
            local = ttft(context=path)  # read from local disk, decoded, placed, question prefilled
            modeled = {gbps: report.bytes * 8 / (gbps * 1e9) + local for gbps in LINKS_GBPS}
            resume[level] = {
                "bytes": report.bytes, "ttft_local_s": sig(local), "speedup_local": sig(text_ttft / local),
                "modeled": {f"{gbps}gbps": {"ttft_s": sig(t), "speedup_vs_text": sig(text_ttft / t)}
                            for gbps, t in modeled.items()},
            }
    print(json.dumps({
        "machine": machine_info(), "engine": engine_info(engine),
        "workload": {"chunk_tokens": CHUNK, "context_tokens": len(context), "question_tokens": len(question)},
        "recompute_chunk_s": sig(recompute_s), "prefill_first_chunk_s": sig(first_s),
        "codec": speed, "ttft_text_prefill_s": sig(text_ttft), "resume": resume,
        "note": "modeled = bytes / link bandwidth + the measured local resume time (text transfer taken as free)",
    }, indent=2))


if __name__ == "__main__":
    main()

"""llama.cpp's greedy decode, timed in a process of its own (`kvstrata bench decode` runs one per round).

    python -m kvstrata.bench.llama_cpp_child '{"gguf": PATH, "prompt": [...], "steps": N, "threads": T}'

prints {"seconds": median seconds per decode step, "tokens": the greedy tokens}. A process apart: run in the
engine's process after the engine's own steps, llama-cpp-python 0.3.16 stopped in its decode with an illegal
instruction (its first decodes there ran), and apart the two share no thread pool either.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time


def decode(gguf: str, prompt: list[int], steps: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + steps + 16,
                verbose=False)
    tokens, stamps = [], []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == steps + 1:
            break
    return {"seconds": statistics.median(b - a for a, b in itertools.pairwise(stamps)), "tokens": tokens}


if __name__ == "__main__":
    print(json.dumps(decode(**json.loads(sys.argv[1]))))

"""`eval ppl`'s perplexity on a 2,048-token Emma window beside transformers' on the same tokens.

    .venv/bin/python -m benchmarks.ppl_vs_transformers --context-len 1024 --score-len 1024

kvstrata prefills the context and scores the rest in decode mode through its KV cache;
transformers scores the same tokens with one full forward over the window. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from kvstrata.bench.report import machine_info
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.eval.perplexity import evaluate_perplexity
from kvstrata.model.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--score-len", type=int, default=1024)
    parser.add_argument("--start", default="CHAPTER II", help="the window starts at this text")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig())
    text = EMMA.read_text()
    window = args.context_len + args.score_len
    ids = engine.tokenize(text[text.index(args.start):])[:window]
    ours = evaluate_perplexity(engine, ids, args.context_len, args.score_len, windows=1)

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, args.context_len - 1 : window - 1].float()
    reference = math.exp(F.cross_entropy(logits, torch.tensor(ids[args.context_len:])).item())
    print(json.dumps({
        "benchmark": "ppl_vs_transformers",
        "machine": machine_info(),
        "model": engine.loaded.name,
        "workload": {**vars(args), "window_tokens": window},
        "perplexity": ours["perplexity"],
        "transformers_perplexity": round(reference, 4),
        "relative_difference": round(ours["perplexity"] / reference - 1, 6),
        "segments": ours["segments"],
    }, indent=2))


if __name__ == "__main__":
    main()

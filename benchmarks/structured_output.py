"""Structured output on the default model (docs/BENCHMARKS.md, "Structured output"):

    python -m benchmarks.structured_output > benchmarks/results/structured_output.json

Passages of four texts (Persuasion, the Python tutorial, KJV Acts, Emma), each given with a request to describe it
as JSON that follows a schema, which the prompt spells out, as a user would. The same prompts run as one batch
four ways on one engine: unconstrained (the baseline), held to any JSON object, held to the schema, and held to
the schema with no whitespace between JSON's tokens (vLLM's disable_any_whitespace).

Per way: the share of outputs that parse as JSON, as they are and after taking off a Markdown code fence (what a
user would try next), the share that follow the schema (jsonschema), how many ran out of tokens, and output tokens
per second with its ratio to the unconstrained run's (from each way's quickest of `--rounds` runs; the ways'
outputs differ in length, so their batches shrink differently). What a constraint costs per token is measured
apart: each constrained output's tokens replayed through a fresh matcher, the mask before each token and the
token's consumption timed, against the unconstrained run's seconds per output token.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jsonschema

from kvstrata.bench.report import machine_info
from kvstrata.data import EMMA
from kvstrata.engine.grammar_matcher import allowed_tokens
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.llm import LLM

DATA = Path(__file__).parent / "data"
TEXTS = {"persuasion": DATA / "persuasion.txt", "python_tutorial": DATA / "python_tutorial.txt",
         "kjv_acts": DATA / "kjv_acts.txt", "emma": EMMA}
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "names": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "has_dialogue": {"type": "boolean"},
    },
    "required": ["topic", "names", "has_dialogue"],
    "additionalProperties": False,
}
INSTRUCTION = ("Describe the passage above as a JSON object with exactly these keys: \"topic\" (a short string), "
               "\"names\" (a list of at most five names of people or things it mentions) and \"has_dialogue\" "
               "(true or false). Answer with the JSON object only.")
FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def passages(llm: LLM, per_text: int, tokens: int) -> list[str]:
    """`per_text` windows of about `tokens` tokens from each text, spread over it."""
    result = []
    for path in TEXTS.values():
        text = path.read_text(encoding="utf-8")
        for index in range(per_text):
            start = 10_000 + index * (len(text) - 20_000) // per_text
            token_ids = llm.engine.tokenize(text[start: start + 8 * tokens])[:tokens]
            result.append(llm.engine.tokenizer.decode(token_ids))
    return result


def parses(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def follows_schema(value: object) -> bool:
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def run(llm: LLM, prompts: list[str], constraint: StructuredOutput | None, max_tokens: int, rounds: int) -> dict:
    """One way, `rounds` times (greedy: the same outputs each time); its speed from its quickest round."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=constraint)
    round_seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        round_seconds.append(time.perf_counter() - start)
    seconds = min(round_seconds)
    as_is = [parses(o.text) for o in outputs]
    unfenced = [parses(FENCE.sub(r"\1", o.text)) for o in outputs]
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "parses_share": sum(v is not None for v in as_is) / len(outputs),
        "parses_after_unfencing_share": sum(v is not None for v in unfenced) / len(outputs),
        "follows_schema_share": sum(follows_schema(v) for v in as_is) / len(outputs),
        "follows_schema_after_unfencing_share": sum(follows_schema(v) for v in unfenced) / len(outputs),
        "ran_out_of_tokens": sum(o.finish_reason == "length" for o in outputs),
        "errors": sum(o.finish_reason == "error" for o in outputs),
        "output_tokens": tokens,
        "seconds": seconds,
        "seconds_per_round": round_seconds,
        "output_tokens_per_s": tokens / seconds,
        "examples": [o.text for o in outputs[:: max(1, len(outputs) // 4)]],
        "token_ids": [o.token_ids for o in outputs],
    }


def constraint_seconds_per_token(llm: LLM, constraint: StructuredOutput, outputs: list[list[int]]) -> float:
    """The mask and the consumption of each token of `outputs`, replayed through fresh matchers, per token."""
    vocab = llm.engine.model_config.vocab_size
    start, tokens = time.perf_counter(), 0
    for token_ids in outputs:
        matcher = llm.engine.grammars.matcher(constraint)
        for token in token_ids:
            allowed_tokens(matcher, vocab)
            matcher.consume_token(token)
            tokens += 1
    return (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-text", type=int, default=4, help="passages per text")
    parser.add_argument("--passage-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=160, help="output tokens per request at most")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way; its speed is its quickest")
    args = parser.parse_args()
    llm = LLM(kv_cache_memory="512MiB", max_model_len=2048)
    prompts = [llm.chat_prompt([{"role": "user", "content": f"{passage}\n\n{INSTRUCTION}"}])
               for passage in passages(llm, args.per_text, args.passage_tokens)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up, not scored
    ways = {"unconstrained": None, "json_object": StructuredOutput(json_object=True),
            "json_schema": StructuredOutput(json=SCHEMA),
            "json_schema_compact": StructuredOutput(json=SCHEMA, any_whitespace=False)}
    runs = {name: run(llm, prompts, constraint, args.max_tokens, args.rounds) for name, constraint in ways.items()}
    unconstrained_speed = runs["unconstrained"]["output_tokens_per_s"]
    for name, row in runs.items():
        row["output_tokens_per_s_vs_unconstrained"] = row["output_tokens_per_s"] / unconstrained_speed
        if ways[name] is not None:
            per_token = constraint_seconds_per_token(llm, ways[name], row["token_ids"])
            row["constraint_us_per_token"] = per_token * 1e6
            row["constraint_share_of_unconstrained_seconds_per_token"] = per_token * unconstrained_speed
        del row["token_ids"]
    print(json.dumps({"machine": machine_info(), "model": "default (SmolLM2-135M-Instruct, GGUF)",
                      "requests": len(prompts), "texts": list(TEXTS), "passage_tokens": args.passage_tokens,
                      "max_tokens": args.max_tokens, "decoding": "greedy, one batch per way", "schema": SCHEMA,
                      "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

"""`kvstrata eval needle`: passkey retrieval from a long haystack of text.

A five-digit pass key is stated once at a given depth of a haystack cut from a text; the prompt
ends by asking for it, and the greedy answer is right if its first number is exactly the key.
"""

from __future__ import annotations

import random
import re

from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.eval.agreement import greedy_continuations

INTRO = "There is a pass key hidden in the following text. Find it and remember it.\n\n"
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


def needle_prompt(engine: LLMEngine, haystack: list[int], length: int, depth: float, key: str) -> list[int]:
    """A prompt of exactly `length` tokens with the needle at fraction `depth` of the haystack."""
    intro, needle, question = (engine.tokenize(t) for t in (INTRO, NEEDLE.format(key=key), QUESTION))
    room = length - len(intro) - len(needle) - len(question)
    if room < 1 or room > len(haystack):
        raise KvstrataError(f"cannot build a {length}-token needle prompt from a haystack of {len(haystack)} tokens")
    at = round(depth * room)
    return intro + haystack[:at] + needle + haystack[at:room] + question


def evaluate_needle(engine: LLMEngine, text: str, lengths: list[int], depths: list[float], trials: int,
                    seed: int) -> dict:
    haystack = engine.tokenize(text)
    rng = random.Random(seed)
    cases, prompts = [], []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                key = str(rng.randrange(10_000, 100_000))
                offset = rng.randrange(max(1, len(haystack) - length))
                prompts.append(needle_prompt(engine, haystack[offset:], length, depth, key))
                cases.append({"length": length, "depth": depth, "trial": trial, "key": key})
    answers = greedy_continuations(engine, prompts, ANSWER_TOKENS)
    cells: dict[tuple[int, float], list[bool]] = {}
    for case, answer in zip(cases, answers):
        text_answer = engine.tokenizer.decode(answer)
        found = re.search(r"\d+", text_answer)
        case["answer"] = text_answer
        case["correct"] = bool(found) and found.group() == case["key"]
        cells.setdefault((case["length"], case["depth"]), []).append(case["correct"])
    grid = [
        {"length": length, "depth": depth, "accuracy": round(sum(hits) / len(hits), 4)}
        for (length, depth), hits in cells.items()
    ]
    return {
        "accuracy": round(sum(c["correct"] for c in cases) / len(cases), 4),
        "grid": grid,
        "cases": cases,
    }

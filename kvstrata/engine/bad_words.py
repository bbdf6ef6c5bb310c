"""vLLM's `bad_words`: words the output may not hold. A word is banned as its tokens, where it begins the text and
where it follows a space (as " word", which a byte-level BPE tokenizes apart), and the token that would complete
one is banned wherever the output ends with the rest of it."""

from __future__ import annotations

from kvstrata.model.tokenizer import Tokenizer


def bad_word_token_ids(tokenizer: Tokenizer, words: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Each word's tokens, and those of its spaced form where that is a word of as many tokens of its own (a word
    of text no token holds is no tokens, and bans nothing)."""
    sequences = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences += [bare] if bare else []
        if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences


def banned_next_tokens(sequences: list[tuple[int, ...]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word after `output` (the output's tokens so far)."""
    return [tokens[-1] for tokens in sequences
            if len(tokens) == 1 or tuple(output[len(output) - len(tokens) + 1 :]) == tokens[:-1]]

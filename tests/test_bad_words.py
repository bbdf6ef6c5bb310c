"""vLLM's bad_words: the token that would complete a bad word is banned, where the word begins the text and after a
space alike, beside requests without any; what could ban every token is refused."""

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.engine.bad_words import bad_word_token_ids
from kvstrata.engine.penalties import Histories, penalized_logits
from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.errors import ParameterError


def test_the_token_that_would_complete_a_bad_word_is_banned():
    logits = torch.zeros(2, 6)
    # row 0's output is [3, 4]: (2,) is banned anywhere, (3, 4, 1) now ends with 1, (4, 5) with 5; (5, 4) has not
    # begun (5 is the prompt's)
    histories = Histories(token_ids=[[5, 3, 4], [5, 3, 4]], num_prompt=[1, 1], eos_token_ids={0},
                          bad_words=[[(2,), (3, 4, 1), (4, 5), (5, 4)], []])
    out = penalized_logits(logits, [SamplingParams(), SamplingParams()], histories)
    assert torch.isinf(out[0, [1, 2, 5]]).all() and torch.isfinite(out[0, [0, 3, 4]]).all()
    assert torch.equal(out[1], logits[1])  # a row without bad words is as it was


@pytest.mark.real_model
def test_a_bad_word_is_not_written_and_the_requests_beside_it_are_as_they_were():
    llm = LLM(kv_cache_memory="64MiB", max_model_len=512)
    assert len(bad_word_token_ids(llm.tokenizer, ["Paris"])) == 2  # "Paris" and " Paris" are tokens apart
    greedy = {"max_tokens": 12, "temperature": 0}
    prompts = ["The capital of France is", "Emma Woodhouse, handsome, clever, and rich, with a comfortable home"]
    plain = [out.text for out in llm.generate(prompts, SamplingParams(**greedy))]
    assert plain[0].startswith(" Paris") and plain[1].startswith(" and a loving family")
    banned = llm.generate(prompts * 2, [SamplingParams(**greedy, bad_words=["Paris"]),
                                        SamplingParams(**greedy, bad_words=["loving family"]),
                                        SamplingParams(**greedy), SamplingParams(**greedy)])
    assert "Paris" not in banned[0].text
    # a word of several tokens: only the one that would complete it is banned, so it may begin
    assert banned[1].text.startswith(" and a loving") and "loving family" not in banned[1].text
    assert [out.text for out in banned[2:]] == plain


def test_what_could_ban_every_token_is_refused(tiny_llama):
    with pytest.raises(ParameterError, match="bad_words must be a list of words"):
        SamplingParams(bad_words=["Emma", "  "])
    with pytest.raises(ParameterError, match="bad_words has 1025 words; at most 1024"):
        SamplingParams(bad_words=["Emma"] * 1025)
    with pytest.raises(ParameterError, match="bad_words cannot be combined with structured output"):
        SamplingParams(bad_words=["Emma"], structured_output=StructuredOutput(regex="[a-z]+"))
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    words = ("Emma", "Harriet")
    last_tokens = sorted({tokens[-1] for tokens in bad_word_token_ids(llm.tokenizer, words)})
    with pytest.raises(ParameterError, match="bad_words could ban every token of allowed_token_ids at once"):
        llm.engine.add_request([5, 6], SamplingParams(bad_words=list(words), allowed_token_ids=last_tokens))
    # a token no bad word ends with is always left, as is one where only the ends of words of several tokens are
    # allowed: those are banned only after the rest of their word
    allowed = [*last_tokens, 3]
    out = llm.generate([[5, 6]], SamplingParams(bad_words=list(words), allowed_token_ids=allowed, max_tokens=4))
    assert set(out[0].token_ids) <= set(allowed)


WORD_TOKENS = {"Bath": [7], " Bath": [8], "Bath Spa": [7, 9], " Bath Spa": [8, 9], "Bathwick": [7, 10],
               " Bathwick": [11]}


class Vocabulary:
    """A tokenizer of a few words, with no token for "é"."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return WORD_TOKENS.get(text, [])


def test_a_word_is_banned_bare_and_after_a_space_where_that_is_a_word_of_its_own():
    # " Bath Spa" is taken as "Bath Spa"; " Bathwick" is one token where "Bathwick" is two: not the same word
    # split alike, so only the bare form is banned (vLLM's rule); "é" is no tokens and bans nothing
    assert bad_word_token_ids(Vocabulary(), ("é", "Bath", " Bath Spa", "Bathwick")) == [
        (7,), (8,), (7, 9), (8, 9), (7, 10)]

"""Tags a model writes in its text (<think>, <tool_call>) found while the text still grows."""

from __future__ import annotations


def less_a_tag_begun(text: str, tag: str) -> str:
    """`text` without its end where that end may be the beginning of `tag`, which the next tokens could complete:
    what of a growing text is certainly not that tag."""
    for held in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-held:]):
            return text[:-held]
    return text

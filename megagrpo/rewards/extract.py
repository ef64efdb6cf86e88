"""Pull the final answer out of a completion: a strict answer tag, a \\boxed{...}, or the last number."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the LAST <tag>...</tag> (the final answer wins over drafts); None when absent."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.S)
    return matches[-1].strip() if matches else None


def strict_answer(text: str, tag: str = "answer", allow_unclosed: bool = False) -> str | None:
    """Content when the completion is exactly one <tag>...</tag> and nothing else but whitespace.

    `allow_unclosed` accepts a missing closing tag at the very end: SGLang trims a stop string such as
    "</answer>" from the text it returns.
    """
    close = f"(?:</{re.escape(tag)}>)?" if allow_unclosed else f"</{re.escape(tag)}>"
    m = re.fullmatch(rf"\s*<{re.escape(tag)}>([^<>]*?){close}\s*", text)
    return m.group(1).strip() if m else None


def boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced; None when absent or unbalanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def last_number(text: str) -> str | None:
    """The last integer or decimal in the text (commas between digit groups removed first)."""
    found = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return found[-1] if found else None


EXTRACTORS = {"answer_tag": answer_tag, "strict": strict_answer, "boxed": boxed, "last_number": last_number}


def extract(text: str, how: str) -> str | None:
    """Apply the named extractor ('none' returns the stripped text)."""
    if how == "none":
        return text.strip()
    if how not in EXTRACTORS:
        raise ValueError(f"extract: unknown extractor {how!r}; choose one of none, {', '.join(EXTRACTORS)}")
    return EXTRACTORS[how](text)

"""What is wrong with a state or a question's text, said with where it is (only asked once encoding failed).

The tokenizer and json raise "TextInputSequence must be str" or "Object of type bytes is not JSON
serializable" for bytes and for strings holding lone surrogates (text decoded with errors="surrogateescape",
or cut in the middle of a UTF-16 pair). These find the first such value and name its place, so the error
says what to fix. They run only after encoding has failed, so the common path pays nothing.
"""
from __future__ import annotations

from typing import Any


def problem(value: Any, where: str, depth: int = 0) -> str | None:
    """The first bytes or non-Unicode text inside `value` (str, bytes, dicts, lists), as a sentence naming it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"{where} is not valid Unicode text: a lone surrogate {value[e.start]!r} at character {e.start} "
                    "(decode bytes with errors='replace', or fix the text's source)")
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{where} is {type(value).__name__}, not text: decode it to str first (e.g. .decode('utf-8'))"
    if depth > 64:
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            p = problem(k, f"{where} key {k!r}", depth + 1) or problem(v, f"{where}[{k!r}]", depth + 1)
            if p:
                return p
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            p = problem(v, f"{where}[{i}]", depth + 1)
            if p:
                return p
    return None


def state_error(state: Any, cause: Exception) -> Exception:
    """The error to raise for a state that could not be serialized or tokenized: TypeError for bytes,
    ValueError for text that is not Unicode, each naming the place; the original error otherwise."""
    p = problem(state, "state")
    if p is None:
        return cause
    return TypeError(p) if " not text" in p else ValueError(p)

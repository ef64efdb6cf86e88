"""Prompt data: local JSONL/Parquet sets, chat templating, held-out split, synthetic tasks, resumable order.

Samples are dicts with the row's fields plus canonical `prompt` (str or chat messages), `answer`,
`completion` or a tool-use `trace` (SFT) and `_source` ("file:line" or "synthetic:task:split:i").
"""

from megagrpo.data.iterator import PromptIterator, fingerprint
from megagrpo.data.sets import PromptSets, build_prompt_sets
from megagrpo.data.sources import LoadReport, RowError, read_rows, validate_row
from megagrpo.data.synthetic import addition_problem, countdown_problem, generate
from megagrpo.data.template import Prompt, PromptFormatter

__all__ = [
    "LoadReport",
    "Prompt",
    "PromptFormatter",
    "PromptIterator",
    "PromptSets",
    "RowError",
    "addition_problem",
    "build_prompt_sets",
    "countdown_problem",
    "fingerprint",
    "generate",
    "read_rows",
    "validate_row",
]

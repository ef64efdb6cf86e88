"""Read prompt rows from local JSONL/Parquet files, validating each row and naming bad ones by file:line.

JSONL is parsed line by line here (a malformed line must be reported with its number, which a bulk
loader cannot do); Parquet goes through `datasets` (local file, no hub access) and rows are numbered
from 1. Every kept row becomes a sample dict: the original fields, plus the canonical `prompt`,
`answer` / `completion`, and `_source` ("file:line").
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagrpo.config.schema import DataConfig
from megagrpo.errors import MegagrpoError

log = logging.getLogger("megagrpo.data")

_MAX_LOGGED = 10  # malformed rows logged one by one; the rest are counted


@dataclass
class LoadReport:
    """What loading saw: rows kept, and malformed rows by reason (every one counted)."""

    kept: int = 0
    malformed: int = 0
    examples: list[str] = field(default_factory=list)  # "file:line: reason" of the first malformed rows


class RowError(ValueError):
    """A row is malformed; the message says why (without its location)."""


def validate_row(row: Any, cfg: DataConfig, required: tuple[str, ...]) -> dict:
    """Check one raw row and return the canonical sample; raise RowError naming the problem.

    `required` lists canonical fields ('prompt', 'answer', 'completion') the caller needs.
    """
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    keys = {"prompt": cfg.prompt_key, "answer": cfg.answer_key, "completion": cfg.completion_key}
    sample = dict(row)
    for canon in required:
        key = keys[canon]
        if key not in row or row[key] is None:
            raise RowError(f"missing field {key!r} (data.{canon}_key)")
        sample[canon] = row[key]
    prompt = sample.get("prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowError(f"field {cfg.prompt_key!r} is empty")
    elif isinstance(prompt, list):
        if not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        ):
            raise RowError(
                f"field {cfg.prompt_key!r} must be a string or a non-empty list of {{role, content}} messages"
            )
    elif "prompt" in required:
        raise RowError(
            f"field {cfg.prompt_key!r} must be a string or a list of messages, got {type(prompt).__name__}"
        )
    if "completion" in required and not isinstance(sample["completion"], str):
        raise RowError(f"field {cfg.completion_key!r} must be a string")
    if "answer" in required and isinstance(sample["answer"], dict | list):
        raise RowError(f"field {cfg.answer_key!r} must be a scalar, got {type(sample['answer']).__name__}")
    return sample


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    # Bytes, decoded line by line: one non-UTF-8 byte is then one malformed row, where a text-mode
    # reader would raise UnicodeDecodeError mid-file and lose every row. Splitting on b"\n" is safe
    # because no multi-byte UTF-8 sequence contains that byte.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                # utf-8-sig on the first line drops a byte-order mark that some editors write
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                reason = (
                    f"not valid UTF-8 (byte 0x{raw[e.start : e.start + 1].hex()} at byte {e.start + 1} "
                    "of the line); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                )
                yield lineno, None, reason
                continue
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                yield lineno, json.loads(line), None
            except json.JSONDecodeError as e:
                yield lineno, None, f"invalid JSON ({e.msg} at column {e.colno})"


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    import pyarrow.parquet as pq

    try:
        # An in-memory Arrow table: `Dataset.from_parquet` would run a builder that writes a cache copy
        # under ~/.cache and prints progress bars, for a file that is already columnar on disk.
        ds = datasets.Dataset(pq.read_table(path))
    except Exception as e:
        raise MegagrpoError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from None
    for i, row in enumerate(ds, start=1):
        yield i, row, None


def read_rows(
    path: str | Path,
    cfg: DataConfig,
    required: tuple[str, ...] = ("prompt", "answer"),
    check: Callable[[dict], None] | None = None,
    field_name: str = "data.train_path",
) -> tuple[list[dict], LoadReport]:
    """Load and validate every row of a .jsonl/.parquet file.

    `check(sample)` may raise RowError for further per-row rules (e.g. prompt too long after templating).
    Malformed rows are logged as `file:line: reason`, then skipped and counted, or raise MegagrpoError
    when `cfg.malformed == 'fatal'`.
    """
    p = Path(path)
    if not p.is_file():
        raise MegagrpoError(f"{field_name}: {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(p)
    elif suffix == ".parquet":
        rows = _parquet_rows(p)
    else:
        raise MegagrpoError(f"{field_name}: {str(p)!r} has an unsupported extension; use .jsonl or .parquet")
    out, report = [], LoadReport()
    for lineno, raw, parse_error in rows:
        where = f"{p}:{lineno}"
        try:
            if parse_error is not None:
                raise RowError(parse_error)
            sample = validate_row(raw, cfg, required)
            if check is not None:
                check(sample)
        except RowError as e:
            if cfg.malformed == "fatal":
                raise MegagrpoError(
                    f"{where}: malformed row: {e}; fix the row or set data.malformed=skip to skip such rows"
                ) from None
            report.malformed += 1
            if report.malformed <= _MAX_LOGGED:
                report.examples.append(f"{where}: {e}")
                log.warning("%s: malformed row skipped: %s", where, e)
            continue
        sample["_source"] = where
        out.append(sample)
    report.kept = len(out)
    if report.malformed > _MAX_LOGGED:
        log.warning("%s: %d malformed rows skipped in total", p, report.malformed)
    if not out:
        raise MegagrpoError(f"{field_name}: {str(p)!r} has no valid rows ({report.malformed} malformed)")
    return out, report

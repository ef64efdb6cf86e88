"""Loading JSONL/Parquet prompt sets: malformed rows by file:line, skip vs fatal, held-out split."""

from __future__ import annotations

import json

import pytest

from megagrpo.config import DataConfig
from megagrpo.data import build_prompt_sets, read_rows
from megagrpo.errors import MegagrpoError

GOOD = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]


def write_jsonl(path, rows_or_lines):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows_or_lines]
    path.write_text("\n".join(lines) + "\n")
    return path


def cfg(path, **kw) -> DataConfig:
    return DataConfig.model_validate({"train_path": str(path), **kw})


def test_malformed_rows_are_reported_with_line_numbers_and_skipped(tmp_path, caplog):
    lines = [
        GOOD[0],  # 1
        "{not json",  # 2
        "",  # 3: blank, not a row
        {"prompt": "q", "answer": "1"},  # 4
        {"question": "q", "answer": "1"},  # 5: missing prompt
        {"prompt": "   ", "answer": "1"},  # 6: empty prompt
        [1, 2],  # 7: not an object
        {"prompt": "q"},  # 8: missing answer
        {"prompt": [{"role": "user", "content": "hi"}], "answer": 2},  # 9: chat messages are fine
        {"prompt": [{"role": "user"}], "answer": 2},  # 10: bad message
    ]
    p = write_jsonl(tmp_path / "train.jsonl", lines)
    with caplog.at_level("WARNING", logger="megagrpo.data"):
        rows, report = read_rows(p, cfg(p))
    assert [r["_source"] for r in rows] == [f"{p}:1", f"{p}:4", f"{p}:9"]
    assert report.kept == 3 and report.malformed == 6
    assert report.examples[0].startswith(f"{p}:2: invalid JSON")
    assert f"{p}:5: missing field 'prompt'" in report.examples[1]
    assert f"{p}:6: field 'prompt' is empty" in report.examples[2]
    assert f"{p}:7: expected a JSON object, got list" in report.examples[3]
    assert f"{p}:8: missing field 'answer'" in report.examples[4]
    assert f"{p}:10:" in report.examples[5]
    assert f"{p}:2: malformed row skipped" in caplog.text


def test_fatal_mode_stops_at_the_first_bad_row(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [GOOD[0], GOOD[1], "{oops"])
    with pytest.raises(MegagrpoError, match=r"t.jsonl:3: malformed row: invalid JSON.*data.malformed=skip"):
        read_rows(p, cfg(p, malformed="fatal"))


def test_custom_keys_become_canonical_fields(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [{"question": "2+2?", "solution": 4, "extra": "kept"}])
    rows, _ = read_rows(p, cfg(p, prompt_key="question", answer_key="solution"))
    assert rows[0]["prompt"] == "2+2?" and rows[0]["answer"] == 4 and rows[0]["extra"] == "kept"


def test_parquet_through_datasets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD[0], {"prompt": "", "answer": "x"}, GOOD[2]]), p)
    rows, report = read_rows(p, cfg(p))
    assert [r["prompt"] for r in rows] == ["q0", "q2"] and rows[1]["_source"] == f"{p}:3"
    assert report.malformed == 1 and report.examples[0].startswith(f"{p}:2: field 'prompt' is empty")


def test_unreadable_inputs(tmp_path):
    with pytest.raises(MegagrpoError, match="does not exist"):
        read_rows(tmp_path / "none.jsonl", cfg(tmp_path / "none.jsonl"))
    bad = tmp_path / "t.csv"
    bad.write_text("a,b\n")
    with pytest.raises(MegagrpoError, match="unsupported extension"):
        read_rows(bad, cfg(bad))
    allbad = write_jsonl(tmp_path / "allbad.jsonl", ["{", "["])
    with pytest.raises(MegagrpoError, match="no valid rows"):
        read_rows(allbad, cfg(allbad))
    notpq = tmp_path / "x.parquet"
    notpq.write_text("not parquet")
    with pytest.raises(MegagrpoError, match="cannot read as Parquet"):
        read_rows(notpq, cfg(notpq))


def test_heldout_split_is_fixed_and_disjoint(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", GOOD)
    a = build_prompt_sets(cfg(p, heldout_fraction=0.2))
    b = build_prompt_sets(cfg(p, heldout_fraction=0.2))
    assert len(a.heldout) == 4 and len(a.train) == 16
    assert [r["prompt"] for r in a.heldout] == [r["prompt"] for r in b.heldout]
    assert not {r["prompt"] for r in a.heldout} & {r["prompt"] for r in a.train}
    ev = write_jsonl(tmp_path / "e.jsonl", GOOD[:3])
    c = build_prompt_sets(cfg(p, eval_path=str(ev), max_eval_prompts=2))
    assert len(c.train) == 20 and [r["prompt"] for r in c.heldout] == ["q0", "q1"]
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "q", "completion": "a"}, {"prompt": "q"}])
    d = build_prompt_sets(cfg(sft, heldout_fraction=0.0), purpose="sft")
    assert len(d.train) == 1 and d.malformed == 1


TRACE = [
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>',
    },
    {"role": "tool", "tool_call_id": "call_0_0", "name": "calculator", "content": "6"},
    {"role": "assistant", "content": "<answer>6</answer>"},
]


def test_an_sft_row_with_a_trace_needs_no_completion(tmp_path):
    rows = [
        {"prompt": "q1", "trace": TRACE},  # 1: the trace is the target
        {"prompt": "q2", "answer": "6", "out": "<answer>6</answer>", "trace": TRACE},  # 2: both are kept
        {"prompt": "q3", "out": "<answer>1</answer>"},  # 3: a single-turn row
        {"prompt": "q4", "answer": "6"},  # 4: neither
        {"prompt": "q5", "trace": "6"},  # 5: not a list of messages
        {"prompt": "q6", "trace": None},  # 6: a null trace is no trace
    ]
    p = write_jsonl(tmp_path / "s.jsonl", rows)
    d = build_prompt_sets(cfg(p, completion_key="out", heldout_fraction=0.0), purpose="sft")
    assert [r["_source"] for r in d.train] == [f"{p}:1", f"{p}:2", f"{p}:3"]
    assert "completion" not in d.train[0] and d.train[0]["trace"] == TRACE
    assert (
        d.train[1]["completion"] == "<answer>6</answer>" and d.train[2]["completion"] == "<answer>1</answer>"
    )
    examples = d.reports[str(p)].examples
    assert (
        examples[0]
        == f"{p}:4: missing field 'out' (data.completion_key); an SFT row needs a completion or a tool-use 'trace'"
    )
    assert examples[1].startswith(f"{p}:5: field 'trace' must be a non-empty list")
    assert examples[2].startswith(f"{p}:6: missing field 'out'")
    with pytest.raises(
        MegagrpoError,
        match=r"s.jsonl:4: malformed row: missing field 'out' .*completion or a tool-use 'trace'",
    ):
        build_prompt_sets(cfg(p, completion_key="out", malformed="fatal"), purpose="sft")
    # RL rows still need their answer, with or without a trace
    assert [r["_source"] for r in build_prompt_sets(cfg(p, heldout_fraction=0.0)).train] == [
        f"{p}:2",
        f"{p}:4",
    ]


def _with_latin1_row(path):
    # line 2 holds one latin-1 byte (0xe9, "é"), which is not valid UTF-8
    path.write_bytes(
        json.dumps(GOOD[0]).encode()
        + b"\n"
        + b'{"prompt": "caf\xe9", "answer": "1"}\n'
        + json.dumps(GOOD[1]).encode()
        + b"\n"
    )
    return path


def test_a_non_utf8_byte_is_one_malformed_row(tmp_path):
    p = _with_latin1_row(tmp_path / "t.jsonl")
    rows, report = read_rows(p, cfg(p))
    assert [r["_source"] for r in rows] == [f"{p}:1", f"{p}:3"]
    assert report.kept == 2 and report.malformed == 1
    assert report.examples == [
        f"{p}:2: not valid UTF-8 (byte 0xe9 at byte 16 of the line); "
        "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    ]
    with pytest.raises(
        MegagrpoError, match=r"t.jsonl:2: malformed row: not valid UTF-8 .*re-encode the file"
    ):
        read_rows(p, cfg(p, malformed="fatal"))


def test_a_utf8_byte_order_mark_is_not_a_malformed_row(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(
        b"\xef\xbb\xbf" + json.dumps({"prompt": "é", "answer": "1"}, ensure_ascii=False).encode() + b"\n"
    )
    rows, report = read_rows(p, cfg(p))
    assert [r["prompt"] for r in rows] == ["é"] and report.malformed == 0

"""A data row that the multi-turn environment rejects follows `data.malformed` like any other malformed row
(issue 36, item 9): reported as file:line when the data is loaded, then skipped and counted, or an error;
it no longer stops the run when a step draws it (`AnswerToolEnv.reset` raised then)."""

from __future__ import annotations

import asyncio
import json

import pytest

from megagrpo.config import config_from_dict
from megagrpo.data.sets import build_prompt_sets
from megagrpo.envs.calculator import CalculatorEnv
from megagrpo.errors import MegagrpoError
from megagrpo.trainer.episodes import row_check

ROWS = [
    {"prompt": "p1", "question": "What is 1 + 1?", "answer": "2"},
    {"prompt": "p2", "answer": "4"},  # no "question": the environment cannot start from it
    {"prompt": "p3", "question": "What is 3 + 3?", "answer": "6"},
]


class PickyEnv(CalculatorEnv):
    """An environment of a user's: a row whose question is not a string is rejected."""

    def check_row(self, row):
        super().check_row(row)
        if not isinstance(row["question"], str):
            raise ValueError(f"question must be a string, got {type(row['question']).__name__}")


def _cfg(tmp_path, malformed, environment="calculator", rows=ROWS):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mt = {"enabled": True, "environment": environment, "environment_options": {"question_key": "question"}}
    return config_from_dict(
        {
            "model": {"hf_path": "m"},
            "rollout": {"multi_turn": mt},
            "data": {"train_path": str(path), "heldout_fraction": 0.0, "malformed": malformed},
        }
    ), path


def test_a_row_the_environment_rejects_is_skipped_and_counted(tmp_path):
    cfg, path = _cfg(tmp_path, "skip")
    sets = build_prompt_sets(cfg.data, row_check=row_check(cfg.rollout.multi_turn))
    assert [s["question"] for s in sets.train] == ["What is 1 + 1?", "What is 3 + 3?"]
    assert sets.malformed == 1
    assert sets.reports[str(path)].examples == [
        f"{path}:2: CalculatorEnv: the data row has no 'question' field (it has ['answer', 'prompt']); "
        "set question_key/answer_key in rollout.multi_turn.environment_options"
    ]
    # What the run met before: the environment rejected the row only when a step drew it.
    env = CalculatorEnv(question_key="question")
    with pytest.raises(MegagrpoError, match="has no 'question' field"):
        asyncio.run(env.reset(ROWS[1]))


def test_a_row_the_environment_rejects_is_an_error_naming_file_and_line_when_fatal(tmp_path):
    cfg, path = _cfg(tmp_path, "fatal")
    with pytest.raises(MegagrpoError) as e:
        build_prompt_sets(cfg.data, row_check=row_check(cfg.rollout.multi_turn))
    assert str(e.value).startswith(f"{path}:2: malformed row: CalculatorEnv: the data row has no 'question'")
    assert "set data.malformed=skip" in str(e.value)


def test_a_users_environment_check_counts_too(tmp_path):
    rows = [*ROWS[:1], {"prompt": "p", "question": ["not", "text"], "answer": "1"}, ROWS[2]]
    cfg, path = _cfg(tmp_path, "skip", environment=f"{__name__}:PickyEnv", rows=rows)
    sets = build_prompt_sets(cfg.data, row_check=row_check(cfg.rollout.multi_turn))
    assert sets.malformed == 1 and len(sets.train) == 2
    assert sets.reports[str(path)].examples == [f"{path}:2: question must be a string, got list"]


def test_single_turn_data_is_not_checked_by_an_environment(tmp_path):
    cfg, _ = _cfg(tmp_path, "fatal")
    assert row_check(cfg.rollout.multi_turn.model_copy(update={"enabled": False})) is None
    assert len(build_prompt_sets(cfg.data).train) == 3

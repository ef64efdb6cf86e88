"""Synthetic tasks (determinism, held-out disjointness, verifier agreement) and the resumable iterator."""

from __future__ import annotations

import pytest

from megagrpo.config import SyntheticConfig
from megagrpo.data import PromptIterator, generate
from megagrpo.errors import MegagrpoError
from megagrpo.rewards import arithmetic, countdown


def test_synthetic_generation_is_deterministic_and_seed_dependent():
    c = SyntheticConfig(task="addition", min_digits=2, max_digits=3, num_train=50, num_eval=20, seed=7)
    assert generate(c) == generate(c)
    assert generate(c)[0] != generate(c.model_copy(update={"seed": 8}))[0]
    # pinned: a change to the generator (which would silently change the demo's data and its README
    # numbers) must be deliberate. random.Random with an int seed is stable across platforms.
    train, heldout = generate(c)
    assert [(s["a"], s["b"]) for s in train[:3]] == [(99, 43), (582, 35), (83, 556)]
    assert [(s["a"], s["b"]) for s in heldout[:2]] == [(399, 23), (579, 50)]
    assert train[0]["prompt"] == "What is 99 + 43?" and train[0]["completion"] == "<answer>142</answer>"


@pytest.mark.parametrize("lo, hi", [(1, 2), (2, 3)])
def test_addition_digits_heldout_disjoint_and_verified(lo, hi):
    train, heldout = generate(
        SyntheticConfig(task="addition", min_digits=lo, max_digits=hi, num_train=500, num_eval=100)
    )
    assert len(train) == 500 and len(heldout) == 100
    for s in train + heldout:
        for x in (s["a"], s["b"]):
            assert lo <= len(str(x)) <= hi
        assert int(s["answer"]) == s["a"] + s["b"]
    keys = {(s["a"], s["b"]) for s in heldout}
    assert len(keys) == 100 and not keys & {(s["a"], s["b"]) for s in train}
    verify = arithmetic()
    assert all(verify(s["prompt"], s["completion"], s) == 1.0 for s in train + heldout)
    assert all(verify(s["prompt"], f"<answer>{int(s['answer']) + 1}</answer>", s) == 0.0 for s in heldout)


def test_countdown_problems_are_solvable_by_their_reference():
    train, heldout = generate(
        SyntheticConfig(task="countdown", num_numbers=4, max_number=30, num_train=300, num_eval=50)
    )
    verify = countdown(use_all=True)
    for s in train + heldout:
        assert len(s["numbers"]) == 4 and s["target"] > 0 and all(1 <= n <= 30 for n in s["numbers"])
        assert verify(s["prompt"], s["completion"], s) == 1.0
    assert not {(tuple(sorted(s["numbers"])), s["target"]) for s in heldout} & {
        (tuple(sorted(s["numbers"])), s["target"]) for s in train
    }


def test_too_small_problem_space_is_an_error():
    with pytest.raises(MegagrpoError, match="only 100 distinct addition problems"):
        generate(SyntheticConfig(task="addition", min_digits=1, max_digits=1, num_train=10, num_eval=101))


ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]


def test_iterator_covers_each_epoch_and_reshuffles():
    it = PromptIterator(ROWS, seed=3)
    e0, e1 = it.take(10), it.take(10)
    assert sorted(r["prompt"] for r in e0) == sorted(r["prompt"] for r in ROWS)
    assert sorted(r["prompt"] for r in e1) == sorted(r["prompt"] for r in ROWS)
    assert e0 != e1 and it.epoch == 1
    assert PromptIterator(ROWS, seed=0, shuffle=False).take(12) == ROWS + ROWS[:2]
    assert it.take(0) == []


def test_iterator_resume_draws_exactly_the_same_prompts():
    ref = PromptIterator(ROWS, seed=5)
    full = [r["prompt"] for r in ref.take(7) + ref.take(9) + ref.take(13)]
    it = PromptIterator(ROWS, seed=5)
    head = it.take(7) + it.take(9)
    state = dict(it.state_dict())  # would be saved in a checkpoint
    resumed = PromptIterator(ROWS, seed=5)
    resumed.load_state_dict(state)
    assert [r["prompt"] for r in head + resumed.take(13)] == full


def test_iterator_refuses_a_state_from_other_data_or_seed():
    state = PromptIterator(ROWS, seed=5).state_dict()
    with pytest.raises(MegagrpoError, match="saved for a prompt set of 10 rows"):
        PromptIterator(ROWS[:9], seed=5).load_state_dict(state)
    changed = [dict(r) for r in ROWS]
    changed[0]["prompt"] = "different"
    with pytest.raises(MegagrpoError, match="fingerprint"):
        PromptIterator(changed, seed=5).load_state_dict(state)
    with pytest.raises(MegagrpoError, match="keep schedule.seed"):
        PromptIterator(ROWS, seed=6).load_state_dict(state)
    with pytest.raises(MegagrpoError, match="prompt set is empty"):
        PromptIterator([], seed=0)

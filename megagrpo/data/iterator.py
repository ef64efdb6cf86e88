"""A resumable, seeded prompt iterator: `take(n)` any number of prompts, across epochs.

The position is (epoch, offset): epoch e visits the rows in the permutation seeded by (seed, e), so
`state_dict()` is a few integers and a fingerprint of the data, and a resumed run draws exactly the
prompts the uninterrupted run would have drawn. Dynamic sampling asks for odd amounts (refills), hence
`take(n)` rather than fixed batches.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence

from megagrpo.errors import MegagrpoError


def fingerprint(rows: Sequence[dict]) -> str:
    """Short hash of the rows' prompts and answers, so a resume on different data is caught."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r.get("prompt"), r.get("answer")], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


class PromptIterator:
    def __init__(self, rows: Sequence[dict], seed: int, shuffle: bool = True) -> None:
        if len(rows) == 0:
            raise MegagrpoError(
                "prompt set is empty: nothing to train on (check data.train_path / data.synthetic)"
            )
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._fingerprint = fingerprint(rows)
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[dict]:
        """The next n samples (wrapping into the next epoch, reshuffled); n >= 0."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            k = min(n - len(out), len(self._order) - self.offset)
            out += [self.rows[i] for i in self._order[self.offset : self.offset + k]]
            self.offset += k
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_rows") != len(self.rows) or state.get("fingerprint") != self._fingerprint:
            raise MegagrpoError(
                f"data position in the checkpoint was saved for a prompt set of {state.get('num_rows')} rows "
                f"(fingerprint {state.get('fingerprint')}), but the configured set has {len(self.rows)} rows "
                f"(fingerprint {self._fingerprint}); resume with the same data config, or start fresh with "
                "checkpoint.resume=none"
            )
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise MegagrpoError(
                f"data position in the checkpoint used seed={state.get('seed')} shuffle={state.get('shuffle')}, "
                f"but this run has seed={self.seed} shuffle={self.shuffle}; keep schedule.seed and data.shuffle"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if not 0 <= offset <= len(self.rows) or epoch < 0:
            raise MegagrpoError(
                f"data position in the checkpoint is invalid (epoch={epoch}, offset={offset})"
            )
        self.epoch, self.offset = epoch, offset
        self._order = self._permutation(epoch)

"""Cutting a stream of `(hf_name, tensor)` into buckets of a byte size, never inside a group that must
travel whole.

`together` names the groups: {hf_name: every HF name of its group, itself included}. The weight sync
gives the tensors its engine fuses at load (`sync.sglang_layout.load_groups`): a group cut across two
buckets reaches the engine in two `load_weights` calls, and SGLang's loader drops a lone half of MLA's
q_a/kv_a pair without a word. The bridge does not know why the groups exist, only that they do.

Members of a group need not be adjacent in the stream (the map writes DeepSeek-V3's kv_a_proj_with_mqa,
then kv_b_proj and o_proj, then q_a_proj): while a group is open, a bucket that would overflow is cut
just before the group's first member, and the open part moves on to the next bucket. A bucket exceeds
`bucket_bytes` only when one group, from its first member to its last (what lies between included),
is larger than a bucket, or when one tensor is.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

NamedTensor = tuple[str, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class BucketFiller:
    """Fills buckets in stream order: `add` returns a bucket to send when one closes, `finish` the last.

    Holds one bucket at most, plus the open groups' members when a cut moves them on."""

    def __init__(self, bucket_bytes: int, together: Mapping[str, tuple[str, ...]] | None = None) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.limit = bucket_bytes
        self.together = together or {}
        self.bucket: list[NamedTensor] = []
        self.size = 0
        self.open: dict[tuple[str, ...], list[int]] = {}  # open group -> [members still to come, start]

    def add(self, name: str, t: torch.Tensor) -> list[NamedTensor] | None:
        """Append `(name, t)`; the bucket that closes before it, if one does."""
        n = tensor_bytes(t)
        out = self._cut() if self.bucket and self.size + n > self.limit else None
        group = self.together.get(name)
        if group is not None:
            state = self.open.setdefault(group, [len(group), len(self.bucket)])
            state[0] -= 1
            if state[0] == 0:
                del self.open[group]
        self.bucket.append((name, t))
        self.size += n
        return out

    def finish(self) -> list[NamedTensor] | None:
        """The last bucket (None when empty). Every group must be complete by now."""
        if self.open:
            first = next(iter(self.open))
            raise AssertionError(
                f"bucketing: group {first} ended incomplete; `together` names tensors not sent"
            )
        out, self.bucket, self.size = self.bucket or None, [], 0
        return out

    def _cut(self) -> list[NamedTensor] | None:
        """Close the bucket before the first open group's first member; None when that member opens it."""
        cut = min((start for _, start in self.open.values()), default=len(self.bucket))
        if cut == 0:
            return None  # one group larger than a bucket: it grows until the group closes
        out, self.bucket = self.bucket[:cut], self.bucket[cut:]
        self.size = sum(tensor_bytes(t) for _, t in self.bucket)
        for state in self.open.values():
            state[1] -= cut
        return out

"""Agreement on a failure before the next collective (issue 25, item 18).

An error raised on one rank while the others go on into a collective leaves them waiting there until
`dist.timeout_minutes`, and the job's log then shows a timeout on every rank but one. After a piece of work
that may fail on some ranks only (an engine owner's generation or weight sync, one DP rank's rows, one
pipeline stage's weights), every rank of the group learns whether any rank failed, and then every rank
raises: the failing rank its own error, the others `PeerFailed` naming it. So the job ends at once, with
the cause in the failing rank's log and its rank in every other's.

One mechanism, two forms: `agreed` wraps the work as a context manager and raises at once; `agree` and
`raise_agreed` are its two halves, for a caller that has cleanup of its own to run between learning the
outcome and raising it (`sync.stages`: the rest of the export, a weight-update session to close).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megagrpo.dist.wire import wire_device
from megagrpo.errors import MegagrpoError, leave_user_error


class PeerFailed(MegagrpoError):
    """Another rank of the group failed at a guarded point; its own error is in its log."""

    def __init__(self, rank: int, what: str) -> None:
        super().__init__(
            f"rank {rank} failed in {what}; its error is in that rank's log (this rank stops too)"
        )
        self.rank = rank


def failed_rank(failed: bool, group: dist.ProcessGroup | None = None) -> int | None:
    """Collective over `group` (None = WORLD): the highest global rank that passed `failed=True`, or None.
    Per-rank cost: one all-reduce (MAX) of one int64 (1 + this rank when it failed, else 0)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if not failed:
            return None
        return dist.get_rank() if dist.is_initialized() else 0
    flag = torch.tensor([dist.get_rank() + 1 if failed else 0], dtype=torch.int64, device=wire_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    n = int(flag)
    return n - 1 if n else None


def agree(error: BaseException | None, group: dist.ProcessGroup | None = None) -> int | None:
    """Collective over `group` (None = WORLD): this rank's outcome (`error`, None when it succeeded)
    against every other's; the (highest) failing rank, or None when none failed. A failing rank leaves
    its user error for the CLI first. Per-rank cost: one all-reduce of one int64 over `group`."""
    if isinstance(error, MegagrpoError) and not isinstance(error, PeerFailed):
        # Left before the others learn of it: they exit at once, and the launcher may stop this rank
        # while its cleanup runs, before the CLI's own report (seen: a dead engine during a weight sync
        # ended a run with only the peers' "rank 0 failed" echo).
        leave_user_error(str(error))
    return failed_rank(error is not None, group)


def raise_agreed(error: BaseException | None, rank: int | None, what: str) -> None:
    """After `agree`: nothing when no rank failed (`rank` None); else this rank's own `error`, or
    `PeerFailed` naming `rank` when this rank succeeded."""
    if rank is None:
        return
    if error is not None:
        raise error
    raise PeerFailed(rank, what)


@contextlib.contextmanager
def agreed(what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the body, then agree over `group` (None = WORLD) on whether it failed anywhere: the failing
    rank re-raises its own exception, every other rank raises `PeerFailed` naming the (highest) failing
    rank. Every rank of the group must pass through the same guarded points in the same order (the body
    may do nothing on some), and the body must leave no collective half-entered (a rank that fails must
    still complete the collectives that the others run inside the body). Only `Exception`s are agreed on:
    an interrupt ends the process anyway. Per-rank cost: one all-reduce of one int64 over `group`."""
    try:
        yield
    except Exception as e:
        agree(e, group)
        raise
    raise_agreed(None, agree(None, group), what)

"""Test helpers for batch statistics: the bound of `megagrpo.algo.quantiles`, and fake DP ranks (threads) that
run one statistic per rank through the reducer interface and count what each rank receives."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from megagrpo.algo.quantiles import MIN_MAGNITUDE, REL_WIDTH


def assert_outward(est: float, values: torch.Tensor, q: float) -> None:
    """`est` is the histogram quantile q of `values` (1-D): on the outward side of the exact type-7
    quantile, and within the documented bound of the order statistic it brackets."""
    x = values.detach().to(torch.float64).reshape(-1).sort().values
    n = x.numel()
    h = (n - 1) * q
    k = int(h // 1)
    hi = min(k + 1, n - 1)
    a, b = float(x[k]), float(x[hi])
    exact = a if a == b else a + (h - k) * (b - a)
    slack = 1e-12 * max(1.0, abs(exact))
    if q >= 0.5:
        xk = b if h > k else a
        assert exact - slack <= est <= xk + REL_WIDTH * abs(xk) + 2 * MIN_MAGNITUDE + slack, (est, exact, xk)
    else:
        assert a - REL_WIDTH * abs(a) - 2 * MIN_MAGNITUDE - slack <= est <= exact + slack, (est, exact, a)


class FakeRanks:
    """`n` DP ranks as threads in one process. `run(fn)` calls `fn(rank, reducer)` on every rank at once;
    the reducers sum / max / gather over the ranks (in rank order) and count the bytes each rank receives
    (an all-reduce: the bytes of its result; a gather: every rank's part)."""

    def __init__(self, n: int):
        self.n = n
        self.received = [0] * n
        self._slots: list[Any] = [None] * n
        self._barrier = threading.Barrier(n, timeout=60)

    def _collective(self, rank: int, x: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]):
        self._slots[rank] = x.detach().clone()
        self._barrier.wait()
        out = combine(list(self._slots))
        self._barrier.wait()
        self.received[rank] += out.numel() * out.element_size()
        return out

    def reducer(self, rank: int) -> Any:
        ranks = self

        class _Reducer:
            def sum(self, x):
                return ranks._collective(rank, x, lambda xs: torch.stack(xs).sum(0))

            def max(self, x):
                return ranks._collective(rank, x, lambda xs: torch.stack(xs).amax(0))

            def gather(self, x):  # the interface before issue 25, kept to measure what it cost
                return ranks._collective(rank, x, torch.cat)

        return _Reducer()

    def run(self, fn: Callable[[int, Any], Any]) -> list[Any]:
        out: list[Any] = [None] * self.n
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                out[rank] = fn(rank, self.reducer(rank))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

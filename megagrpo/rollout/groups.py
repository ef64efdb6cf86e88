"""Rollout groups: which ranks own a sampler, which prompts each one samples, and the collectives that
turn the engines' shares back into one step.

Placement. On GPUs every `rollout.engine_tp` consecutive ranks form a colocation group whose first rank
owns one SGLang engine on the group's GPUs (`base_gpu_id` = that rank's local rank), so world / engine_tp
engines run. On the CPU `rollout.num_engines` engines run on evenly spaced ranks (rank e * world // n), one
process each, through the same code. Ranks are node-major under torchrun and Slurm, so a group never
spans nodes when engine_tp divides the ranks per node (`megagrpo submit` checks it).

Shares. A list of n prompts (one dynamic-sampling round, or the held-out set) is split into contiguous,
nearly equal runs, engine e taking `share(n, e)`. The rule depends only on n and the engine count, and
request seeds come from each request's GLOBAL index (`RolloutEngine.generate(index_offset=...)`), so the
same prompt gets the same seed whichever engine samples it: the number of engines changes no completion.

Costs. `gather`, `join_shares` and `sum_counts` carry scalars per prompt group (rewards, counts) over
WORLD. Tokens move once per step, in `send_rows`: each row goes from the owner that sampled it to the
ranks that asked for it, and nowhere else (all-to-alls of the pickled rows in pieces of at most
`WIRE_CHUNK_BYTES`, device memory on GPUs; a rank receives exactly the rows it asked for, plus two int64
per rank).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.dist.wire import wire_device


def _dist() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class EngineGroups:
    """The engines of one run: `num_engines` owners among `world` ranks, and this rank's place."""

    world: int
    rank: int
    num_engines: int

    @classmethod
    def current(cls, num_engines: int) -> EngineGroups:
        rank, world = _dist()
        return cls(world=world, rank=rank, num_engines=num_engines)

    def owner(self, engine: int) -> int:
        """Global rank that owns engine `engine`: the first rank of its group."""
        return engine * self.world // self.num_engines

    @property
    def owners(self) -> list[int]:
        return [self.owner(e) for e in range(self.num_engines)]

    @property
    def engine(self) -> int | None:
        """The engine this rank owns, or None."""
        owners = self.owners
        return owners.index(self.rank) if self.rank in owners else None

    def share(self, n: int, engine: int | None = None) -> range:
        """Positions of `n` prompts that `engine` (default: this rank's) samples; empty for a non-owner."""
        e = self.engine if engine is None else engine
        if e is None:
            return range(0)
        return range(e * n // self.num_engines, (e + 1) * n // self.num_engines)

    def base_gpu_id(self) -> int:
        """The first GPU of this owner's engine on its node: its local rank (torchrun's LOCAL_RANK, Slurm's
        SLURM_LOCALID)."""
        for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
            if var in os.environ:
                return int(os.environ[var])
        return 0

    # -- collectives (every rank calls them, owners or not) -----------------------------------------

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by global rank, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_from_engines(self, obj: Any) -> list[Any]:
        """Each engine owner's `obj`, indexed by engine, on every rank."""
        every = self.gather(obj)
        return [every[r] for r in self.owners]

    def join_shares(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """`[n, ...]` on every rank from each owner's rows `[len(share), ...]` of its own share."""
        parts = self.gather_from_engines(local)
        out = torch.cat([p for p in parts if p is not None and p.shape[0] > 0]) if n else local[:0]
        if out.shape[0] != n:
            raise RuntimeError(f"engine shares hold {out.shape[0]} rows, expected {n}")
        return out

    def sum_counts(self, counts: dict[str, float]) -> dict[str, float]:
        """Per-key sums of the owners' counters (keys missing on an owner count as 0)."""
        total: dict[str, float] = {}
        for part in self.gather_from_engines(counts):
            for k, v in (part or {}).items():
                total[k] = total.get(k, 0.0) + float(v)
        return total

    def send_rows(
        self,
        owned: dict[int, Any],
        wanted: list[list[int]],
        prepare: Callable[[int, Any], Any] | None = None,
    ) -> tuple[dict[int, Any], int]:
        """Rank r receives the rows `wanted[r]` (ids) from whichever rank holds them in its `owned`
        (row id -> object), as `prepare(r, row)` makes them for r (the row itself by default); one
        all-to-all over WORLD. Returns (this rank's wanted rows by id, bytes received). Raises when a
        wanted row is held by no rank."""
        if len(wanted) != self.world:
            raise ValueError(f"wanted lists {len(wanted)} ranks, the world has {self.world}")
        payloads = []
        for dest, rows in enumerate(wanted):
            items = [
                (i, owned[i] if prepare is None else prepare(dest, owned[i])) for i in rows if i in owned
            ]
            payloads.append(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL) if items else b"")
        if self.world == 1:
            chunks, received = payloads, 0
        else:
            chunks = _all_to_all_bytes(payloads)
            received = sum(len(c) for c in chunks)
        got: dict[int, Any] = {}
        for c in chunks:
            if c:
                got.update(pickle.loads(c))
        missing = [i for i in wanted[self.rank] if i not in got]
        if missing:
            raise RuntimeError(f"no rank holds row(s) {missing[:5]} of the step's batch")
        return got, received


def node_name() -> str:
    """This process's node: Slurm's name for it when under Slurm, else the host name."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# The data plane's byte movers hold at most this many bytes per direction at once. On GPUs the world and
# stage groups are NCCL, which reaches only device memory, and the rows move while the engine still holds
# its pool (before `engine.release`): the wire buffers are therefore bounded pieces, not the size of the
# rows, and `megagrpo plan` counts them in the rollout phase (`plan.memory.ROWS_WIRE_CHUNK_BYTES`, held
# equal by a unit test). 64 MiB keeps a piece at NCCL's full bandwidth.
WIRE_CHUNK_BYTES = 64 << 20


def _all_to_all_bytes(payloads: list[bytes], chunk: int | None = None) -> list[bytes | bytearray]:
    """payloads[r] goes to rank r; returns what each rank sent to this one (empty when nothing).

    In pieces of at most `chunk` bytes (default `WIRE_CHUNK_BYTES`). Shift j = 1 .. world - 1 pairs every
    rank with rank + j (it sends) and rank - j (it receives); a shift runs as many all-to-alls as its
    largest pair needs pieces, each carrying at most one piece out of and one into any rank, and a shift in
    which no rank sends is skipped. Per-rank cost: its own bytes out and in; wire buffers (device memory
    under NCCL) of at most one piece each way; an all-to-all and an all-reduce (MAX) of `world` int64, then
    the sum over shifts of the largest pair's piece count of all-to-alls over WORLD."""
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = chunk or WIRE_CHUNK_BYTES
    dev = wire_device()
    sizes_in = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=dev)
    sizes_out = torch.empty_like(sizes_in)
    dist.all_to_all_single(sizes_out, sizes_in)
    out: list[bytes | bytearray] = [bytearray(int(n)) for n in sizes_out.tolist()]
    out[rank] = payloads[rank]
    pieces = [-(-len(payloads[(rank + j) % world]) // chunk) for j in range(world)]
    shifts = torch.tensor(pieces, dtype=torch.int64, device=dev)
    dist.all_reduce(shifts, op=dist.ReduceOp.MAX)
    for j, n in enumerate(shifts.tolist()):
        if j == 0 or n == 0:
            continue
        dst, src = (rank + j) % world, (rank - j) % world
        data, into = memoryview(payloads[dst]), out[src]
        for lo in range(0, n * chunk, chunk):
            piece = data[lo : lo + chunk]
            n_in = max(0, min(chunk, len(into) - lo))
            send_splits, recv_splits = [0] * world, [0] * world
            send_splits[dst], recv_splits[src] = len(piece), n_in
            send = _wire_piece(piece, dev)
            recv = torch.empty(n_in, dtype=torch.uint8, device=dev)
            dist.all_to_all_single(recv, send, recv_splits, send_splits)
            if n_in:
                into[lo : lo + n_in] = recv.cpu().numpy().tobytes()
    return out


def _wire_piece(piece: memoryview, dev: torch.device) -> torch.Tensor:
    """One piece of a payload as a uint8 tensor on the wire's device (a host copy of at most one piece)."""
    if not len(piece):
        return torch.empty(0, dtype=torch.uint8, device=dev)
    return torch.frombuffer(bytearray(piece), dtype=torch.uint8).to(dev)


def broadcast_bytes(payload: bytes | None, src: int, group, chunk: int | None = None) -> bytes | bytearray:
    """`payload` of global rank `src` on every rank of `group`: its size, then pieces of at most `chunk`
    bytes (default `WIRE_CHUNK_BYTES`: the wire buffer of a piece is device memory under NCCL). Per-rank
    cost: the payload's bytes, in 1 + ceil(size / chunk) broadcasts within `group`."""
    chunk = chunk or WIRE_CHUNK_BYTES
    dev = wire_device(group)
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=src, group=group)
    n = int(size)
    data = memoryview(payload) if payload is not None else None
    out = bytearray(n) if payload is None else None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        if data is not None:
            dist.broadcast(_wire_piece(data[lo:hi], dev), src=src, group=group)
        else:
            buf = torch.empty(hi - lo, dtype=torch.uint8, device=dev)
            dist.broadcast(buf, src=src, group=group)
            out[lo:hi] = buf.cpu().numpy().tobytes()
    return payload if payload is not None else out

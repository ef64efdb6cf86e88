"""Weights to disaggregated engines from every pipeline stage: one broadcast group per engine and stage.

With PP > 1 a replica holds the model in P stages. Funnelling them to the engine's owner (over the
pipeline group) and then out to the engine moves the whole model into and out of one rank. Instead every
rank of one replica's pipeline group sends its own stage's tensors to the engine over a weights group of
its own (`BroadcastTransport(stage=s)`, group `megagrpo-weights-<e>-stage<s>`), as slime and miles do.
The engines are spread over the replicas (`config.mesh_rules.stage_routes`): every replica holds the same
weights, so engine e's senders are the pipeline group e * G / E of the G replicas, not necessarily its
owner's, and no rank feeds two engines while there are at least as many replicas as engines.

Per-rank cost per sync, M the model's bytes in the engine's dtype: a stage sender sends its stage's share
(about M / P) once per engine it feeds and receives nothing over the pipeline group; the engine receives M,
one group at a time (SGLang takes one update request at a time, so the stages' sends interleave by
bucket). With more engines than replicas a rank feeds several engines: each bucket is then flattened and
sent once per engine (`FanOut`).

Order, per sync (every learner rank takes part; two all-reduces of one int64 and one of E int64 over
the learner WORLD, beside the export's own collectives):
1. each engine's owner opens its weight-update session (over HTTP, whether or not it is one of the
   engine's senders); all agree that every session opened;
2. every stage sender streams its stage's buckets (checked one by one, as `sync.streaming.stream_buckets`:
   names, shapes, finite values); all agree that every stage succeeded, and sum per engine the tensors
   sent, which must be the whole checkpoint;
3. the owners close the sessions; with `sync.checksum`, every sender compares the engine's hashes of the
   parameters it sent with its own.
A failure before any send leaves every engine its old weights. One after a send stops the run with an
error naming the engine and stage, which is then partly updated; the last checkpoint resumes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.config.mesh_rules import StageRoute
from megagrpo.dist.agree import agree, raise_agreed
from megagrpo.dist.wire import wire_device
from megagrpo.errors import MegagrpoError
from megagrpo.sync.broadcast import engine_call, engine_dtype, verify_remote
from megagrpo.sync.buckets import NamedTensor
from megagrpo.sync.checks import _Checker, check_announced, checkpoint_shapes
from megagrpo.sync.sglang_layout import load_groups
from megagrpo.sync.stats import SyncStats
from megagrpo.sync.streaming import stream_buckets


class _StageChecker(_Checker):
    """One stage's share of the checkpoint: every tensor checked as it comes, none required here (the
    tensors sent are counted over the stages once every stage is done)."""

    def finish(self) -> None:
        pass


class FanOut:
    """`stream_buckets`' transport for the engines one rank feeds: each bucket flattened (in the engine's
    dtype) and sent once per engine; the errors name every engine it feeds."""

    def __init__(self, transports: Sequence[Any]) -> None:
        self.transports = list(transports)
        self.name = "; ".join(t.name for t in self.transports)

    def begin(self) -> None:
        for t in self.transports:
            t.begin()

    def flatten(
        self, bucket: list[NamedTensor], cast: torch.dtype | None, *, fresh: bool = False
    ) -> list[Any]:
        return [t.flatten(bucket, cast, fresh=fresh) for t in self.transports]

    def send(self, flats: list[Any], last: bool) -> None:
        for t, flat in zip(self.transports, flats, strict=True):
            t.send(flat, last)

    def dropped(self) -> None:
        for t in self.transports:
            t.dropped()

    def end(self) -> None:
        errors = []
        for t in self.transports:  # every one, so no group is left with a buffer or a session open
            try:
                t.end()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


def sync_stages(
    routes: Sequence[tuple[StageRoute, Any]],
    buckets: Iterable[list[NamedTensor]],
    *,
    num_engines: int,
    owned: tuple[int, Any] | None = None,
    announced: Mapping[str, tuple[int, ...]],
    checksum: bool = False,
) -> dict[int, SyncStats]:
    """Collective over the learner WORLD (module doc): this rank's stage of the export (`buckets`, from
    `export_buckets(stage_only=True)`, empty unless it has routes) to the engines of its `routes`
    (`(route, BroadcastTransport(stage=))` pairs). `owned`: (index, RemoteEngine) of the
    engine this rank owns, whose weight-update session it opens and closes. `announced`: the export's
    names and shapes, the whole model (each engine must receive exactly these). Returns this rank's stats
    per engine it feeds."""
    it = iter(buckets)
    t0 = time.perf_counter()
    err: BaseException | None = None

    opened = None
    try:
        if owned is not None:
            engine_call(owned[1], "/begin_weight_update")
            opened = owned[1]
    except Exception as e:
        err = e
    failed = agree(err)
    if failed is not None:
        for _ in it:
            pass
        _close(opened)
        raise_agreed(err, failed, "opening the engines' weight-update sessions")

    transports = [t for _, t in routes]
    kept: list[Any] | None = [] if checksum and transports else None
    stats: SyncStats | None = None
    try:
        if transports:
            if transports[0].shapes is None:
                shapes = checkpoint_shapes(transports[0].remote.cfg.model_path)
                for t in transports:
                    t.shapes = shapes
            shapes = transports[0].shapes
            if transports[0].groups is None:
                transports[0].groups = load_groups(shapes)
            check_announced(shapes, announced)
            cast = engine_dtype(transports[0].remote)
            checker = _StageChecker(shapes, transports[0].groups)
            stats = stream_buckets(it, checker, FanOut(transports), None, t0, cast=cast, keep=kept)
        else:
            for _ in it:
                pass
    except Exception as e:
        err = e
        for _ in it:  # the rest of the export: its gathers are collectives the stage is in
            pass
    counts = torch.zeros(num_engines, dtype=torch.int64)
    if stats is not None:
        for r, _ in routes:
            counts[r.engine] = stats.tensors
    failed = agree(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = counts.to(wire_device(None))
        dist.all_reduce(counts)
        counts = counts.cpu()
    closing = _close(opened)
    raise_agreed(err, failed, "the weight sync of a pipeline stage")
    if closing is not None:
        raise closing
    if owned is not None and int(counts[owned[0]]) != len(announced):
        raise MegagrpoError(
            f"{owned[1].name}: the pipeline stages sent {int(counts[owned[0]])} of the model's "
            f"{len(announced)} tensors; the engine is partly updated. Check the bridge's parameter map for "
            "this architecture; resume from the last checkpoint"
        )

    out: dict[int, SyncStats] = {}
    for i, (r, t) in enumerate(routes):
        ok = None
        if kept is not None:
            ok = verify_remote(t.remote, [flats[i].reconstruct_tensors() for flats in kept])
        s = stats or SyncStats(0, 0.0, 0, 0, None)
        out[r.engine] = SyncStats(s.bytes, s.seconds, s.buckets, s.tensors, ok)
    return out


def _close(opened: Any) -> BaseException | None:
    """End the session this rank opened, if any; its failure, if any."""
    if opened is None:
        return None
    try:
        engine_call(opened, "/end_weight_update")
    except Exception as e:
        return e
    return None


def merge_stage_stats(
    per_rank: Sequence[Mapping[int, SyncStats] | None], num_engines: int
) -> list[dict[str, float] | None]:
    """Each engine's sync metrics from every rank's per-stage stats: bytes summed over the stages, the
    time the slowest stage's, the checksum true only if every stage's is."""
    out: list[dict[str, float] | None] = []
    for e in range(num_engines):
        parts = [p[e] for p in per_rank if p and e in p]
        if not parts:
            out.append(None)
            continue
        checks = [p.checksum_ok for p in parts if p.checksum_ok is not None]
        merged = SyncStats(
            bytes=sum(p.bytes for p in parts),
            seconds=max(p.seconds for p in parts),
            buckets=sum(p.buckets for p in parts),
            tensors=sum(p.tensors for p in parts),
            checksum_ok=all(checks) if checks else None,
        )
        out.append(merged.metrics())
    return out

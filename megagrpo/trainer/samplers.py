"""What a `Session` does with its SGLang engines: start them beside the learner or connect to them on
ranks of their own (`rollout.placement`), pin CPU cores, hand the device memory between the learner and
the sampler at each phase, and sync the learner's weights into every engine.

Weight sync, three transports behind `sync_weights`: a colocated engine gets the owner's export through
`sync.weights` (CUDA IPC on GPUs, shared memory on the CPU); a disaggregated one over a broadcast group
(`sync.broadcast`), from its owner with PP 1 and from every pipeline stage with PP > 1 (`sync.stages`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import replace

import torch
import torch.distributed as dist

from megagrpo.dist.agree import agreed
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.groups import node_name
from megagrpo.trainer.components import rollout_config
from megagrpo.trainer.weights import check_learner_weights, export_buckets


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class SamplerMixin:
    """The engine half of `Session` (it sets `cfg`, `learner`, `engines`, `engine`, `placement`,
    `weights_transport`, `stage_routes`, `engine_store`, `async_rollout`, `arch`, `step`)."""

    # -- phases: who holds the device memory ----------------------------------------------------------
    #
    # Colocated, the learner and the sampler take turns on the same devices (docs/architecture.md,
    # "Device memory"). Start: the learner reaches its steady-state footprint (Adam's state included),
    # moves it to host memory, and only then does the engine start, so SGLang sizes its weights + KV cache
    # from nearly the whole device (mem_fraction_static of it). Each step: rollout (learner offloaded);
    # `learner_phase` (engine released, learner reloaded); old logprobs and updates; `sync_weights`
    # (validation, then the engine's weights resumed and overwritten); `sampler_phase` (learner offloaded,
    # KV cache resumed). On the CPU the offload is a no-op and the order is the same.

    @property
    def asynchronous(self) -> bool:
        """rollout.mode=async: the samplers generate future rounds while the learner trains."""
        return self.needs_engine and self.stage == "train" and self.cfg.rollout.mode == "async"

    @property
    def disaggregated(self) -> bool:
        """rollout.placement.kind=disaggregated: the engines run on ranks of their own (`rollout.engines.server`)."""
        return self.needs_engine and self.cfg.rollout.placement.disaggregated

    @property
    def own_devices(self) -> bool:
        """The engines keep devices of their own (async, or disaggregated): no phase swaps memory."""
        return self.asynchronous or self.disaggregated

    def num_engines(self) -> int:
        if not self.needs_engine:
            return 0
        from megagrpo.config.mesh_rules import engine_count

        r = self.cfg.rollout
        if self.disaggregated:  # self.world is the learner's: the engine ranks are outside it
            return 1 if r.num_engines is None else r.num_engines
        return engine_count(self.world, r.engine_tp, r.num_engines, on_gpu=torch.cuda.is_available())

    def start_engine(self) -> None:
        """Learner to its steady state and off the device, then the engines (on their owner ranks)."""
        self.learner.init_optimizer_state()
        if not self.needs_engine:
            return
        placement = self.placement = self.core_placement()
        if not self.own_devices:
            self.learner.offload()
        barrier()  # every rank's learner is off its device before any engine process sizes itself
        routes = self.pipeline_routes() if self.disaggregated else []
        # An owner that cannot start or reach its engine stops every rank here, not at the next collective.
        with agreed("the engines' start (an engine owner could not start or reach its engine)"):
            if self.engines.engine is not None:
                self.engine = (
                    self.connect_engine(self.engines.engine)
                    if self.disaggregated
                    else self.start_local_engine(placement)
                )
            if routes:
                self.connect_stages(routes)
            if placement and (self.disaggregated or self.engine is None):
                from megagrpo.rollout.engines.placement import pin_learner

                pin_learner(placement)  # off the engines' cores (a colocated owner pinned itself on start)

    def start_local_engine(self, placement):
        """This owner's colocated engine, on its GPUs or its pinned cores."""
        from megagrpo.rollout.engines.engine import RolloutEngine
        from megagrpo.rollout.engines.placement import engine_cores

        rc = replace(rollout_config(self.cfg, self.model_path), base_gpu_id=self.engines.base_gpu_id())
        where = f"cores {list(placement.engine)}" if placement else f"first GPU {rc.base_gpu_id}"
        engines = self.engines
        name = (
            f"engine {engines.engine} of {engines.num_engines}: rank {engines.rank} on {node_name()}, {where}"
        )
        with engine_cores(placement) if placement else contextlib.nullcontext():
            engine = RolloutEngine(rc, name=name).start()
        ft = self.cfg.rollout.fault_tolerance
        engine.start_watch(
            probe_interval_s=ft.probe_interval_s, probe_deadline_s=ft.probe_deadline_s, hang_s=ft.hang_s
        )
        print(name, flush=True)  # one line per engine, so a job's log says where its samplers run
        return engine

    # -- fault tolerance (docs/reliability.md) ---------------------------------------------------------

    def generate_recovering(self, prompts, sampling, group_size: int, index_offset: int) -> list:
        """`generate_with`, with engines replaced (`rollout.fault_tolerance.max_restarts` > 0): after the
        round every rank agrees on whether an engine failed; if one did, it is replaced (`replace_engine`,
        collective: the weight sync) and its owner sends its share of the round again, with the same
        seeds (`sampling.seed`, `index_offset`), so the completions are those of a run without the fault.
        Per-rank cost: one all-reduce of one int64 per round, and on a failure an engine start and a
        weight sync. Colocated, synchronous, single-turn only (the schema refuses the rest)."""
        from megagrpo.dist.agree import failed_rank
        from megagrpo.rollout.engines.engine import EngineFailed

        if self.cfg.rollout.fault_tolerance.max_restarts == 0:
            return self.generate_with(prompts, sampling, group_size, index_offset)
        groups = None
        while True:
            lost = None
            if groups is None:
                try:
                    groups = self.generate_with(prompts, sampling, group_size, index_offset)
                except EngineFailed as e:
                    lost = e
            if failed_rank(lost is not None) is None:
                return groups
            self.replace_engine(lost, requests=len(prompts) * group_size)

    def replace_engine(self, lost: Exception | None, *, requests: int) -> None:
        """Collective. The owner of the failed engine (`lost`) ends it and starts another in its place,
        within its budget (`max_restarts` per engine; past it `lost` ends the run, exit 69); then every
        rank syncs the learner's weights into every engine (checksummed), as after a step. One line and
        the counters `rollout/engine_restarts`, `rollout/regenerated_requests`, `perf/recovery_seconds`."""
        import time

        from megagrpo.dist.agree import agreed
        from megagrpo.rollout.engines.engine import EngineFailed

        budget = self.cfg.rollout.fault_tolerance.max_restarts
        t0 = time.perf_counter()
        with agreed("an engine's replacement (its restart budget is spent, or its start failed)"):
            if lost is not None:
                if self.engine_restarts >= budget:
                    raise EngineFailed(
                        f"{lost}; its restart budget is spent (rollout.fault_tolerance.max_restarts={budget})"
                    ) from lost
                self.engine.shutdown()
                self.engine = self.start_local_engine(self.placement)
                self.engine_restarts += 1
        self.learner_phase()
        # The replacement's sync is checksummed whatever sync.checksum says (a hash of the model, once per
        # replacement: small next to an engine start), where the check exists: rollout.engine_tp 1.
        self.checksum_forced = self.cfg.rollout.engine_tp == 1
        synced = self.sync_weights()  # the same verdict on every rank (merged over the engines)
        if synced.get("sync/checksum_ok", 1.0) != 1.0:
            raise EngineFailed(
                f"{lost or 'an engine failed'}; the weights synced into the replacement engines failed their "
                "checksum (sync.checksum), so the round is not sent again"
            )
        seconds = time.perf_counter() - t0
        checked = "checksummed" if "sync/checksum_ok" in synced else "not checksummed (rollout.engine_tp > 1)"
        if lost is not None:
            self.recovery["rollout/engine_restarts"] += 1
            self.recovery["rollout/regenerated_requests"] += requests
            self.recovery["perf/recovery_seconds"] += seconds
            print(
                f"{self.engine.name}: replaced in {seconds:.1f} s after {lost} (restart {self.engine_restarts} "
                f"of {budget}); its weights {checked}; {requests} requests sent again",
                flush=True,
            )

    def recovery_metrics(self) -> dict[str, float]:
        """The replacements of this step, summed over the engine owners (one all-reduce of 3 floats), and
        reset; {} when engines are not replaced (`max_restarts` 0)."""
        if not self.needs_engine or self.cfg.rollout.fault_tolerance.max_restarts == 0:
            return {}
        keys = ("rollout/engine_restarts", "rollout/regenerated_requests", "perf/recovery_seconds")
        t = torch.tensor(
            [self.recovery[k] for k in keys], dtype=torch.float64, device=self.learner.mesh.device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        self.recovery = dict.fromkeys(keys, 0.0)
        return dict(zip(keys, t.tolist(), strict=True))

    def inject_planned_fault(self) -> None:
        """The test seam `MEGAGRPO_FAULT_INJECT` (`rollout.engines.faults`): at its step's first round, this
        owner's colocated engine gets its signal once the round's requests are in flight."""
        from megagrpo.rollout.engines import faults

        fault = faults.planned()
        if fault is None or fault.step != self.step or self.engine is None or self.disaggregated:
            return
        faults.inject_when_busy(self.engine, fault)

    def connect_engine(self, index: int):
        """This owner's disaggregated engine: its URL from the launch's store, once its server is up."""
        from megagrpo.learner.mesh import DistEnv
        from megagrpo.rollout.engines import rendezvous
        from megagrpo.rollout.engines.remote import RemoteEngine
        from megagrpo.sync.broadcast import BroadcastTransport

        timeout = self.cfg.rollout.placement.engine_timeout_s
        env = DistEnv.from_environ()
        store = self.engine_store = rendezvous.connect(env.master_addr, env.master_port, timeout)
        endpoint = rendezvous.wait_for(store, index, timeout)
        rc = rollout_config(self.cfg, self.model_path)
        lock = threading.Lock()  # the async worker's requests read it too

        def reported_failure() -> str | None:
            with lock:
                return rendezvous.failure_of(store, index)

        engine = RemoteEngine(
            rc, index=index, url=endpoint.url, where=endpoint.where, key=endpoint.key, timeout_s=timeout,
            reported_failure=reported_failure,
        ).start()  # fmt: skip
        if not self.by_stage:  # with PP > 1 the stages send (`connect_stages`)
            self.weights_transport = BroadcastTransport(engine, timeout_s=timeout)
        print(
            f"engine {index} of {self.engines.num_engines}: {endpoint.where}, owned by rank "
            f"{self.engines.rank} on {node_name()}",
            flush=True,
        )
        return engine

    def pipeline_routes(self) -> list:
        """Disaggregated with PP > 1: the engines this rank feeds with its own pipeline stage's weights
        (`sync.stages`, `config.mesh_rules.stage_routes`); empty with PP 1 (the owner sends the whole
        model). Collective (one all-gather of each rank's pipeline group)."""
        if self.cfg.mesh.pp == 1:
            return []
        from megatron.core import parallel_state as ps

        from megagrpo.config.mesh_rules import stage_routes

        mine = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        groups = {tuple(g) for g in self.engines.gather(mine)}
        return stage_routes(self.engines.num_engines, sorted(groups), self.engines.rank)

    def connect_stages(self, routes: list) -> None:
        """A weights group per engine this rank feeds with its stage (its URL from the launch's store)."""
        from megagrpo.learner.mesh import DistEnv
        from megagrpo.rollout.engines import rendezvous
        from megagrpo.rollout.engines.remote import RemoteEngine
        from megagrpo.sync.broadcast import BroadcastTransport

        timeout = self.cfg.rollout.placement.engine_timeout_s
        if self.engine_store is None:
            env = DistEnv.from_environ()
            self.engine_store = rendezvous.connect(env.master_addr, env.master_port, timeout)
        rc = rollout_config(self.cfg, self.model_path)
        for r in routes:
            if r.engine == self.engines.engine:
                remote = self.engine
            else:  # control requests only: the owner generates
                e = rendezvous.wait_for(self.engine_store, r.engine, timeout)
                remote = RemoteEngine(
                    rc, index=r.engine, url=e.url, where=e.where, key=e.key, timeout_s=timeout
                )
            t = BroadcastTransport(remote, timeout_s=timeout, stage=r.stage)
            self.stage_routes.append((r, t))
        stages = ", ".join(f"engine {r.engine} stage {r.stage}" for r in routes)
        print(f"rank {self.engines.rank} sends its pipeline stage's weights: {stages}", flush=True)

    def core_placement(self):
        """The CPU cores of the engines and the learners (`rollout.placement`), or None: on GPUs, and
        colocated without `engine_cores`. Disaggregated, the engine ranks pin themselves to the engine
        cores (`rollout.engines.server`) and the learner ranks take the others."""
        r = self.cfg.rollout
        if self.disaggregated:
            from megagrpo.rollout.engines.placement import disaggregated_cores

            return disaggregated_cores(r.placement.engine_cores)
        if torch.cuda.is_available():
            if self.asynchronous:  # check_mesh refuses it first; kept for sessions built without it
                raise MegagrpoError(
                    "rollout.mode=async on GPUs needs engines on devices of their own: set "
                    "rollout.placement.kind=disaggregated, or use rollout.mode=colocated"
                )
            return None
        if not self.asynchronous and r.placement.engine_cores is None:
            return None
        from megagrpo.rollout.engines.placement import core_placement

        return core_placement(r.placement.engine_cores)

    def learner_phase(self, release: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        """Sampler -> learner: the engine releases `release` (its weights only when a weight sync follows:
        a released weights region keeps no copy), then every rank reloads its learner. Async: nothing to
        swap, the engines have devices of their own."""
        if self.own_devices:
            return
        if self.engine is not None:
            self.engine.release(list(release))
        barrier()  # the engine's memory is free on every device before any learner reloads
        self.learner.reload()

    def sampler_phase(self) -> None:
        """Learner -> sampler: every rank offloads its learner (and returns cached blocks to the driver),
        then the engine resumes whatever it released."""
        if self.own_devices:
            return
        self.learner.offload()
        barrier()
        if self.engine is not None:
            self.engine.resume()

    # -- weight sync ---------------------------------------------------------------------------------

    @functools.cached_property
    def export_shapes(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes every weight sync announces (the same model every step)."""
        from megagrpo.bridge.maps import hf_shapes

        return hf_shapes(self.arch)

    def sync_weights(self) -> dict[str, float]:
        """Learner -> every engine through the bridge's streaming export, then the sampler phase.

        Every rank iterates the export (its gathers are collectives); each engine owner receives its
        buckets from its own model-parallel replica (`export_buckets(receive=True)`), so no engine's
        weights pass through global rank 0. Called in the learner phase, with the engines' weights and KV
        cache released: each export is validated before the weights region is resumed
        (`sync.weights.sync_weights`), so a bad export leaves the engine released, with its old weights
        where the CPU engine keeps them, rather than serving a half-overwritten set.

        Metrics are per engine (every engine receives the same model): `sync/bytes` is one engine's,
        `sync/seconds` the slowest engine's, `sync/checksum_ok` true only if every engine's is.
        Disaggregated with PP > 1, each pipeline stage sends its own part instead (`sync_stages`).
        """
        check_learner_weights(self.learner)
        mine: dict[str, float] | None = None
        staged = None  # disaggregated with PP > 1: this rank's stats per engine it feeds with its stage
        # An owner's failure (its async worker, or its sync's checks) stops every rank here, not in the
        # next barrier; a failing owner still runs the export to its end (its gathers are collectives).
        with agreed("the weight sync (an engine owner's export or update failed)"):
            if self.async_rollout is not None:  # weights change only between requests (request boundaries)
                self.sync_wait_seconds += self.async_rollout.queue.drain()
            if self.by_stage:
                staged = self.sync_stages()
            else:
                mine = self.sync_whole()
        self.sampler_phase()
        if self.by_stage:
            from megagrpo.sync.stages import merge_stage_stats

            return merge_engine_metrics(
                merge_stage_stats(self.engines.gather(staged), self.engines.num_engines)
            )
        return merge_engine_metrics(self.engines.gather_from_engines(mine))

    @property
    def by_stage(self) -> bool:
        """Disaggregated with PP > 1: each pipeline stage sends its own weights (`sync.stages`)."""
        return self.disaggregated and self.cfg.mesh.pp > 1

    def sync_whole(self) -> dict[str, float] | None:
        """Each engine owner receives the whole export from its replica and sends it to its engine (a
        colocated engine, or a disaggregated one with PP 1); the owner's sync metrics."""
        from megagrpo.sync.weights import sync_weights

        mine = None
        buckets = export_buckets(self.learner, self.cfg.sync.bucket_mb << 20, receive=self.engine is not None)
        if self.engine is not None and self.disaggregated:
            from megagrpo.sync.broadcast import sync_remote

            stats = sync_remote(
                self.weights_transport,
                buckets,
                announced=self.export_shapes,
                checksum=self.checksum_due(),
            )
            mine = stats.metrics()
        elif self.engine is not None:
            try:
                stats = sync_weights(
                    self.engine,
                    buckets,
                    checksum=self.checksum_due(),
                    pack=self.cfg.sync.pack,
                    before_send=None if self.asynchronous else (lambda: self.engine.resume(["weights"])),
                    announced=self.export_shapes,
                )
            except MegagrpoError as e:  # which engine: a run has one per colocation group
                raise MegagrpoError(
                    f"engine {self.engines.engine} of {self.engines.num_engines} (colocated, rank "
                    f"{self.engines.rank}): {e}"
                ) from e
            mine = stats.metrics()
        else:
            for _ in buckets:
                pass
        return mine

    def sync_stages(self):
        """Every pipeline stage sends its own weights to the engines its rank feeds (`sync.stages`):
        nothing is funnelled through the owner. Collective over the learners; this rank's stats per
        engine."""
        from megagrpo.sync.stages import sync_stages

        buckets = export_buckets(
            self.learner, self.cfg.sync.bucket_mb << 20, receive=bool(self.stage_routes), stage_only=True
        )
        return sync_stages(
            self.stage_routes,
            buckets,
            num_engines=self.engines.num_engines,
            owned=None if self.engine is None else (self.engines.engine, self.engine),
            announced=self.export_shapes,
            checksum=self.checksum_due(),
        )

    def checksum_due(self) -> bool:
        """`sync.checksum` on this sync: the first of the process (after the start or a resume) and then
        every `sync.checksum_every`-th step's; and the sync into a replaced engine (`replace_engine`)."""
        s = self.cfg.sync
        done = getattr(self, "checksums_done", 0)
        due = s.checksum and (done == 0 or self.step % s.checksum_every == 0)
        if getattr(self, "checksum_forced", False):  # an engine's replacement (`replace_engine`)
            due, self.checksum_forced = True, False
        self.checksums_done = done + due
        return due

    def close_engines(self) -> None:
        """Shut this rank's engine down (or its connections), close its weights groups, and tell the
        disaggregated engine ranks to stop, so the launcher reports the learners' exit codes."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.weights_transport is not None:
            self.weights_transport.close()
        for _, t in self.stage_routes:
            t.close()
        if self.engine_store is not None:
            from megagrpo.rollout.engines import rendezvous

            rendezvous.request_stop(self.engine_store)  # the engine ranks exit 0: the learners' codes count


def merge_engine_metrics(per_engine: list[dict[str, float] | None]) -> dict[str, float]:
    """One engine's sync metrics from every engine's: bytes and the checksum verdict are the same for
    every engine that worked (the checksum is AND-ed), the time is the slowest engine's."""
    parts = [m for m in per_engine if m]
    if not parts:
        return {}
    out = dict(parts[0])
    if "sync/seconds" in out:
        out["sync/seconds"] = max(m["sync/seconds"] for m in parts)
        out["sync/gbps"] = out["sync/bytes"] / max(out["sync/seconds"], 1e-9) / 1e9
    if "sync/checksum_ok" in out:
        out["sync/checksum_ok"] = float(all(m["sync/checksum_ok"] for m in parts))
    return out

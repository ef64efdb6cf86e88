"""Process-level entry for `megagrpo {train,sft,eval}`: CPU compat, the rank's role, then the stage."""

from __future__ import annotations

import os

from megagrpo.config.schema import Config


def run(mode: str, cfg: Config, *, resume: str | None = None) -> int:
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=True, sglang=mode != "sft")
    if mode != "sft" and cfg.rollout.placement.disaggregated:
        code = serve_if_engine_rank(cfg)
        if code is not None:
            return code
    if mode == "sft":
        from megagrpo.trainer.sft import sft

        return sft(cfg, resume=resume)
    if mode == "train":
        from megagrpo.trainer.grpo import train

        return train(cfg, resume=resume)
    if mode == "eval":
        from megagrpo.trainer.evaluate import evaluate

        return evaluate(cfg, resume=resume)
    raise ValueError(f"unknown mode {mode!r}")


def serve_if_engine_rank(cfg: Config) -> int | None:
    """A disaggregated launch: an engine rank serves its engine until the learner stops it (its exit code);
    a learner rank gets the learner's world size (`learner.mesh.LEARNERS_ENV`) and None."""
    import torch

    from megagrpo.config.mesh_rules import engine_node_of, rank_roles
    from megagrpo.learner.mesh import LEARNERS_ENV, DistEnv

    env = DistEnv.from_environ()
    r = cfg.rollout
    roles = rank_roles(
        env.world_size, r.engine_tp, r.num_engines, disaggregated=True, on_gpu=torch.cuda.is_available()
    )
    engine = roles.engine_of(env.rank, r.engine_tp)
    if engine is None:
        os.environ[LEARNERS_ENV] = str(roles.learners)
        return None
    from dataclasses import replace

    from megagrpo.rollout.engines.placement import disaggregated_cores, pin_engine
    from megagrpo.rollout.engines.server import serve
    from megagrpo.trainer.components import rollout_config

    cores = disaggregated_cores(r.placement.engine_cores)
    if cores is not None:
        pin_engine(cores)  # before the server starts: its processes inherit the cores
    rc = replace(rollout_config(cfg, cfg.model.hf_path), base_gpu_id=env.local_rank)
    # the first rank of the engine on each of its nodes starts that node's part (one node: the first rank)
    node = engine_node_of(env.rank, roles.learners, r.engine_tp, env.world_size // max(1, env.nodes))
    return serve(
        rc,
        engine=engine,
        rank=env.rank,
        first=node is not None,
        addr=env.master_addr,
        port=env.master_port,
        timeout_s=r.placement.engine_timeout_s,
        nodes=env.nodes,
        node_rank=node.node_rank if node is not None else 0,
        nnodes=node.nnodes if node is not None else 1,
    )

"""Data-parallel dynamic sampling on 4 gloo ranks with 1, 2, 3 and 4 engines and a fake sampler whose
completions are a function of each request's prompt and seed (what the CPU SGLang engine guarantees).
Each rank records what its engine generated, the batch's rewards and the kept groups it gathered; the
pytest side checks that every engine count gives the same batch and that shares partition each round."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.rollout import Completion, DynamicSamplingConfig, SamplingConfig, dynamic_sample
from megagrpo.rollout.groups import EngineGroups
from tests.dist._common import write_json


def _fake_generate(log: list):
    def generate(prompts, sampling, group_size, *, index_offset=0):
        log.append([p[0] for p in prompts])
        out = []
        for i, p in enumerate(prompts):
            grp = []
            for g in range(group_size):
                seed = sampling.seed + index_offset + i * group_size + g
                tok = (p[0] * 7 + seed * 13) % 5  # a function of the prompt and the request's seed only
                grp.append(
                    Completion(i, g, torch.tensor(p), torch.tensor([tok]), torch.zeros(1), "stop", "", None)
                )
            out.append(grp)
        return out

    return generate


def main(rank: int, world: int, outdir: Path) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    results = {}
    for n in range(1, world + 1):
        engines = EngineGroups.current(n)
        log: list = []
        batch = dynamic_sample(
            _fake_generate(log),
            iter([[v] for v in range(1, 200)]),
            SamplingConfig(seed=1000),
            DynamicSamplingConfig(batch_prompts=6, group_size=4, oversample=1.0, max_rounds=5),
            lambda prompts, groups: torch.tensor([float(c.output_ids[0] >= 4) for g in groups for c in g]),
            engines=engines,
        )
        every = engines.gather_from_engines(list(zip(batch.positions, [p[0] for p in batch.prompts])))
        kept = [prompt for _pos, prompt in sorted(x for part in every for x in part)]
        results[str(n)] = dict(
            engine=engines.engine,
            generated=log,
            rewards=batch.rewards.tolist(),
            kept_prompts=kept,
            mine=[p[0] for p in batch.prompts],
            positions=batch.positions,
            rounds=batch.rounds,
            dropped=batch.dropped_groups,
        )
    write_json(outdir / f"rank{rank}.json", results)
    dist.destroy_process_group()

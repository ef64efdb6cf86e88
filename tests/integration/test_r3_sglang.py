"""R3 end to end: the real SGLang engine's routes replayed in the megatron learner (tiny Qwen3-MoE, CPU fp32).

1. Same weights: the learner's own top-k agrees with the engine's routes (agreement 1.0), and replaying
   them changes nothing.
2. The sampler's router weights go through an fp8 (e4m3, per-tensor scale) round trip, so the sampler
   routes some tokens differently: the learner's R3 logprobs are at least as close to the sampler's as
   its logprobs without replay.

Generation runs here (the session engine); the learner runs in one forked process (tests/dist harness),
which keeps megatron's CPU patches out of the engine's process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist._harness import launch

PROMPTS = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202], [44, 45, 46, 47, 48, 49, 50, 51], [9, 8, 7]]


def _fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().max().clamp_min(1e-12) / 448.0  # e4m3 max
    return (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def _batch(engine, tmp: Path, name: str) -> Path:
    from megagrpo.rollout.config import SamplingConfig
    from megagrpo.trainer.batch import rollout_batch

    groups = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=12, temperature=1.0, ignore_eos=True), 2)
    assert all(c.routes is not None for g in groups for c in g), "the engine returned no routes"
    batch = rollout_batch(groups, torch.zeros(len(PROMPTS) * 2), pad_id=0)
    path = tmp / f"{name}.pt"
    torch.save(batch, path)
    return path


@pytest.fixture(scope="module")
def measured(sglang_engine, sglang_model_dir, hf_reference, tmp_path_factory):
    from megagrpo.sync import bucketize, sync_weights

    tmp = tmp_path_factory.mktemp("r3")
    same = _batch(sglang_engine, tmp, "same")
    sd = hf_reference.state_dict()
    routers = [(n, t.detach().clone()) for n, t in sd.items() if n.endswith("mlp.gate.weight")]
    assert routers, "no router weights found in the HF model"
    try:
        sync_weights(sglang_engine, bucketize([(n, _fp8_round_trip(t)) for n, t in routers]), partial=True)
        noisy = _batch(sglang_engine, tmp, "noisy")
    finally:
        sync_weights(sglang_engine, bucketize(routers), partial=True)
    launch(
        "tests.integration.test_r3_sglang:worker", 1, tmp, timeout=900,
        model_dir=str(sglang_model_dir), batches={"same": str(same), "noisy": str(noisy)},
    )  # fmt: skip
    res = json.loads((tmp / "rank0.json").read_text())
    print("R3 end to end (learner vs engine):", json.dumps(res, indent=1))  # the figures, with pytest -s
    return res


@pytest.mark.slow
def test_same_weights_engine_routes_agree_with_learner(measured):
    m = measured["same"]
    assert m["agreement_rollout_old"] == 1.0
    assert m["r3_vs_free_max"] < 1e-4  # replaying the learner's own choices changes nothing
    assert m["r3_vs_sampler_mean"] < 1e-3
    assert m["replay_unconsumed"] == 0 and m["replay_fallback_tokens"] == 0


@pytest.mark.slow
def test_r3_logprobs_are_at_least_as_close_to_the_sampler(measured):
    m = measured["noisy"]
    assert m["agreement_rollout_old"] < 1.0, "the fp8 round trip changed no route; the case is vacuous"
    assert m["r3_vs_sampler_mean"] <= m["free_vs_sampler_mean"] + 1e-7
    assert m["replay_unconsumed"] == 0 and m["replay_fallback_tokens"] == 0


def worker(rank: int, world: int, outdir: Path, model_dir: str, batches: dict[str, str]) -> None:
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.learner.learner import Learner, LearnerConfig
    from megagrpo.moe.replay import StepReplay
    from megagrpo.trainer.weights import load_hf_into_learner

    learner = Learner(arch_from_hf(Path(model_dir) / "config.json"), LearnerConfig(routing_replay=True))
    load_hf_into_learner(learner, model_dir)
    out = {}
    for name, path in batches.items():
        batch = torch.load(path)
        lb = {k: v for k, v in batch.items() if k != "routes"}
        mask = batch["loss_mask"]
        rep = StepReplay.for_step("R3", learner, batch)
        r3 = learner.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
        m = {**rep.old_pass_metrics(), **rep.step_metrics()}
        free = learner.forward(lb)["logprobs"]
        sampler = batch["sampler_logp"]
        out[name] = {
            "agreement_rollout_old": m["moe/agreement_rollout_old"],
            "replay_unconsumed": m["moe/replay_unconsumed"],
            "replay_fallback_tokens": m["moe/replay_fallback_tokens"],
            "r3_vs_free_max": float((r3 - free)[mask].abs().max()),
            "r3_vs_sampler_mean": float((r3 - sampler)[mask].abs().mean()),
            "r3_vs_sampler_max": float((r3 - sampler)[mask].abs().max()),
            "free_vs_sampler_mean": float((free - sampler)[mask].abs().mean()),
            "free_vs_sampler_max": float((free - sampler)[mask].abs().max()),
            "tokens": int(mask.sum()),
        }
    (outdir / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    learner.close(process_group=True)

"""Issue 28: three steps of `megagrpo train configs/demo_qwen3_moe.yaml` on one GPU, colocated, through the
user's command line (`python -m megagrpo.cli train CONFIG key=value ...`), with dotted overrides for a tiny
run: the tiny Qwen3-MoE (`hf_moe_sglang`), 4 prompts x 4 completions of at most 12 tokens, and a reward that
varies on a random model (the completion's parity; the demo's exact match scores 0 everywhere, so every
group would be dropped and no step would train).

What the run shows: three steps with finite metrics, a weight sync in each step, and the learner
offloaded while the engine samples. The trainer records no metric of the offload, so the command runs
under a small observer (`OBSERVER`, which then calls `megagrpo.cli.main` with the same arguments): it
writes one line per `Learner.offload` (the host bytes taken) and per `RolloutEngine.generate` (the
device bytes the learner still owns at that moment, which must be 0).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
PHASES_ENV = "MEGAGRPO_TEST_PHASES"

OBSERVER = r"""
import json, os, sys
import torch
from megagrpo.learner.learner import Learner
from megagrpo.rollout.engines.engine import RolloutEngine

learners = []
log = open(os.environ["MEGAGRPO_TEST_PHASES"], "a")


def record(event, **fields):
    log.write(json.dumps({"event": event, **fields}) + "\n")
    log.flush()


def owned(learner):
    return sum(st.nbytes() for st in learner._device_storages().values())


init, offload, reload, generate = Learner.__init__, Learner.offload, Learner.reload, RolloutEngine.generate


def observed_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    learners.append(self)


def observed_offload(self):
    before = owned(self)
    offload(self)
    record("offload", owned_before=before, host_bytes=sum(h.numel() for _, h in self._offloaded),
           offloaded=self.offloaded)


def observed_reload(self):
    reload(self)
    record("reload", owned=owned(self))


def observed_generate(self, *args, **kwargs):
    record("generate", learners_offloaded=[lr.offloaded for lr in learners],
           learners_owned=[owned(lr) for lr in learners])
    return generate(self, *args, **kwargs)


Learner.__init__, Learner.offload, Learner.reload = observed_init, observed_offload, observed_reload
RolloutEngine.generate = observed_generate
from megagrpo.cli import main

sys.exit(main(sys.argv[1:]))
"""


def overrides(model: Path, tmp: Path) -> list[str]:
    """The demo config made tiny: every size a step touches, and the output paths."""
    parity = "[{name: 'tests.integration.trainer_rewards:output_parity', weight: 1.0}]"
    return [
        f"model.hf_path={model}",
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "rollout.mem_fraction_static=0.15",
        "rollout.max_total_tokens=65536",
        f"rewards.functions={parity}",
        "data.synthetic.num_train=64",
        "data.synthetic.num_eval=8",
        f"schedule.steps={STEPS}",
        "schedule.micro_batch_size=8",
        "schedule.eval_every=0",
        "schedule.save_every=0",
        f"checkpoint.dir={tmp / 'ckpt'}",
        f"logging.out_dir={tmp / 'run'}",
    ]


def run_train(model: Path, tmp: Path, timeout: float = 220) -> tuple[subprocess.CompletedProcess, Path]:
    """The command, within the tier's per-test limit (tests/gpu/run_tier.sh: 240 s)."""
    phases = tmp / "phases.jsonl"
    # the repository first (the test's reward function); a bundle's own PYTHONPATH entries stay behind it
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, PHASES_ENV: str(phases)}
    args = ["train", str(REPO / "configs" / "demo_qwen3_moe.yaml"), *overrides(model, tmp)]
    res = subprocess.run(
        [sys.executable, "-c", OBSERVER, *args], cwd=REPO, env=env, text=True, capture_output=True,
        timeout=timeout,
    )  # fmt: skip
    return res, phases


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def param_count(model: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                n += math.prod(st.get_slice(k).get_shape())
    return n


def test_three_colocated_steps_through_the_cli(hf_moe_sglang, tmp_path):
    res, phases = run_train(hf_moe_sglang, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "engine 0 of 1: rank 0" in out and "first GPU 0" in out, out[-4000:]

    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), [r["step"] for r in steps]
    params = param_count(hf_moe_sglang)
    for r in steps:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (r["step"], bad)
        assert r["rollout/skipped_step"] == 0.0, r["step"]
        assert r["loss/tokens"] > 0, r["step"]
        # every step ends with a sync of the whole model (fp32 learner: 4 bytes a parameter)
        assert r["sync/bytes"] == 4 * params and r["sync/seconds"] > 0, (r["step"], r["sync/bytes"], params)

    events = read_jsonl(phases)
    offloads = [e for e in events if e["event"] == "offload" and e["owned_before"] > 0]
    gens = [e for e in events if e["event"] == "generate"]
    # start (before the engine sizes itself) and each step's sampler phase; the last one may not sample again
    assert len(offloads) >= STEPS + 1, events
    assert all(e["offloaded"] and e["host_bytes"] >= e["owned_before"] for e in offloads), offloads
    # the learner's device storages (params, grads, fp32 main copies, Adam) at least: 4 + 4 + 4 + 8 bytes
    assert offloads[0]["host_bytes"] >= 16 * params, (offloads[0], params)
    assert len(gens) >= STEPS, events
    for e in gens:
        assert e["learners_offloaded"] == [True] and e["learners_owned"] == [0], e
    reloads = [e for e in events if e["event"] == "reload"]
    assert len(reloads) >= STEPS and all(e["owned"] > 0 for e in reloads), reloads
    print(
        f"train: {STEPS} steps, sync {[r['sync/bytes'] for r in steps]} B in "
        f"{[round(r['sync/seconds'], 3) for r in steps]} s; offloads {len(offloads)} "
        f"({offloads[0]['host_bytes'] / 2**20:.1f} MiB to host), generate calls {len(gens)}, all with the "
        f"learner off the device; step seconds {[round(r['perf/step_seconds'], 1) for r in steps]}"
    )

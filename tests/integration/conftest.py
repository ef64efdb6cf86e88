"""SGLang engine fixtures shared by the integration tests (one engine start per session: starts take 35-200 s).

`sglang_engine`: a running `RolloutEngine` (CPU, fp32) on the tiny Qwen3-MoE from `tiny_model`, started once
per session and shut down by the fixture, which then asserts that none of its processes outlived it.
Tests that change the engine's weights must put the original weights back (see `sglang_reference`).
`sglang_hits_dir`: where the engine's subprocesses record which CPU-compat patches they hit.
`family_engine`: one engine per DeepSeek-V3-shaped family (`FAMILY_MODELS`), parametrised: pytest runs every
test of one family before it starts the next (a session fixture's parameters are grouped), so each family
costs one engine start, shared by the tests of every engine file. Tests that change its weights put them back.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import torch

# moe_intermediate 20 is no multiple of 32, so SGLang's CPU engine pads it (w13_weight (8, 64, 64) where the
# checkpoint gives (8, 40, 64)): every engine test, and every weight sync of one, runs on padded expert
# parameters (issue 37); the unpadded packed sync is covered by every trainer test.
ENGINE_MODEL = dict(arch="qwen3_moe", experts=8, topk=2, moe_intermediate=20)
# MLA with DeepSeek-V3's q latent (whose down projection SGLang fuses with kv_a_proj_with_mqa at load, so
# the sync's fused-group guarantee is proven on a real engine), plain rope (rope_scaling null, as Moonlight
# ships it) and the config.json transformers' DeepseekV3Config writes, without the router fields SGLang
# reads (issue 43; Moonlight's null q latent and DeepSeek-V3's YaRN are served in test_trainer_e2e's family
# run); and GLM-4.5's partial rotary, q/k/v biases and q/k norms; both with a sigmoid router, a correction
# bias, group-limited top-k, a shared expert and a dense first layer.
FAMILY_MODELS = {
    "deepseek_v3": dict(arch="deepseek_v3", yarn=False),
    "glm4_moe": dict(arch="glm4_moe"),
}


@pytest.fixture(scope="session")
def sglang_hits_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang_compat_hits")


@pytest.fixture(scope="session")
def sglang_model_dir(tiny_model):
    return tiny_model(**ENGINE_MODEL)


@pytest.fixture(scope="session")
def sglang_engine(sglang_model_dir, sglang_hits_dir):
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from megagrpo.compat.sglang_cpu import HITS_DIR_ENV
    from megagrpo.rollout import RolloutConfig, RolloutEngine

    os.environ[HITS_DIR_ENV] = str(sglang_hits_dir)
    cfg = RolloutConfig(str(sglang_model_dir), dtype="float32", max_total_tokens=4096, seed=0)
    engine = RolloutEngine(cfg)
    try:
        engine.start()
    finally:
        os.environ.pop(HITS_DIR_ENV, None)
    yield engine
    pids = engine.pids
    engine.shutdown()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"SGLang processes outlived the engine fixture: {alive}"


def _start_engine(model_dir):
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from megagrpo.rollout import RolloutConfig, RolloutEngine

    cfg = RolloutConfig(str(model_dir), dtype="float32", max_total_tokens=4096, seed=0)
    return RolloutEngine(cfg).start()


class FamilyEngine:
    """A running engine of one family, its model directory, its transformers reference (fp32, eval) and
    where its subprocesses record the CPU-compat patches they hit."""

    def __init__(self, family, model_dir, engine, reference, hits_dir):
        self.family, self.model_dir, self.engine, self.reference = family, model_dir, engine, reference
        self.hits_dir = hits_dir


@pytest.fixture(scope="session", params=sorted(FAMILY_MODELS))
def family_engine(request, tiny_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megagrpo.compat.sglang_cpu import HITS_DIR_ENV

    model_dir = tiny_model(**FAMILY_MODELS[request.param])
    # SIGQUIT has one handler per process and an engine's start takes it over (rollout.engines.engine, "SIGQUIT");
    # the session engine's is put back, which tests of that engine check (one engine per trainer process).
    session_handler = signal.getsignal(signal.SIGQUIT)
    hits_dir = tmp_path_factory.mktemp(f"{request.param}_compat_hits")
    os.environ[HITS_DIR_ENV] = str(hits_dir)
    try:
        engine = _start_engine(model_dir)
    finally:
        os.environ.pop(HITS_DIR_ENV, None)
    signal.signal(signal.SIGQUIT, session_handler)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield FamilyEngine(request.param, model_dir, engine, reference, hits_dir)
    pids = engine.pids
    engine.shutdown()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"SGLang processes outlived the family engine: {alive}"


@pytest.fixture(scope="session")
def hf_reference(sglang_model_dir):
    """The same tiny model in transformers (fp32, eval), the reference for logprobs and routes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sglang_model_dir, dtype=torch.float32)
    return model.eval()

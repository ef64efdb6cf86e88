"""A second engine: started by a context manager, generates, and is cleaned up when the body raises."""

from __future__ import annotations

import psutil
import pytest

from megagrpo.rollout import RolloutConfig, RolloutEngine, SamplingConfig


def test_context_manager_cleans_up_on_exception(sglang_model_dir):
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    unrelated = psutil.Popen(["sleep", "300"])  # a child of this process that is not the engine's
    try:
        cfg = RolloutConfig(
            str(sglang_model_dir), dtype="bfloat16", max_total_tokens=2048, return_routes=False
        )
        with pytest.raises(KeyError, match="boom"), RolloutEngine(cfg) as engine:
            pids = engine.pids
            (c,) = engine.generate([[5, 6, 7]], SamplingConfig(max_new_tokens=3, ignore_eos=True))[0]
            assert c.output_ids.numel() == 3 and c.routes is None
            raise KeyError("boom")
        gone = [
            p for p in pids if not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
        ]
        assert gone == pids
        assert unrelated.is_running() and unrelated.status() != psutil.STATUS_ZOMBIE
    finally:
        unrelated.kill()
        unrelated.wait()

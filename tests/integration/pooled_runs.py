"""Run several `megagrpo train` configs one after the other in ONE process (argv: `config[:resume]`...).

Tests that compare whole runs (async rollout against colocated, KL in the reward against none) run them
here: sharing the process saves each run after the first the import of megatron-core and SGLang, and
runs with the same engine settings share one pooled SGLang engine (`EnginePool`: each run gets it back
with its own initial weights, as a fresh engine would load them). A pooled engine keeps the placement of
the run that started it (`rollout.placement.engine_cores`). Each run is the CLI's own path
(`trainer.entry.run`). With `tests.integration.trainer_rewards:recorded_parity` as a reward, each run's
completions are written to `samples/` beside its config.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megagrpo.config.loader import load_config
from megagrpo.trainer.entry import run


def run_pooled(*runs: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """This script on `runs` (each `config[:resume]`) in a fresh process; output captured."""
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *runs],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def main(argv: list[str]) -> int:
    import megagrpo.rollout.engines.engine as engine_module
    from megagrpo.compat import apply_cpu_compat
    from tests.integration.engine_pool import EnginePool

    apply_cpu_compat(megatron=True, sglang=True)
    pool = EnginePool()
    engine_module.RolloutEngine = pool
    try:
        for arg in argv:
            path, _, resume = arg.partition(":")
            record = Path(path).parent / "samples"
            record.mkdir(exist_ok=True)
            os.environ["MEGAGRPO_TEST_RECORD_DIR"] = str(record)
            code = run("train", load_config(path), resume=resume or None)
            if code:
                return code
    finally:
        pool.drop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

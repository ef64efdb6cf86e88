"""`python -m tests.integration.sigterm_in_generate {train,sft,eval} CONFIG ...`: `megagrpo.launch.run`, with
one SIGTERM sent to this process while the first engine request is in flight (its first batch of outputs
is being handled). A deterministic preemption inside the window where SGLang arms its own SIGTERM handling
(issue 25, item 1); used by tests/integration/test_trainer_e2e.py.
"""

from __future__ import annotations

import os
import signal
import sys


def sigterm_at_first_output() -> None:
    """Wrap `RolloutEngine.start` so that the engine's tokenizer manager, once started (after megagrpo's
    CPU compat and SGLang's imports), signals this process at its first output."""
    from megagrpo.rollout.engines.engine import RolloutEngine

    start = RolloutEngine.start

    def start_then_arm(self: RolloutEngine) -> RolloutEngine:
        start(self)
        tm_class = type(self.engine.tokenizer_manager)
        handle = tm_class._handle_batch_output

        async def first_output_sigterm(tm, recv_obj):
            tm_class._handle_batch_output = handle  # once
            print("sigterm_in_generate: SIGTERM during the first engine request", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return await handle(tm, recv_obj)

        tm_class._handle_batch_output = first_output_sigterm
        return self

    RolloutEngine.start = start_then_arm


if __name__ == "__main__":
    sigterm_at_first_output()
    from megagrpo.launch.run import main

    sys.exit(main())

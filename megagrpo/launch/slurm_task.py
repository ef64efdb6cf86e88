"""Per-task wrapper under srun in the sbatch scripts: `python -m megagrpo.launch.slurm_task CMD ARGS...`.

It ignores SIGUSR1, exports torchrun's node rank and execs CMD. An ignored signal stays ignored across
exec, so a step-wide `scancel --signal=USR1` does not kill torchrun or the SGLang subprocesses a rank
starts; the trainer installs its own SIGUSR1 handler when its loop starts (`megagrpo.trainer.signals`),
and the batch script's stop file reaches it through `megagrpo.launch.bootstrap`.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m megagrpo.launch.slurm_task CMD [ARGS...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # Python ignores these two itself; CMD gets the defaults a shell would give it.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    # torchrun reads --node-rank from PET_NODE_RANK; under srun it is this task's node index.
    os.environ["PET_NODE_RANK"] = os.environ.get("SLURM_NODEID", "0")
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())

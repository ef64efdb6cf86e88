#!/usr/bin/env python
"""Per-process entry point under torchrun, srun or mpirun: `python launch/run.py {train,sft,eval} CONFIG ...`.

Rank, world size and local rank are read from the launcher's variables by
`megagrpo.learner.mesh.DistEnv.from_environ()` (the one code path for torchrun, Slurm and Open MPI); this
file makes the repository importable, sets up the Slurm stop-file path (launch/bootstrap.py) and hands
over to the CLI, which validates the config first.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch.bootstrap import ignore_step_signals, mark_requeue, watch_stop_file  # noqa: E402


def main(argv: list[str]) -> int:
    ignore_step_signals()
    watch_stop_file()
    from megagrpo.cli import main as cli_main
    from megagrpo.trainer.signals import REQUEUE_EXIT_CODE

    code = cli_main(argv)
    mark_requeue(code, REQUEUE_EXIT_CODE)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Per-process entry under torchrun, srun or mpirun:

    python -m megagrpo.launch.run {train,sft,eval} CONFIG [overrides] [--resume ...]

Rank, world size and local rank are read from the launcher's variables by
`megagrpo.learner.mesh.DistEnv.from_environ()` (the one code path for torchrun, Slurm and Open MPI); this
module sets up the Slurm stop-file path (`megagrpo.launch.bootstrap`) and hands over to the CLI, which
validates the config first.
"""

from __future__ import annotations

import sys

from megagrpo.launch.bootstrap import ignore_step_signals, mark_requeue, watch_stop_file


def main(argv: list[str] | None = None) -> int:
    ignore_step_signals()
    watch_stop_file()
    from megagrpo.cli import main as cli_main
    from megagrpo.trainer.signals import REQUEUE_EXIT_CODE

    code = cli_main(list(sys.argv[1:] if argv is None else argv))
    mark_requeue(code, REQUEUE_EXIT_CODE)
    return code


if __name__ == "__main__":
    sys.exit(main())

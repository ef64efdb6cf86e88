#!/usr/bin/env python
"""Per-process entry point under torchrun, srun or mpirun: `python launch/run.py {train,sft,eval} CONFIG ...`.

Rank, world size and local rank are read from the launcher's variables by
`megagrpo.learner.mesh.DistEnv.from_environ()` (the one code path for torchrun, Slurm and Open MPI); this
file only makes the repository importable and hands over to the CLI, which validates the config first.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megagrpo.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

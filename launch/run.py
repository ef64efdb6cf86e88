#!/usr/bin/env python
"""Per-process entry under torchrun, srun or mpirun: `python launch/run.py {train,sft,eval} CONFIG ...`.

The same as `python -m megagrpo.launch.run ...` (the form `megagrpo train --nproc` and the sbatch scripts
use); the logic is megagrpo/launch/run.py.
"""

import sys

from megagrpo.launch.run import main

if __name__ == "__main__":
    sys.exit(main())

#!/bin/bash
# Per-task wrapper under srun (slurm/*.sbatch): ignore SIGUSR1, then exec the launcher.
# An ignored signal stays ignored across exec, so a step-wide `scancel --signal=USR1` does not kill torchrun
# or the SGLang subprocesses a rank starts; the trainer installs its own SIGUSR1 handler when its loop
# starts (megagrpo.trainer.signals), and the batch script's stop file reaches it through launch/bootstrap.py.
trap '' USR1
# torchrun reads --node-rank from PET_NODE_RANK; under srun it is this task's node index.
export PET_NODE_RANK=${SLURM_NODEID:-0}
exec "$@"

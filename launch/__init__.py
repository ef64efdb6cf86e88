"""Process entry points under torchrun, srun and mpirun (run.py) and their Slurm bootstrap (bootstrap.py)."""

"""Process entry points: the per-rank entry under torchrun, srun and mpirun (`run`), its Slurm bootstrap
(`bootstrap`: stop file and requeue marker), the per-task wrapper of the sbatch scripts (`slurm_task`) and
the distributed bring-up check (`mesh_check`). Each runs as `python -m megagrpo.launch.<name>`; launch/*.py
in the repository are thin scripts calling the same `main`."""

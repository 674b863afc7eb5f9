"""Slurm's commands (sbatch, srun, squeue, scancel, sinfo, scontrol, sacct) over Phalanx's client.

Each command is a thin front end: it parses Slurm's options, calls the same :class:`Client` as
``phalanx``, and prints what Slurm 22.05+ prints where tools parse it (submitit, dask-jobqueue,
Snakemake, Nextflow, exporters).  One multi-call entry point (:func:`phalanx.slurm.main.main`)
dispatches on the name it was called by, and each command also has a console script of its own.
"""

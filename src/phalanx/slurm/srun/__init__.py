"""`srun` and the pieces it runs inside a job.

`command` is the full srun (allocations, steps, I/O); `thin` the thin one that hands a step to
the job's resident helper (`helper`, one per job per node) and imports built-ins only, so it
must stay free of imports here; `full` is what the compiled thin srun (`thin.c`, built by the
agent: agent/native_srun.py) execs when the helper cannot take a step; `push` hands signed
launches straight to the nodes' agents; `pty_relay` is `srun --pty`'s terminal side.
"""

"""Launching the ranks of a run.

- :mod:`~detscale.cluster.torchrun`: one node: GPU slots claimed with file locks, a rendezvous
  port, ``torchrun`` as a child process (``detscale launch``);
- :mod:`~detscale.cluster.slurm`: inside a Slurm allocation: what Slurm gave the job, and the one
  multi-node command (``srun`` with a ``torchrun`` agent per node);
- :mod:`~detscale.cluster.slurmfit`: the workflow's start-up check of every job's ask against its
  partition (``detscale slurm check``);
- :mod:`~detscale.cluster.signals`: the one place where SIGTERM/SIGINT become exit codes
  (:data:`~detscale.errors.EXIT_PREEMPTED`, :data:`~detscale.errors.EXIT_INTERRUPTED`).
"""

"""The sections of the GPU acceptance kit, one module each; ``benchmarks/gpu_check.py`` runs them.

The entry script puts ``src/`` and the carried wheels on the path before it imports a section,
so the section modules import detscale and torch at their top like any other code. This module
imports nothing: the entry script reads the section names before the paths are set.
"""

#: The kit's sections, in the order they run.
SECTIONS = ("env", "models", "data", "launch", "nccl", "ddp", "loader", "throughput", "compile", "profile")
#: The sections that need the ``data`` section's datasets.
NEEDS_DATA = frozenset({"launch", "nccl", "ddp", "loader", "throughput", "compile", "profile"})

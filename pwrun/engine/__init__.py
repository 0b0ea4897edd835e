"""The serving engine (SPEC sections 3, 5, 6): ``LLMEngine`` = engine core + model runner, its build, summary, trace."""

import os

# cuBLAS takes a workspace per (handle, stream) from the device memory the budget covers; 32 MiB each on
# Hopper by default. 4 MiB is plenty for decode-sized GEMMs and is what ``budget.py`` accounts for
# (a value set by the user wins).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:1")

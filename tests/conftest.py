import os

# One intra-op thread per process: multi-process tests put up to four ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

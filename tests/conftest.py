import os

# One intra-op thread per process: on 2-core machines two threads are 5-10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

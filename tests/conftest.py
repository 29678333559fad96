import os

from hypothesis import settings

# One intra-op thread per process: on 2-core machines two threads are 5-10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The property tests draw the same examples on every run, so that a red run means the change under
# test; HYPOTHESIS_PROFILE=explore draws new ones on each run, to look for cases no run has met (a
# case found is pinned with @example).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

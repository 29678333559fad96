import importlib.util
import os

import pytest
from hypothesis import settings

from sapp_hook.hook.relaunch import ENVIRONMENT

# One intra-op thread per process: on 2-core machines two threads are 5-10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The property tests draw the same examples on every run, so that a red run means the change under
# test; HYPOTHESIS_PROFILE=explore draws new ones on each run, to look for cases no run has met (a
# case found is pinned with @example).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _no_plan_cache_or_launcher_settings_from_outside(tmp_path_factory, monkeypatch):
    """Every test starts from an empty plan cache of its own, and none of `sapp-hook run`'s settings:
    a plan cached by an earlier run (in ~/.cache/sapp-hook) would be reused instead of solved."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    for variable in ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture(autouse=True)
def _no_installed_torchtitan(monkeypatch):
    """The write-back tests say where a TorchTitan source is: the one installed for the trainer tests
    (which run it in processes of their own) would answer for it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "torchtitan" else real(name, *args)
    )

"""The gloo group of a spawned rank ends at its close, even when the rank builds a transformers model."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch.multiprocessing as mp
from profiler_cases import llama

from sapp_hook.gloo import gloo_group


def rank_threads(rank: int, store: str, folder: str) -> None:
    with gloo_group(rank, 2, store):
        llama()  # transformers imports FSDP, and with it torch.distributed.nn.functional, on first build
    gc.collect()
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    Path(folder, f"threads{rank}.json").write_text(json.dumps(names))


def test_the_group_and_its_gloo_threads_are_gone_after_the_block(tmp_path):
    # A group that outlives its block is torn down with the interpreter, which aborts a rank now and then.
    mp.spawn(rank_threads, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        names = json.loads((tmp_path / f"threads{rank}.json").read_text())
        assert names and not [name for name in names if "gloo" in name]

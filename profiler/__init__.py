"""Per-layer measurement of a PyTorch model in real training steps.

`LayerProfiler` attaches to a model (and its optimizer), records the steps the user runs and returns a
`solver.ModelProfile`: each layer's forward and backward time, the activation bytes it keeps for backward
under each recompute mode and what that mode costs, and its parameter, gradient and optimizer bytes.
`find_blocks` finds the body layers; `gather_profiles` joins the profiles ranks took of their own layers;
`analytic` estimates a profile from a model config without torch or hardware.
"""

from __future__ import annotations

from typing import Any

# Imported on first use, so that `profiler.estimate.analytic` works where torch is not installed.
_EXPORTS = {
    "Block": "profiler.layers",
    "LayerProfiler": "profiler.measure.layer_profiler",
    "find_blocks": "profiler.layers",
    "gather_profiles": "profiler.distributed",
    "analytic_profile": "profiler.estimate.analytic",
    "shape_from_config": "profiler.estimate.analytic",
    "TransformerShape": "profiler.estimate.analytic",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'profiler' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)

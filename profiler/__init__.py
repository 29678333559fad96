"""Per-layer measurement of a PyTorch model in real training steps.

`LayerProfiler` attaches to a model (and its optimizer), records the steps the user runs and returns a
`solver.ModelProfile`: each layer's forward and backward time, the activation bytes it keeps for backward
under each recompute mode and what that mode costs, and its parameter, gradient and optimizer bytes.
`find_blocks` finds the body layers; `gather_profiles` joins the profiles ranks took of their own layers.
"""

from profiler.layer_profiler import LayerProfiler
from profiler.layers import Block, find_blocks

__all__ = ["Block", "LayerProfiler", "find_blocks"]

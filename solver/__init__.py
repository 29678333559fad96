"""The cost vocabulary (ModelProfile, PipelineSpec, Plan) and the search for the best Plan.

Will hold: the fastest layer-to-stage split and per-layer recompute that fits the memory budget,
checked in `simulator`. Never imports torch.
"""

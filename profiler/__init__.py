"""Per-layer measurement of a PyTorch model in real training steps.

Will hold: finding the head, body and tail layers; forward/backward time, activation, parameter,
gradient and optimizer memory per layer and per recompute mode; and filling a `solver.ModelProfile`.
"""

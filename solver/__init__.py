"""The cost vocabulary (ModelProfile, PipelineSpec, Plan) and the search for the best Plan.

The fastest layer-to-stage split and per-layer recompute that fit the memory budget, as the
simulator times them. Never imports torch.
"""

from solver.errors import InfeasibleError
from solver.evaluate import evaluate_plan, even_plan, plan_from_dict, plan_from_mindformers
from solver.load import load_profile
from solver.plan import Plan
from solver.profile import RECOMPUTE_MODES, LayerProfile, ModelProfile, RecomputeCost
from solver.sapp import profile_from_sapp
from solver.search import solve
from solver.spec import PipelineSpec

__all__ = [
    "RECOMPUTE_MODES",
    "InfeasibleError",
    "LayerProfile",
    "ModelProfile",
    "PipelineSpec",
    "Plan",
    "RecomputeCost",
    "evaluate_plan",
    "even_plan",
    "load_profile",
    "plan_from_dict",
    "plan_from_mindformers",
    "profile_from_sapp",
    "solve",
]

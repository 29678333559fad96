"""The cost vocabulary (ModelProfile, PipelineSpec, Plan) and the search for the best Plan.

The fastest layer-to-stage split and per-layer recompute that fit the memory budget, as the
simulator times them. Never imports torch.
"""

from solver.errors import InfeasibleError
from solver.evaluate import evaluate_plan, even_plan, plan_from_dict, plan_from_mindformers
from solver.formats.sapp import profile_from_sapp
from solver.program.search import solve
from solver.vocabulary.load import load_profile
from solver.vocabulary.plan import Plan
from solver.vocabulary.profile import RECOMPUTE_MODES, LayerProfile, ModelProfile, RecomputeCost
from solver.vocabulary.spec import PipelineSpec

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

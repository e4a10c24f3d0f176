"""The roofline planner (seed paper 000): measure or model the hardware, fit P(x) and AAT(x),
and choose autoregressive decoding or the tree size x per context length.

Importing it registers the methods `auto` and `prior` in the method registry (specwood.methods),
the measured configuration choice that `--backend auto` loads (specwood.planner.configs), and the
search for SpecPipe's tree width that `--width auto` runs (specwood.planner.pipeline_sim).
"""
from specwood.engine.specpipe.launch import register_width_planner
from specwood.planner.fits import DEFAULT_AAT, AATFit, RooflineFit, fit_aat, fit_roofline
from specwood.planner.analytic import build_analytic_plan
from specwood.planner.auto import PlannedShape
from specwood.planner.build import build_plan, get_plan
from specwood.planner.calibration import CALIBRATION_PROMPTS
from specwood.planner.configs import choose_config, load_config_choice
from specwood.planner.decision import Decision, decide
from specwood.planner.pipeline_sim import choose_width
from specwood.planner.starter import starter_plan
from specwood.planner.store import (
    SCHEMA_VERSION,
    BucketChoice,
    Plan,
    PlanKey,
    PlanWarning,
    load_plan,
    plan_key_for,
    save_plan,
)

register_width_planner(choose_width)

__all__ = [
    "AATFit",
    "BucketChoice",
    "CALIBRATION_PROMPTS",
    "DEFAULT_AAT",
    "Decision",
    "Plan",
    "PlanKey",
    "PlanWarning",
    "PlannedShape",
    "RooflineFit",
    "SCHEMA_VERSION",
    "build_analytic_plan",
    "build_plan",
    "choose_config",
    "decide",
    "fit_aat",
    "fit_roofline",
    "get_plan",
    "load_config_choice",
    "load_plan",
    "plan_key_for",
    "starter_plan",
    "save_plan",
]

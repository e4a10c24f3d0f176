"""The roofline planner (seed paper 000): measure or model the hardware, fit P(x) and AAT(x),
and choose autoregressive decoding or the tree size x per context length.

Engine entry points:
    auto_components(engine, options)  -> (source, PlannedShape) or None (= use "ar")
    prior_components(engine, options) -> (source, LayoutShape of the best prior-score tree)
"""
from specwood.planner.fits import DEFAULT_AAT, AATFit, RooflineFit, fit_aat, fit_roofline
from specwood.planner.plan import (
    CALIBRATION_PROMPTS,
    SCHEMA_VERSION,
    BucketChoice,
    Decision,
    Plan,
    PlanKey,
    PlannedShape,
    PlanWarning,
    auto_components,
    build_analytic_plan,
    build_plan,
    decide,
    get_plan,
    load_plan,
    plan_key_for,
    prior_components,
    save_plan,
)

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
    "auto_components",
    "build_analytic_plan",
    "build_plan",
    "decide",
    "fit_aat",
    "fit_roofline",
    "get_plan",
    "load_plan",
    "plan_key_for",
    "prior_components",
    "save_plan",
]

"""Plans for hardware we do not have: predicted from a device model and model shapes only
(build_analytic_plan), with AAT(x) from a stored measured plan when there is one.
"""
from __future__ import annotations

import datetime as _dt
from typing import TYPE_CHECKING, Sequence

from specwood.planner.fits import DEFAULT_AAT, AATFit
from specwood.planner.store import DEFAULT_METHOD, Plan, PlanKey, list_plans

if TYPE_CHECKING:
    from specwood.models.config import ModelConfig
    from specwood.planner.devices import DeviceModel

WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "auto": 2.0, "fp32": 4.0, "int8": 1.0, "int4": 0.5, "q4": 0.64,
                "q4-lite": 0.578}


def stored_aat(target: str, draft: str, method: str) -> tuple[AATFit, str] | None:
    """The AAT fit of the newest measured local plan for this target/draft/method, if any."""
    found = [p for p in list_plans() if p.source == "measured" and p.key.target == target
             and p.key.draft == draft and p.key.method == method and p.aat.n_points >= 2]
    if not found:
        return None
    newest = max(found, key=lambda p: p.created)
    return newest.aat, f"AAT from the measured plan of {newest.key.device} ({newest.created})"


def build_analytic_plan(device: "str | DeviceModel", target: str, draft: str | None = None, *,
                        method: str = DEFAULT_METHOD,
                        dtype: str = "bf16", contexts: Sequence[int] = (128, 512, 2048), aat: AATFit | None = None,
                        x_max: int = 128, target_config: "ModelConfig | None" = None,
                        draft_config: "ModelConfig | None" = None) -> Plan:
    """Predict a plan from a device model and model shapes only (no weights, no hardware).

    draft None: the default for the target (same-family small model, else a one-layer draft);
    "none": no draft cost (e.g. pld). `target_config`/`draft_config` give the shapes directly (a
    loaded engine's models), instead of resolving the names. AAT: `aat`, else one measured with a stored local plan of
    the same target/draft/method, else DEFAULT_AAT.
    """
    from specwood.planner.devices import DeviceModel, default_draft_name, get_device, resolve_config

    model = device if isinstance(device, DeviceModel) else get_device(device, dtype)
    tcfg = target_config or resolve_config(target)
    draft_name = default_draft_name(target) if draft in (None, "auto") else draft
    dcfg = None if draft_name == "none" else draft_config or resolve_config(draft_name, tcfg)
    notes = [f"analytic: {model.name} ({model.note}); peak {model.peak_flops / 1e12:.2f} TFLOP/s, "
             f"{model.mem_bw / 1e9:.0f} GB/s; compute/bandwidth ridge ~{model.ridge_tokens:.0f} tokens",
             f"target {tcfg.name or target} ({tcfg.n_params / 1e9:.2f} B params), draft "
             f"{(dcfg.name if dcfg else 'none')} ({(dcfg.n_params / 1e9 if dcfg else 0):.3f} B params)",
             "x = verification length (tree tokens incl. root); budget = x - 1 drafted nodes"]
    if aat is None:
        found = stored_aat(target, draft_name, method)
        if found is not None:
            aat, why = found
            notes.append(why)
        else:
            aat = DEFAULT_AAT
            notes.append(f"assumed AAT(x) = {aat.A} + {aat.B} ln(x - {aat.C}) (default typical curve)")
    else:
        notes.append(f"given AAT(x) = {aat.A:.3g} + {aat.B:.3g} ln(x - {aat.C:.3g})")
    from specwood.planner.devices import analytic_tables

    weight_bytes = WEIGHT_BYTES.get(dtype, 2.0)
    tv, td = analytic_tables(model, tcfg, dcfg, method, contexts, x_max, weight_bytes)
    plan = Plan(key=PlanKey(f"model:{model.name}", target, draft_name, dtype, method), contexts=list(contexts),
                verify_times=tv, draft_times=td, aat=aat, source="analytic", mode="analytic", notes=notes,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    return plan.refresh()

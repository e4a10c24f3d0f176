"""Step times of the default pair's architecture on a GPU, and what they mean for speculation.

Model weights cannot reach a lent GPU machine (no network there), so this builds the default
target and draft with their REAL configs (read from the shipped GGUF headers here, or from JSON
files written by `--dump-configs`) and random weights. Speed does not depend on the weights;
acceptance does, so the SD figures are projections: the per-step time measured on the GPU with
the real tree sizes, times the acceptance AAT(x) measured on the real weights (the AAT fit of a
stored CPU plan, `--plan`). The AR figure is a real measurement.

    python benchmarks/gpu_steps.py --dump-configs .gpu                # here: write target/draft json
    python benchmarks/gpu_steps.py --configs .gpu --tokenizer .gpu/tokenizer --plan .gpu/plan_cpu.json \
        --device cuda --out $OUT                                      # on the GPU machine
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specwood.engine.api import Engine
from specwood.models.config import ModelConfig
from specwood.models.testing import random_state_dict
from specwood.models.transformer import build_model
from specwood.planner.fits import AATFit
from specwood.planner.profiler import measure_verify_times

NAMES = {"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct"}


def dump_configs(folder: Path) -> None:
    from specwood.models.gguf_file import config_from_gguf, read_gguf_header
    from specwood.models.registry import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    for role, name in NAMES.items():
        cfg = config_from_gguf(read_gguf_header(resolve_model(name)))
        (folder / f"{role}.json").write_text(json.dumps(dataclasses.asdict(cfg)))


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype, seed: int, max_positions: int):
    sd = random_state_dict(cfg, seed=seed, dtype=dtype)
    return build_model(cfg, sd, dtype, device, max_positions=max_positions)


def timed_generate(engine: Engine, prompt: list[int], tokens: int, repeats: int, **kw) -> dict:
    """Median decode tok/s and seconds per step over `repeats` runs (one warm-up run first)."""
    engine.generate(prompt, max_tokens=8, **kw)
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        r = engine.generate(prompt, max_tokens=tokens, **kw)
        s = r.stats
        steps = s.get("spec_steps") or max(s["new_tokens"] - 1, 1)
        decode_s = s["total_s"] - s["ttft_s"]
        runs.append({"tok_s": s["tokens_per_s"], "step_ms": 1000 * decode_s / steps, "ttft_ms": 1000 * s["ttft_s"]})
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump-configs", type=Path, help="write target.json/draft.json from the shipped GGUFs and exit")
    ap.add_argument("--configs", type=Path, default=Path(".gpu"))
    ap.add_argument("--tokenizer", type=Path, default=Path(".gpu/tokenizer"))
    ap.add_argument("--plan", type=Path, help="a stored plan whose AAT fit (real weights) projects SD tok/s")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--xs", default="4,8,16,32,64", help="tree sizes (tokens verified per step)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="eager,graphs", help="eager and/or graphs (CUDA graphs for decode steps)")
    ap.add_argument("--head-shapes", default="chain:4,eagle",
                    help="feature-level draft head steps to time (SHAPE[:DEPTH], an untrained head of the trainer's "
                         "default size); empty: none")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.dump_configs:
        dump_configs(a.dump_configs)
        return 0
    from transformers import AutoTokenizer

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    cfgs = {role: ModelConfig(**json.loads((a.configs / f"{role}.json").read_text())) for role in NAMES}
    positions = 4096
    t0 = time.perf_counter()
    target = random_model(cfgs["target"], a.device, dtype, 1, positions)
    draft = random_model(cfgs["draft"], a.device, dtype, 2, positions)
    print(f"built target ({cfgs['target'].n_layers} layers) and draft on {a.device} in {time.perf_counter() - t0:.1f}s",
          flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(a.tokenizer))
    g = torch.Generator().manual_seed(0)
    vocab = cfgs["target"].vocab_size
    prompt = torch.randint(min(1000, vocab // 2), min(100_000, vocab), (a.prompt_tokens,), generator=g).tolist()
    device_name = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    result: dict = {"device": device_name, "torch": torch.__version__, "dtype": a.dtype, "tokens": a.tokens,
                    "prompt_tokens": a.prompt_tokens}
    xs = [int(x) for x in a.xs.split(",")]
    tv = measure_verify_times(target, xs=[1] + xs, contexts=(a.prompt_tokens,), repeats=10, refine=False,
                              progress=False)[a.prompt_tokens]
    result["t_v_ms_eager"] = {x: 1000 * t for x, t in sorted(tv.items())}
    print("eager T_v(x)/T_v(1): " + ", ".join(f"{x}:{t / tv[1]:.2f}" for x, t in sorted(tv.items())), flush=True)
    aat = AATFit.from_dict(json.loads(a.plan.read_text())["aat"]) if a.plan else None
    head = None
    if a.head_shapes:
        from specwood.drafting.head import untrained_head

        # the trainer's default size (32,768 draft tokens, MLP 4,096); speed does not depend on training
        head = untrained_head(target, torch.arange(min(32768, vocab)), intermediate_size=4096, dtype=dtype).to(a.device)

    for mode in a.modes.split(","):
        os.environ["SPECWOOD_CUDA_GRAPHS"] = "1" if mode == "graphs" else "0"  # read when a scheduler is made
        engine = Engine(target, tokenizer, draft=draft, head=head, target_name=NAMES["target"] + "-random",
                        draft_name=NAMES["draft"] + "-random")
        ar = timed_generate(engine, prompt, a.tokens, a.repeats, method="ar")
        res = result[mode] = {"ar": ar, "sd": {}}
        print(f"[{mode}] ar: {ar['tok_s']:.1f} tok/s ({ar['step_ms']:.2f} ms/step), TTFT {ar['ttft_ms']:.1f} ms",
              flush=True)
        for x in xs:
            sd = timed_generate(engine, prompt, a.tokens, a.repeats, method="dyspec", budget=x - 1)
            if aat is not None:
                sd["aat_cpu_plan"] = float(aat(x))
                sd["projected_tok_s"] = sd["aat_cpu_plan"] / (sd["step_ms"] / 1000)
                sd["projected_speedup"] = sd["projected_tok_s"] / ar["tok_s"]
            res["sd"][x] = sd
            extra = (f", AAT {sd['aat_cpu_plan']:.2f} -> projected {sd['projected_tok_s']:.1f} tok/s "
                     f"({sd['projected_speedup']:.2f}x ar)") if aat else ""
            print(f"[{mode}] dyspec x={x}: {sd['step_ms']:.2f} ms/step{extra}", flush=True)
        for shape in filter(None, a.head_shapes.split(",")):
            name, _, depth = shape.partition(":")
            options = {"shape": name, **({"depth": int(depth)} if depth else {})}
            hs = res.setdefault("head", {})[shape] = timed_generate(engine, prompt, a.tokens, a.repeats, method="head",
                                                                    **options)
            print(f"[{mode}] head {shape}: {hs['step_ms']:.2f} ms/step (draft levels + one verification; "
                  f"{hs['step_ms'] / ar['step_ms']:.2f} ar steps)", flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gpu_steps.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The planner's predictions against measured runs of the same layouts, side by side.

Writes a random-weight Wan checkpoint of about 1 GB (``--layers`` x width ``--width``, fp32;
kept under ``--dir`` between runs), measures the planner's profile on it (two CPU ranks), then
for W = 2 and W = 4 runs every layout (dp x sp = W, allgather and rank-local) for a few steps of
``--job`` and prints the planner's prediction beside what was measured: host memory (the
ranks' summed PSS) and step time. Targets: memory within +-15 %, step time within +-25 %.

Usage: python bench/planner.py [--job 128x128x5x3] [--worlds 2,4] [--json out/bench/planner.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.models.synthetic import SyntheticSpec, checkpoint_bytes, make_checkpoint  # noqa: E402
from runtime.planner import MODES, JobShape, layouts_of, measure_layout, measure_profile, predict  # noqa: E402
from runtime.sequence import Layout  # noqa: E402

MEMORY_TARGET = 0.15
STEP_TARGET = 0.25


def _model(directory: Path, layers: int, width: int) -> Path:
    path = directory / f"wan-{layers}x{width}"
    if not (path / "model_index.json").is_file():
        make_checkpoint(path, SyntheticSpec(family="wan", num_layers=layers, width=width,
                                            head_dim=128))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="128x128x5x3")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--dir", type=Path, default=Path("out/bench/models"))
    ap.add_argument("--json", type=Path, default=Path("out/bench/planner.json"))
    args = ap.parse_args()
    job = JobShape.parse(args.job)
    model = str(_model(args.dir, args.layers, args.width))
    heads = args.width // 128
    size = checkpoint_bytes(Path(model))
    print(f"model: Wan, {args.layers} blocks of width {args.width}, fp32, transformer "
          f"{size / 1e9:.2f} GB; job {job} ({job.tokens(model)} tokens)", flush=True)
    t0 = time.perf_counter()
    profile = measure_profile(model)
    print(f"profile measured in {time.perf_counter() - t0:.0f} s on 2 ranks", flush=True)
    rows = []
    header = (f"{'W':>2} {'layout':<24} {'host pred':>9} {'measured':>9} {'err':>6}   "
              f"{'step pred':>9} {'measured':>9} {'err':>6}")
    print(header)
    for world in (int(w) for w in args.worlds.split(",")):
        for layout in layouts_of(world, heads):
            for mode in MODES:
                p = predict(profile, layout, mode, job, tokens=job.tokens(model))
                m = measure_layout(model, layout, mode, job, steps=job.steps)
                host_err = p.host_bytes / m.host_bytes - 1
                step_err = p.step_seconds / m.step_seconds - 1
                rows.append({"world": world, "dp": layout.dp, "sp": layout.sp, "mode": mode,
                             "host_predicted_gb": p.host_bytes / 1e9,
                             "host_measured_gb": m.host_bytes / 1e9, "host_error": host_err,
                             "step_predicted_s": p.step_seconds,
                             "step_measured_s": m.step_seconds, "step_error": step_err})
                print(f"{world:>2} {p.layout:<24} {p.host_bytes / 1e9:>7.2f}GB "
                      f"{m.host_bytes / 1e9:>7.2f}GB {host_err:>+6.0%}   "
                      f"{p.step_seconds:>8.2f}s {m.step_seconds:>8.2f}s {step_err:>+6.0%}",
                      flush=True)
    # The machine's speed may drift while this runs (other work on its cores): the profile's
    # own reference run, measured again now, says by how much.
    reference = profile.raw.get(f"rank-local {JobShape(128, 128, 5, 3)}")
    if reference:
        again = measure_layout(model, Layout(dp=2), "rank-local", JobShape(128, 128, 5, 3), steps=3)
        drift = again.step_seconds / reference["step_seconds"] - 1
        print(f"drift: the profile's reference run (dp=2 rank-local, 128x128x5) took "
              f"{reference['step_seconds']:.2f} s a step then and {again.step_seconds:.2f} s now "
              f"({drift:+.0%}); beyond +-10 % the comparison measures the machine's load")
    memory_ok = sum(abs(r["host_error"]) <= MEMORY_TARGET for r in rows)
    step_ok = sum(abs(r["step_error"]) <= STEP_TARGET for r in rows)
    print(f"within targets: host memory {memory_ok}/{len(rows)} (+-{MEMORY_TARGET:.0%}), "
          f"step time {step_ok}/{len(rows)} (+-{STEP_TARGET:.0%})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"job": str(job), "model_bytes": size,
                                     "profile": json.loads(profile.to_json()), "rows": rows},
                                    indent=2))


if __name__ == "__main__":
    main()

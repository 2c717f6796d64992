"""``kiln plan``: which layout of W ranks to run, predicted from a measured profile."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from common.families import family_of
from common.settings import get_settings
from kiln.cli.options import Model

app = typer.Typer()


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


@app.command()
def plan(
    world: Annotated[int, typer.Option(min=1, help="Ranks the group will have (dp x sp).")],
    model: Model = "kiln-tiny",
    device: Annotated[str, typer.Option(help="cpu (profiles are measured on CPU ranks; cuda "
                                             "and npu are not profiled yet).")] = "cpu",
    job: Annotated[str, typer.Option(help="The job shape to plan for: "
                                          "WIDTHxHEIGHTxFRAMESxSTEPS.")] = "",
    nodes: Annotated[int, typer.Option(
        min=1, help="Machines the ranks span (torchrun --nnodes), each like this one.")] = 1,
    inter_node_gbps: Annotated[float, typer.Option(
        min=0.001, help="With --nodes > 1: the link between machines, Gb/s; a gather or "
                        "all-to-all that crosses it runs at its rate.")] = 25.0,
    remeasure: Annotated[bool, typer.Option(help="Measure the profile again.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    memory: Annotated[bool, typer.Option(
        "--memory-table", help="Also extrapolate host memory to the published technique's model "
                               "sizes (33-400 GB at dp 4 and 8) from this profile.")] = False,
) -> None:
    """Predict host memory, step time, latency and jobs per hour of every layout of --world
    ranks (dp x sp, allgather and rank-local), from a short profile of this machine and model
    (cached; measured again when stale), and mark the best for latency and for throughput."""
    # Here, not at the top: torch and the model code load only for the command that needs them.
    from kiln.worker import adapter_budget
    from runtime.planner import JobShape, heads_of, load_or_measure, memory_table
    from runtime.planner import plan as make_plan

    if device != "cpu":
        raise typer.BadParameter("profiles are measured on CPU ranks today; on an accelerator, "
                                 "choose with --dp and --sp (bench/cuda_check.py measures one)",
                                 param_hint="--device")
    defaults = family_of(model).defaults
    try:
        shape = (JobShape.parse(job) if job else
                 JobShape(defaults.width, defaults.height, defaults.num_frames,
                     defaults.num_inference_steps))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--job") from exc
    console = Console(stderr=True)
    with console.status("profiling this machine and model (two CPU ranks)..."):
        profile, source = load_or_measure(model, get_settings().data_dir, remeasure=remeasure)
    result = make_plan(profile, world, shape, tokens=shape.tokens(model), heads=heads_of(model),
                       nodes=nodes, inter_node_bytes_per_second=inter_node_gbps * 1e9 / 8,
                       adapter_bytes=adapter_budget(get_settings(), model))
    if as_json:
        typer.echo(json.dumps({
            "model": model, "world": world, "job": str(shape), "profile": source,
            "layouts": [asdict(p) for p in result.predictions],
            "best_latency": result.best_latency.layout,
            "best_throughput": result.best_throughput.layout, "reasons": result.reasons,
            **({"memory_table": memory_table(profile)} if memory else {})}, indent=2))
        return
    typer.echo(f"{model}, {world} ranks, job {shape} ({shape.tokens(model)} tokens); "
               f"profile: {source}")
    table = Table()
    for name in ("layout", "host memory", "device memory/rank", "step", "latency", "jobs/h",
                 "best for"):
        table.add_column(name, justify="left" if name in ("layout", "best for") else "right")
    for p in result.predictions:
        best = [what for what, b in (("latency", result.best_latency),
                                     ("throughput", result.best_throughput)) if b is p]
        table.add_row(p.layout, _gb(p.host_bytes), _gb(p.device_bytes),
                      f"{p.step_seconds:.3g} s", f"{p.latency_seconds:.3g} s",
                      f"{p.jobs_per_hour:,.0f}", ", ".join(best))
    Console(width=120).print(table)
    typer.echo(f"latency:    {result.best_latency.layout}: {result.reasons['latency']}")
    typer.echo(f"throughput: {result.best_throughput.layout}: {result.reasons['throughput']}")
    if memory:
        rows = memory_table(profile)
        typer.echo(f"host memory, allgather, extrapolated with this profile's "
                   f"{rows[0]['per_rank_gb']:.2f} GB per rank (model + dp x that), beside the "
                   "published estimates (cgroup-visible peak / total RAM):")
        table = Table()
        for name in ("model", "dp", "kiln (cgroup = total)", "published cgroup / total"):
            table.add_column(name, justify="right")
        for r in rows:
            table.add_row(f"{r['model_gb']:.0f} GB", str(r["dp"]), f"{r['kiln_gb']:.0f} GB",
                          f"{r['published_cgroup_gb']} / {r['published_total_gb']} GB")
        Console(width=120).print(table)

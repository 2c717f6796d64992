"""The report's GPU section from ``bench/cuda_check.py``'s JSON: the device, DLO's weight memory
against its bound, its prefetch rate against the link's, the share of the transfers hidden behind
compute, step time against a resident copy per token count (with a plot), the sp=2 and guidance
cases, the weights dtypes' bytes and step time and the quality tiers' blocks and frames, or the
reason each was skipped. Every figure is the JSON's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COMMAND = "python bench/suite.py --device cuda"


def cuda_missing_section() -> list[str]:
    return ["## GPU", "",
            "No GPU was present for this run, so the report has no GPU figures (DLO's device "
            "memory, its prefetch rate against the link's, overlap and step time against a "
            f"resident copy). On a machine with a CUDA GPU: `{COMMAND}`.", ""]


def cuda_section(result: dict[str, Any], plot_dir: Path, report_dir: Path) -> list[str]:
    """Markdown lines of the section; its plot is written under ``plot_dir`` and linked
    relative to ``report_dir``."""
    if "error" in result:
        return ["## GPU", "", f"`bench/cuda_check.py` ran but measured nothing: {result['error']}."
                f" On a machine with a CUDA GPU: `{COMMAND}`.", ""]
    lines = ["## GPU", "",
             f"Measured on {result['device_name']}, torch {result['torch']}, CUDA "
             f"{result['cuda'] or 'none (a CPU build of torch)'}, one process (dp=1, a world "
             f"of one), by `bench/cuda_check.py` in {result['wall_seconds']:.0f} s."]
    if result.get("dry_run"):
        lines.append("A dry run on the CPU (`--dry-run`): its figures show that the code runs, "
                     "not what a GPU measures.")
    if "exact_fp32" in result:
        lines.append("DLO's forward equals the resident forward bit for bit: fp32 "
                     f"{_yes(result['exact_fp32'])}, bf16 {_yes(result['exact_bf16'])}.")
    lines.append("")
    prof = next((v for k, v in result.items() if k.startswith("profile_")), None)
    lines += _memory(prof)
    lines += _transfer(prof, result.get("link"))
    lines += _steptime(result.get("steptime"), result.get("link"), result["device_name"],
                       plot_dir, report_dir)
    lines += _sp2(result.get("sp2"))
    lines += _gathers(result.get("gathers_per_step"))
    lines += _weights_dtypes(result.get("weights_dtypes"))
    lines += _quality_tiers(result.get("quality_tiers"))
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _skipped(part: Any) -> str | None:
    """Why a part has no figures, or None when it has them."""
    if part is None:
        return "not measured in this run"
    if part.get("skipped"):
        return str(part["reason"])
    return None


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3f}"


def _memory(prof: dict[str, Any] | None) -> list[str]:
    lines = ["### Device memory under DLO", ""]
    if (why := _skipped(prof)) is not None:
        return lines + [f"Skipped: {why}.", ""]
    assert prof is not None
    lines += [f"One DLO forward of the DiT of `bench/dit.py` ({prof['blocks']} blocks of width "
              f"{prof['width']}, {prof['dtype']}, {prof['tokens']} tokens), every block "
              "streamed: the allocator's peak against the weights' bound, two slots of the "
              "largest block plus what stays resident.", "",
              "| | GB |", "|---|---:|",
              f"| largest block | {_gb(prof['max_block_bytes'])} |",
              f"| resident (outside the blocks) | {_gb(prof['resident_bytes'])} |",
              f"| bound: 2 x largest block + resident | {_gb(prof['weights_bound_bytes'])} |",
              f"| DLO's device weight buffers | {_gb(prof['device_weight_buffer_bytes'])} |",
              f"| allocated before the forward | {_gb(prof['allocated_before_forward_bytes'])} |",
              f"| peak allocated during the forward | {_gb(prof['peak_allocated_bytes'])} |",
              "| peak less the bound (activations, the input) | "
              f"{_gb(prof['peak_minus_weights_bound_bytes(activations)'])} |", ""]
    return lines


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _transfer(prof: dict[str, Any] | None, link: dict[str, Any] | None) -> list[str]:
    lines = ["### Host-to-device transfer", ""]
    link_why, prof_why = _skipped(link), _skipped(prof)
    if link_why is not None and prof_why is not None:
        return lines + [f"Skipped: {prof_why}.", ""]
    lines += ["| | GB/s |", "|---|---:|"]
    if link_why is None:
        assert link is not None
        lines += [f"| link, host to device: pinned `copy_` of {link['bytes'] / 2**20:.0f} MiB, "
                  f"best of {link['reps']} (median) | {_gbps(link['h2d_gbps'])} "
                  f"({_gbps(link['h2d_gbps_median'])}) |",
                  f"| link, device to host (median) | {_gbps(link['d2h_gbps'])} "
                  f"({_gbps(link['d2h_gbps_median'])}) |"]
    else:
        lines.append(f"| link | skipped: {link_why} |")
    if prof_why is None:
        assert prof is not None
        lines += [f"| DLO prefetch, copy only | {_gbps(prof['h2d_gbps_copy'])} |",
                  "| DLO prefetch, whole interval (with the wait for a free slot) | "
                  f"{_gbps(prof['h2d_gbps'])} |", ""]
        if link_why is None and prof["h2d_gbps_copy"] and link and link["h2d_gbps"]:
            lines.append(f"DLO's copies ran at {prof['h2d_gbps_copy'] / link['h2d_gbps']:.0%} "
                         "of the link's best rate.")
        lines.append(f"In the forward of {prof['forward_seconds'] * 1e3:.1f} ms, "
                     f"{prof['transfer_hidden_share']:.0%} of the copy time was hidden behind "
                     f"block compute and the compute stream waited "
                     f"{prof['stall_seconds'] * 1e3:.2f} ms for blocks; "
                     f"{prof['overlap_share']:.0%} of the block compute had a prefetch in "
                     "flight.")
    else:
        lines.append(f"| DLO prefetch | skipped: {prof_why} |")
    return lines + [""]


def _steptime(st: dict[str, Any] | None, link: dict[str, Any] | None, device: str,
              plot_dir: Path, report_dir: Path) -> list[str]:
    lines = ["### Step time against tokens (dp=1)", ""]
    if (why := _skipped(st)) is not None:
        return lines + [f"Skipped: {why}.", ""]
    assert st is not None
    points = st["points"]
    tokens = [p["tokens"] for p in points]
    ratios = [p["dlo_over_resident"] for p in points]
    # The streamed weights at the link's best rate, over the resident forward: where it is over
    # 1 the copies, not the compute, set DLO's pace.
    floor = None
    if _skipped(link) is None and link is not None:
        link_s = st["streamed_bytes_per_forward"] / (link["h2d_gbps"] * 1e9)
        floor = [link_s / p["resident_s"] for p in points]
    plot = plot_dir / "cuda_steptime.png"
    _plot(plot, tokens, ratios, floor,
          title=f"{device}: DiT width {st['width']} x {st['blocks']} blocks, {st['dtype']} "
                f"({_gb(st['model_bytes'])} GB)")
    lines += [f"The DiT of `bench/dit.py` ({st['blocks']} blocks of width {st['width']}, "
              f"{st['dtype']}, {_gb(st['model_bytes'])} GB) resident on the device against "
              f"the same weights under DLO ({st['mode']}, every block, "
              f"{_gb(st['streamed_bytes_per_forward'])} GB, copied through the two slots per "
              f"forward); forwards of the two in turn, median of {st['reps']} each (block 0's "
              "copy for the next DLO forward overlaps what runs between them, here the resident "
              "forward). Stall: the compute stream's wait for blocks per DLO forward."
              + (" Link-bound: the streamed weights at the link's best host-to-device rate, "
                 "over the resident forward." if floor is not None else ""), "",
              f"![DLO step time over resident]({os.path.relpath(plot, report_dir)})", "",
              "| tokens | resident ms | DLO ms | DLO / resident | stall ms |"
              + (" link-bound |" if floor is not None else "") + " bit equal |",
              "|---:|---:|---:|---:|---:|" + ("---:|" if floor is not None else "") + "---|"]
    for i, p in enumerate(points):
        lines.append(f"| {p['tokens']} | {p['resident_s'] * 1e3:.2f} | {p['dlo_s'] * 1e3:.2f} | "
                     f"{p['dlo_over_resident']:.3f} | {p['dlo_stall_s'] * 1e3:.2f} |"
                     + (f" {floor[i]:.3f} |" if floor is not None else "")
                     + f" {_yes(p['bit_equal'])} |")
    return lines + [""]


def _plot(path: Path, tokens: list[int], ratios: list[float], floor: list[float] | None, *,
          title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(tokens, ratios, marker="o", label="DLO, every block streamed")
    if floor is not None:
        ax.plot(tokens, floor, color="grey", linestyle="--",
                label="streamed weights at the link's rate / resident")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("forward time / resident copy's")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _sp2(sp2: dict[str, Any] | None) -> list[str]:
    lines = ["### Sequence parallel, sp=2 (kiln-tiny)", ""]
    if (why := _skipped(sp2)) is not None:
        return lines + [f"Skipped: {why}.", ""]
    assert sp2 is not None
    lines += [f"kiln-tiny's transformer split over 2 ranks ({sp2['backend']}, DLO "
              f"{sp2['mode']} across the two, {sp2['dtype']}) against the same transformer "
              "unsplit on the same ranks; times are the slower rank's.", "",
              "| tokens | latent shape | max abs diff | bit equal | whole ms | split ms | "
              "whole / split |", "|---:|---|---:|---|---:|---:|---:|"]
    for key, row in sp2.items():
        if key.startswith("tokens"):
            shape = "x".join(map(str, row["latent_shape"]))
            lines.append(f"| {key.removeprefix('tokens')} | {shape} | "
                         f"{row['max_abs_diff']:.2e} | {_yes(row['bit_equal'])} | "
                         f"{row['whole_forward_s'] * 1e3:.2f} | "
                         f"{row['split_forward_s'] * 1e3:.2f} | {row['whole_over_split']:.3f} |")
    return lines + [""]


def _gathers(gathers: dict[str, Any] | None) -> list[str]:
    lines = ["### Gathers per step with guidance (kiln-tiny)", ""]
    if (why := _skipped(gathers)) is not None:
        return lines + [f"Skipped: {why}.", ""]
    assert gathers is not None
    lines += ["kiln-tiny's pipeline at dp=1 with guidance on: blocks acquired per step with CFG "
              "as one batch-2 forward against two batch-1 forwards, and the step time of each "
              f"({gathers['steps']} steps, interleaved, median of {gathers['passes']} passes).",
              "", "| size | blocks | acquired, batch-2 | acquired, two forwards | as expected | "
              "batch-2 ms/step | two forwards ms/step | two / batch-2 | latents max abs diff |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for size, row in gathers.items():
        if not isinstance(row, dict):
            continue
        one, two = row["cfg_batch"], row["two_forwards"]
        lines.append(f"| {size} | {one['num_blocks']} | "
                     f"{', '.join(map(str, one['acquired_per_step']))} | "
                     f"{', '.join(map(str, two['acquired_per_step']))} | "
                     f"{_yes(one['as_expected'] and two['as_expected'])} | "
                     f"{one['s_per_step'] * 1e3:.2f} | {two['s_per_step'] * 1e3:.2f} | "
                     f"{row['two_forwards_over_cfg_batch']:.3f} | "
                     f"{row['latents_max_abs_diff']:.2e} |")
    return lines + [""]


def _weights_dtypes(wd: dict[str, Any] | None) -> list[str]:
    lines = ["### Weights dtypes", ""]
    if (why := _skipped(wd)) is not None:
        return lines + [f"Skipped: {why}.", ""]
    assert wd is not None
    dtypes = wd["dtypes"]
    lines += [f"The DiT of `bench/dit.py` ({wd['blocks']} blocks of width {wd['width']}, "
              f"{wd['dtype']}, {_gb(wd['model_bytes'])} GB) under DLO, every block streamed, "
              "once per weights dtype (the blocks kept, copied and gathered in it, upcast "
              "before each block runs); forwards of the three in turn, median of "
              f"{wd['reps']} each. Bytes per forward: the engine's count "
              "(`DLOHandle.bytes_moved`); error: the output's largest difference from "
              "checkpoint's over its largest value.", "",
              "| weights dtype | copied per forward GB | gathered per forward GB | device "
              "buffers GB | host copy GB | error |", "|---|---:|---:|---:|---:|---:|"]
    for name in dtypes:
        f = wd["per_dtype"][name]
        lines.append(f"| {name} | {_gb(f['bytes_copied_per_forward'])} | "
                     f"{_gb(f['bytes_gathered_per_forward'])} | "
                     f"{_gb(f['device_weight_buffer_bytes'])} | {_gb(f['host_shard_bytes'])} | "
                     f"{f['max_rel_error_vs_checkpoint']:.1e} |")
    lines += ["", "| tokens | " + " | ".join(f"{d} ms" for d in dtypes) + " | "
              + " | ".join(f"{d} / checkpoint" for d in dtypes[1:]) + " |",
              "|---:|" + "---:|" * (2 * len(dtypes) - 1)]
    for p in wd["points"]:
        lines.append(f"| {p['tokens']} | "
                     + " | ".join(f"{p['seconds'][d] * 1e3:.2f}" for d in dtypes) + " | "
                     + " | ".join(f"{p['ratio_to_checkpoint'][d]:.3f}" for d in dtypes[1:])
                     + " |")
    return lines + [""]


def _quality_tiers(qt: dict[str, Any] | None) -> list[str]:
    lines = ["### Quality tiers (kiln-tiny)", ""]
    if (why := _skipped(qt)) is not None:
        return lines + [f"Skipped: {why}.", ""]
    assert qt is not None
    thresholds = qt["thresholds"]
    lines += [f"{qt['model']}'s pipeline on the device, {qt['prompts']} prompts at "
              f"{qt['steps']} steps, each exact and at every caching tier in turn: blocks "
              "computed per job, the frames' PSNR and SSIM against exact's (mean · least over "
              "the prompts) and a job's wall time, as `bench/step_cache.py` measures them on "
              "the CPU.", "",
              "| tier | threshold | blocks a job | fewer than exact | PSNR dB | SSIM | wall ms | "
              "wall / exact |", "|---|---:|---:|---:|---|---|---:|---:|"]
    for tier, f in qt["tiers"].items():
        lines.append(f"| {tier} | {thresholds.get(tier, '-')} | {f['blocks']:.1f} | "
                     f"{f['fewer_by']:.2f}x | {f['psnr_mean']:.1f} · {f['psnr_min']:.1f} | "
                     f"{f['ssim_mean']:.4f} · {f['ssim_min']:.4f} | {f['wall_s'] * 1e3:.1f} | "
                     f"{f['wall_over_exact']:.3f} |")
    return lines + [""]

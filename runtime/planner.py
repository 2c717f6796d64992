"""The layout planner: a short measured profile of this machine and model, then, for every layout
of W ranks, the memory and speed it predicts, and which layout is best for what.

The profile (`measure_profile`) runs the model on two ranks, in both DLO modes, for a few steps
at two token counts, and keeps what the predictions need:

- compute: seconds of one block forward (the guidance pair as one batch-2 forward) against this
  rank's tokens, fitted as ``a + b * tokens`` from the two token counts of the rank-local runs
  (the step time minus the time the step waited for its blocks, per block; their cheap copies
  are inside the fit);
- transfers: seconds per byte, and the fixed cost, of an all-gather and of an all-to-all, timed
  on the two ranks doing nothing else;
- memory: a rank with torch and its process groups but no model (``framework``), and what each
  loaded rank holds beyond its share of the weights (``per_rank``), fitted from the measured
  summed PSS of the two ranks: host memory = weights + W x (framework + per_rank).

A prediction (`predict`) for dp replicas of sp ranks: each rank computes its
``ceil(tokens / sp)`` tokens, plus sp's four all-to-alls per block. On the CPU a block's
all-gather runs on the cores its compute needs, so it adds to the block's time instead of hiding
behind it (what the measurements show: rank-local, whose copies are cheap, steps 1.8x faster
than allgather on two ranks of a 1 GB model). Ranks beyond the machine's cores share them:
compute scales by ranks x threads / cores, and every lock-step collective waits for each rank
to be scheduled, a cost the profile measures with twice as many ranks as cores. One job's latency is
its steps plus the prepare and decode measured in the profile; jobs per hour are dp jobs per
latency. The profile is cached per machine and model (``profile_path``) and is stale when the
machine, torch or the checkpoint changed, or after ``STALE_AFTER_DAYS``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform as host
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from common.families import family_of
from common.families import tokens as count_tokens
from runtime.budget import WEIGHTS_DTYPES
from runtime.launch import RankContext, run_ranks
from runtime.models.tiny import TinyConfig
from runtime.pipelines.base import Conditioning, VideoRequest, agree_handles
from runtime.render import load_pipeline, memory_figures
from runtime.sequence import Layout, open_sequence

PROFILE_VERSION = 5
STALE_AFTER_DAYS = 30
MODES = ("allgather", "rank-local")


@dataclass(frozen=True, slots=True)
class JobShape:
    """A job shape: ``WxHxFRAMESxSTEPS``."""

    width: int = 64
    height: int = 64
    num_frames: int = 9
    steps: int = 4

    @classmethod
    def parse(cls, text: str) -> JobShape:
        parts = text.lower().split("x")
        if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"a job is WIDTHxHEIGHTxFRAMESxSTEPS such as 64x64x9x4, got {text!r}")
        w, h, f, s = (int(p) for p in parts)
        return cls(w, h, f, s)

    def tokens(self, model: str) -> int:
        return count_tokens(self.width, self.height, self.num_frames, family=family_of(model))

    def request(self, model: str, seed: int = 0) -> VideoRequest:
        """The profile's job for ``model``. A family that renders only from an input
        (image-to-video) gets a plain grey image of the job's size: a step costs the same
        whatever the picture."""
        conditioning = None
        if family_of(model).needs_input:
            grey = torch.full((self.height, self.width, 3), 128, dtype=torch.uint8)
            conditioning = Conditioning(image=grey)
        return VideoRequest(prompt="a red circle moving left", width=self.width,
                            height=self.height, num_frames=self.num_frames,
                            num_inference_steps=self.steps, seed=seed,
                            conditioning=conditioning)

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.num_frames}x{self.steps}"


# ---- measuring ------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Measured:
    """One layout run: what rank 0 saw per step, and the ranks' memory."""

    dp: int
    sp: int
    mode: str
    tokens: int
    step_seconds: float  # median over the steps after the first
    wait_seconds: float  # per step: compute waiting for a block's transfer (rank 0)
    gather_seconds: float  # per step: the transfer thread's time (rank 0)
    prepare_seconds: float
    decode_seconds: float
    framework_bytes: int  # mean PSS of a rank before it loads the model
    host_bytes: int  # summed PSS of the ranks after the steps
    dlo: dict[str, Any] = field(default_factory=dict)  # rank 0's engine figures


def _measure_on_rank(ctx: RankContext, model: str, layout: Layout, mode: str, job: JobShape,
                     steps: int) -> dict[str, Any]:
    _, framework, _ = memory_figures()
    pipe = load_pipeline(model, device="cpu", use_allgather=mode == "allgather",
                         sequence=open_sequence(layout, "gloo"), device_budget=None)
    try:
        handle = pipe.handles[0]
        t0 = time.perf_counter()
        state = pipe.prepare(job.request(model, seed=layout.replica(ctx.rank)))
        prepare = time.perf_counter() - t0
        times, waits, gathers = [], [], []
        for _ in range(steps):
            before = handle.stats() if handle is not None else {}
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(state, agree_handles(pipe, state))
            times.append(time.perf_counter() - t0)
            after = handle.stats() if handle is not None else {}
            waits.append(after.get("wait_seconds", 0.0) - before.get("wait_seconds", 0.0))
            gathers.append(after.get("gather_seconds", 0.0) - before.get("gather_seconds", 0.0))
        _, host_bytes, _ = memory_figures()
        stored = ({d: handle.stored_sizes(d) for d in WEIGHTS_DTYPES}
                  if handle is not None else {})
        dist.barrier()
        t0 = time.perf_counter()
        if layout.is_leader(ctx.rank):
            pipe.decode(state)
        decode = time.perf_counter() - t0
        stats = {**handle.stats(), "stored_sizes": stored} if handle is not None else {}
    finally:
        pipe.close()
    kept = slice(1, None) if steps > 1 else slice(None)  # the first step warms the kernels
    return {"step": statistics.median(times[kept]), "wait": statistics.median(waits[kept]),
            "gather": statistics.median(gathers[kept]), "prepare": prepare, "decode": decode,
            "framework": framework, "host": host_bytes, "dlo": stats}


def measure_layout(model: str, layout: Layout, mode: str, job: JobShape, *, steps: int = 3,
                   timeout_s: float = 900.0) -> Measured:
    """Run ``job`` on every replica of ``layout`` for ``steps`` steps (one torch thread per
    rank) and measure it."""
    per_rank = run_ranks(layout.world, _measure_on_rank, model, layout, mode, job, steps,
                         threads=1, timeout_s=timeout_s)
    r0 = per_rank[0]
    return Measured(dp=layout.dp, sp=layout.sp, mode=mode, tokens=job.tokens(model),
                    step_seconds=r0["step"], wait_seconds=r0["wait"],
                    gather_seconds=r0["gather"], prepare_seconds=r0["prepare"],
                    decode_seconds=r0["decode"],
                    framework_bytes=int(statistics.mean(r["framework"] for r in per_rank)),
                    host_bytes=sum(r["host"] for r in per_rank), dlo=r0["dlo"])


def time_collectives(ctx: RankContext, nbytes: int, reps: int) -> dict[str, float]:
    """Every rank of a process group calls it: median seconds of an all-gather into ``nbytes``
    and of an all-to-all of ``nbytes``, and of the same with 256 bytes (the fixed cost of one
    collective), on ranks doing nothing else
    (the DLO engine's own gather timings include waiting for a peer still computing, which is
    not the link)."""
    def timed(op: Any) -> float:
        op()  # warm
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = {}
    for size, name in ((256, "small"), (nbytes, "large")):
        full = torch.zeros(size // 4, dtype=torch.float32)
        part = full[: full.numel() // dist.get_world_size()].clone()
        result = torch.empty_like(full)
        out[f"gather_{name}"] = timed(
            lambda r=result, x=part: dist.all_gather_into_tensor(r, x))
        out[f"a2a_{name}"] = timed(lambda r=result, x=full: dist.all_to_all_single(r, x))
    return out


class LinkFigures(TypedDict):
    """The link fields of a `Profile`."""

    gather_seconds_per_byte: float
    gather_latency_seconds: float
    all_to_all_seconds_per_byte: float
    all_to_all_latency_seconds: float


def link_figures(times: dict[str, float], nbytes: int, world: int) -> LinkFigures:
    """A profile's link fields from `time_collectives`' figures on ``world`` ranks: seconds
    per byte a rank receives (all-gather) or sends (all-to-all), and each one's fixed cost."""
    moved = nbytes * (world - 1) / world

    def rate(kind: str) -> float:
        return max(0.0, times[f"{kind}_large"] - times[f"{kind}_small"]) / moved
    return {"gather_seconds_per_byte": rate("gather"),
            "gather_latency_seconds": times["gather_small"],
            "all_to_all_seconds_per_byte": rate("a2a"),
            "all_to_all_latency_seconds": times["a2a_small"]}


def _crowded_on_rank(ctx: RankContext, iters: int) -> float:
    """Seconds one small all-to-all adds to an iteration of compute when the ranks outnumber
    the cores: the same compute loop timed without and with a collective per iteration."""
    x = torch.randn(192, 192)
    small = torch.zeros(64)
    out = torch.empty_like(small)

    def loop(with_collective: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(20):
                x.matmul(x)
            if with_collective:
                dist.all_to_all_single(out, small)
        dist.barrier()
        return (time.perf_counter() - t0) / iters

    loop(True)  # warm
    alone, together = loop(False), loop(True)
    return max(0.0, together - alone)


# ---- the profile ----------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Profile:
    model: str
    machine: dict[str, Any]
    checkpoint: str  # what the model's files were (sizes and times), to see a change
    created_at: float
    cores: int
    num_blocks: int
    max_block_bytes: int
    block_bytes: int  # all blocks, as the engine packs them
    nonblock_bytes: int  # the transformer's other tensors (resident, shared mapping)
    width_tokens: tuple[int, int]  # the two token counts measured
    block_seconds: tuple[float, float]  # a + b * tokens: one block forward, one thread
    gather_seconds_per_byte: float  # allgather: per byte a rank receives
    gather_latency_seconds: float  # the fixed cost of one all-gather
    all_to_all_seconds_per_byte: float  # per byte a rank sends to the others
    all_to_all_latency_seconds: float  # the fixed cost of one all-to-all
    activation_bytes_per_token: int  # the bytes one token's activations move in an all-to-all
    prepare_seconds: float
    decode_seconds: float  # at the profile's job shape; scaled by pixels for others
    decode_pixels: int
    framework_bytes: int  # a rank before it loads the model
    per_rank_bytes: dict[str, int]  # fitted per mode: what a loaded rank holds beyond weights
    # What one lock-step collective costs when there are twice as many ranks as cores: a
    # collective completes only once every rank is scheduled.
    crowded_collective_seconds: float
    # Per weights dtype (runtime.budget.WEIGHTS_DTYPES), the blocks as the engine would keep
    # them: block_bytes (all, unsharded), max_block_bytes (a slot), compute_buffer_bytes.
    stored_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)  # the profile's own runs, as measured
    version: int = PROFILE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        raw = json.loads(text)
        if raw.get("version") != PROFILE_VERSION:
            raise ValueError("it was measured by another version of the planner")
        raw["width_tokens"] = tuple(raw["width_tokens"])
        raw["block_seconds"] = tuple(raw["block_seconds"])
        return cls(**raw)

    def stale_because(self, model: str) -> str | None:
        """Why this profile no longer describes this machine and model, or None."""
        if self.version != PROFILE_VERSION:
            return "it was measured by another version of the planner"
        if self.machine != machine_description():
            return "the machine or torch changed since it was measured"
        if self.checkpoint != checkpoint_fingerprint(model):
            return "the model's files changed since it was measured"
        age_days = (time.time() - self.created_at) / 86400
        if age_days > STALE_AFTER_DAYS:
            return f"it is {age_days:.0f} days old"
        return None


def machine_description() -> dict[str, Any]:
    cpu = host.processor() or host.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "torch": torch.__version__,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}


def checkpoint_fingerprint(model: str) -> str:
    path = Path(model)
    if not path.is_dir():
        return model  # kiln-tiny: the weights ship with kiln (its version is torch's row)
    h = hashlib.sha256()
    for f in sorted(path.rglob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.relative_to(path)}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def profile_path(data_dir: Path, model: str) -> Path:
    key = hashlib.sha256(f"{model}|{json.dumps(machine_description(), sort_keys=True)}".encode())
    return data_dir / "profiles" / f"{key.hexdigest()[:16]}.json"


def _transformer_config(model: str) -> dict[str, Any]:
    path = Path(model) / "transformer" / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _width_of(model: str) -> int:
    """Hidden size of the transformer, for the bytes an all-to-all moves per token."""
    c = _transformer_config(model)
    if c:
        return int(c.get("hidden_size") or
                   c.get("num_attention_heads", 1) * c.get("attention_head_dim", 1))
    return TinyConfig().dim


def heads_of(model: str) -> int | None:
    """What sp must divide, when known: the transformer's attention heads, or 1 for a family
    that runs at sp=1 (`common.families.Family.sequence_parallel`)."""
    if not family_of(model).sequence_parallel and family_of(model).pipeline is not None:
        return 1
    if model == "kiln-tiny":
        return TinyConfig().num_heads
    return _transformer_config(model).get("num_attention_heads")


def measure_profile(model: str, *, jobs: tuple[JobShape, JobShape] | None = None,
                    steps: int = 3) -> Profile:
    """About a minute on two CPU ranks for a ~1 GB model (seconds for kiln-tiny)."""
    small, large = jobs or (JobShape(64, 64, 5, steps), JobShape(128, 128, 5, steps))
    two = Layout(dp=2, sp=1)
    runs = {(job, mode): measure_layout(model, two, mode, job, steps=steps)
            for job in (small, large) for mode in MODES}
    ag_large = runs[large, "allgather"]
    stats = ag_large.dlo
    num_blocks = stats["num_blocks"]
    block_bytes = stats["host_shard_bytes"] * stats["shard_count"]
    tokens = (small.tokens(model), large.tokens(model))

    def per_block(m: Measured) -> float:  # compute only: the step less its waits on transfers
        return max(1e-9, (m.step_seconds - m.wait_seconds) / num_blocks)

    # From the rank-local runs: their copies are cheap and inside the fit; an all-gather's
    # cost is added on top (see `predict`).
    c_small, c_large = per_block(runs[small, "rank-local"]), per_block(runs[large, "rank-local"])
    slope = max(0.0, (c_large - c_small) / max(1, tokens[1] - tokens[0]))
    intercept = max(0.0, c_small - slope * tokens[0])
    probe = max(2**20, stats["max_block_bytes"])
    links = link_figures(run_ranks(2, time_collectives, probe, 9, threads=1,
                                   timeout_s=300)[0], probe, 2)
    cores = os.cpu_count() or 1
    crowded = run_ranks(2 * cores, _crowded_on_rank, 20, threads=1, timeout_s=300)[0]
    width = _width_of(model)
    per_token = 2 * width * 4  # the guidance pair, fp32 activations of one token
    framework = int(statistics.mean(m.framework_bytes for m in runs.values()))
    weights = block_bytes + stats["resident_bytes"]
    per_rank = {}
    for mode in MODES:
        m = runs[large, mode]
        per_rank[mode] = max(0, (m.host_bytes - weights) // 2 - framework)
    return Profile(
        model=model, machine=machine_description(), checkpoint=checkpoint_fingerprint(model),
        created_at=time.time(), cores=os.cpu_count() or 1, num_blocks=num_blocks,
        max_block_bytes=stats["max_block_bytes"], block_bytes=block_bytes,
        nonblock_bytes=stats["resident_bytes"], width_tokens=tokens,
        block_seconds=(intercept, slope), **links,
        activation_bytes_per_token=per_token, prepare_seconds=ag_large.prepare_seconds,
        decode_seconds=ag_large.decode_seconds,
        decode_pixels=large.width * large.height * large.num_frames,
        framework_bytes=framework, per_rank_bytes=per_rank, crowded_collective_seconds=crowded,
        stored_sizes=stats.get("stored_sizes", {}),
        raw={f"{mode} {job}": asdict(m) for (job, mode), m in runs.items()})


def load_or_measure(model: str, data_dir: Path, *, remeasure: bool = False,
                    ) -> tuple[Profile, str]:
    """The cached profile if it is fresh, else a new one (saved); with how it was obtained."""
    path = profile_path(data_dir, model)
    why = "asked to measure again" if remeasure else "no profile of this machine and model yet"
    if path.is_file() and not remeasure:
        try:
            cached = Profile.from_json(path.read_text())
        except (ValueError, TypeError, KeyError) as exc:
            why = f"the cached profile is stale: {exc}"
        else:
            stale = cached.stale_because(model)
            if stale is None:
                age = (time.time() - cached.created_at) / 3600
                return cached, f"cached profile from {age:.1f} h ago ({path})"
            why = f"the cached profile is stale: {stale}"
    profile = measure_profile(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    return profile, f"measured now ({why}); saved to {path}"


# ---- predicting -----------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Prediction:
    dp: int
    sp: int
    mode: str
    resident_blocks: int
    host_bytes: int  # the ranks together: weights once + W x (framework + per rank)
    device_bytes: int  # per rank: weight buffers + this rank's activations (host = device on CPU)
    step_seconds: float
    latency_seconds: float
    jobs_per_hour: float
    compute_seconds: float  # per step, this rank's blocks
    transfer_seconds: float  # per step, the weights' gathers or copies (overlapped)
    exchange_seconds: float  # per step, sp's all-to-alls
    weights_dtype: str = "checkpoint"  # what the blocks are kept and moved in
    notes: list[str] = field(default_factory=list)

    @property
    def layout(self) -> str:
        return f"dp={self.dp} x sp={self.sp} {self.mode}"


def stored_sizes(p: Profile, weights_dtype: str) -> dict[str, int]:
    """The profile's blocks as kept in ``weights_dtype``: block_bytes, max_block_bytes and
    compute_buffer_bytes (`Profile.stored_sizes`; ``checkpoint`` is the measured layout)."""
    if weights_dtype in p.stored_sizes:
        return p.stored_sizes[weights_dtype]
    if weights_dtype == "checkpoint":
        return {"block_bytes": p.block_bytes, "max_block_bytes": p.max_block_bytes,
                "compute_buffer_bytes": 0}
    raise ValueError(f"the profile has no figures for weights dtype {weights_dtype!r}; "
                     "measure it again")


def predict(p: Profile, layout: Layout, mode: str, job: JobShape, *, tokens: int,
            resident_blocks: int = 0, threads: int = 1, nodes: int = 1,
            inter_node_bytes_per_second: float = 25e9 / 8,
            weights_dtype: str = "checkpoint", adapter_bytes: int = 0) -> Prediction:
    """``nodes``: machines the ranks are spread over, each like this one (the profile's), in
    rank order; a collective that crosses machines runs at the slower of this machine's rate
    and ``inter_node_bytes_per_second`` (default 25 Gb/s). ``weights_dtype``: the blocks are
    kept, copied and gathered at their size in it (`stored_sizes`): the host holds them once
    (allgather's shards; rank-local: the checkpoint's shared mapping, or each rank's own copy
    when they are cast), the two slots hold the largest, and a cast block needs a compute
    buffer beside them; resident blocks stay in the compute dtype. ``adapter_bytes``: each
    rank's LoRA adapter cache at its budget (``runtime.adapter_cache``), counted on its device
    and in its host memory."""
    w = layout.world
    shard = math.ceil(tokens / layout.sp)
    per_node = math.ceil(w / nodes)
    crowding = max(1.0, per_node * threads / p.cores)  # ranks beyond the cores share them
    link = 1 / inter_node_bytes_per_second
    gather_rate = max(p.gather_seconds_per_byte, link) if nodes > 1 else p.gather_seconds_per_byte
    # A replica's ranks are consecutive: its all-to-alls cross machines only when it is wider
    # than one machine's share of the ranks.
    a2a_rate = (max(p.all_to_all_seconds_per_byte, link) if layout.sp > per_node
                else p.all_to_all_seconds_per_byte)
    a, b = p.block_seconds
    compute = (a + b * shard) * crowding / threads
    per_block = p.block_bytes / p.num_blocks
    sizes = stored_sizes(p, weights_dtype)
    stored_per_block = sizes["block_bytes"] / p.num_blocks
    streamed = p.num_blocks - resident_blocks
    # On the CPU a transfer runs on the cores the compute needs, so it adds to the step rather
    # than hiding behind it: an all-gather costs the bytes a rank receives at the measured rate;
    # a rank-local copy is cheap and already inside the fitted compute.
    transfer = (p.gather_latency_seconds + stored_per_block * (w - 1) / w * gather_rate
                if mode == "allgather" and w > 1 else 0.0)
    collectives = (1 if transfer else 0) + (4 if layout.sp > 1 else 0)  # per block
    exchange = 0.0
    if layout.sp > 1:
        sent = shard * p.activation_bytes_per_token * (layout.sp - 1) / layout.sp
        exchange = 4 * (p.all_to_all_latency_seconds + sent * a2a_rate)
    # More ranks than cores: every lock-step collective waits for each rank to be scheduled.
    waits = collectives * p.crowded_collective_seconds * (crowding - 1)
    step = p.num_blocks * (compute + exchange + waits) + streamed * transfer
    if layout.sp > 1:  # the shards gathered after the last block
        step += p.gather_latency_seconds + shard * p.activation_bytes_per_token * a2a_rate
    pixels = job.width * job.height * job.num_frames
    overhead = p.prepare_seconds + p.decode_seconds * pixels / max(1, p.decode_pixels)
    latency = job.steps * step + overhead * crowding
    cast = sizes["compute_buffer_bytes"] > 0
    copies = w if cast and mode == "rank-local" else 1
    weights = copies * sizes["block_bytes"] + p.nonblock_bytes
    slots = 2 * sizes["max_block_bytes"] + sizes["compute_buffer_bytes"] if streamed else 0
    host_total = weights + w * (p.framework_bytes + p.per_rank_bytes.get(mode, 0))
    resident = resident_blocks * per_block
    activations = int(1.25 * 2 * shard * (6 * p.activation_bytes_per_token))
    notes = []
    if transfer > compute + exchange and streamed:
        notes.append("transfer-bound: a block's gather takes longer than its compute")
    if crowding > 1:
        notes.append(f"{per_node} ranks on {p.cores} cores: compute shares them "
                     f"({crowding:.1f}x)")
    if nodes > 1 and gather_rate > p.gather_seconds_per_byte:
        notes.append(f"gathers cross {nodes} machines at the link's rate")
    return Prediction(
        dp=layout.dp, sp=layout.sp, mode=mode, resident_blocks=resident_blocks,
        host_bytes=int(host_total + (resident + adapter_bytes) * w),
        device_bytes=int(slots + resident + p.nonblock_bytes + activations + adapter_bytes),
        step_seconds=step, latency_seconds=latency,
        jobs_per_hour=layout.dp * 3600 / latency if latency > 0 else 0.0,
        compute_seconds=compute * p.num_blocks, transfer_seconds=transfer * streamed,
        exchange_seconds=(exchange + waits) * p.num_blocks, weights_dtype=weights_dtype,
        notes=notes)


def layouts_of(world: int, heads: int | None = None) -> list[Layout]:
    """Every dp x sp = world (sp dividing the heads, when known)."""
    return [Layout(dp=world // sp, sp=sp) for sp in range(1, world + 1)
            if world % sp == 0 and (heads is None or heads % sp == 0)]


@dataclass(kw_only=True, slots=True)
class Plan:
    predictions: list[Prediction]
    best_latency: Prediction
    best_throughput: Prediction
    reasons: dict[str, str]


def plan(p: Profile, world: int, job: JobShape, *, tokens: int, heads: int | None = None,
         device_budget: int | None = None, nodes: int = 1,
         inter_node_bytes_per_second: float = 25e9 / 8,
         weights_dtype: str = "checkpoint", adapter_bytes: int = 0) -> Plan:
    """Every layout of ``world`` ranks (over ``nodes`` machines) in both modes, the best for one
    job's latency and for jobs per hour, and why in words; the blocks kept and moved in
    ``weights_dtype`` (`predict`); ``adapter_bytes`` of each rank's device budget kept for its
    adapter cache, not for resident blocks."""
    per_block = p.block_bytes / p.num_blocks
    sizes = stored_sizes(p, weights_dtype)
    preds = []
    for layout in layouts_of(world, heads):
        for mode in MODES:
            resident = 0
            if device_budget:
                room = (device_budget - 2 * sizes["max_block_bytes"]
                        - sizes["compute_buffer_bytes"] - adapter_bytes)
                resident = min(p.num_blocks, max(0, int(room // per_block)))
            preds.append(predict(p, layout, mode, job, tokens=tokens, resident_blocks=resident,
                                 nodes=nodes,
                                 inter_node_bytes_per_second=inter_node_bytes_per_second,
                                 weights_dtype=weights_dtype, adapter_bytes=adapter_bytes))
    fast = min(preds, key=lambda x: (x.latency_seconds, x.host_bytes))
    many = max(preds, key=lambda x: (x.jobs_per_hour, -x.host_bytes))
    return Plan(predictions=preds, best_latency=fast, best_throughput=many,
                reasons={"latency": _why_latency(fast, preds),
                         "throughput": _why_throughput(many, preds)})


def choose(result: Plan, goal: str) -> tuple[Prediction, Prediction]:
    """The layout a group with ``goal`` ("latency": one job's latency; "throughput": jobs per
    hour) should run, and the runner-up."""
    if goal == "latency":
        ranked = sorted(result.predictions, key=lambda x: (x.latency_seconds, x.host_bytes))
    else:
        ranked = sorted(result.predictions, key=lambda x: (-x.jobs_per_hour, x.host_bytes))
    return ranked[0], ranked[1] if len(ranked) > 1 else ranked[0]


def summary(p: Prediction) -> dict[str, Any]:
    """A prediction's figures, as a group reports its plan."""
    return {"layout": p.layout, "dp": p.dp, "sp": p.sp, "mode": p.mode,
            "step_seconds": round(p.step_seconds, 4),
            "latency_seconds": round(p.latency_seconds, 4),
            "jobs_per_hour": round(p.jobs_per_hour, 1), "host_bytes": p.host_bytes,
            "device_bytes": p.device_bytes, "weights_dtype": p.weights_dtype}


def _why_latency(best: Prediction, preds: list[Prediction]) -> str:
    alone = min((x for x in preds if x.sp == 1), key=lambda x: x.latency_seconds)
    if best.sp > 1:
        return (f"splitting the job over {best.sp} ranks cuts its compute per rank from "
                f"{alone.compute_seconds:.3g} to {best.compute_seconds:.3g} s a step, more than "
                f"the all-to-alls add ({best.exchange_seconds:.3g} s)")
    split = [x for x in preds if x.sp > 1]
    if not split:
        return "no sp divides the model's heads and the world: one rank per job"
    other = min(split, key=lambda x: x.latency_seconds)
    return (f"at {other.sp} ranks a job's shard is too small: its all-to-alls "
            f"({other.exchange_seconds:.3g} s a step) and shared cores cost more than the "
            f"compute saved")


def _why_throughput(best: Prediction, preds: list[Prediction]) -> str:
    moved = (f"its transfers add {best.transfer_seconds:.3g} s to {best.compute_seconds:.3g} s "
             "of compute a step" if best.transfer_seconds else
             f"no gathers in the step ({best.compute_seconds:.3g} s of compute)")
    return (f"{best.dp} replica(s) render {best.dp} job(s) at once in {best.mode} mode; "
            f"{moved}")


# The published technique's extrapolated host memory for allgather DLO (model GB, dp) ->
# (cgroup-visible peak, total RAM) in GB, on Ascend, whose pinned shards the cgroup does not see.
PUBLISHED_MEMORY = {(33, 4): (47, 80), (124, 4): (172, 296), (185, 4): (220, 405),
                    (400, 4): (423, 823), (400, 8): (443, 843)}


def memory_table(p: Profile, cases: list[tuple[float, int]] | None = None,
                 ) -> list[dict[str, float | None]]:
    """Host memory of kiln's allgather mode for other model sizes, from this profile's fitted
    per-rank constant: the ranks hold the weights once between them (each its 1/dp shard; the
    checkpoint's page cache is dropped as the shards fill) plus a constant per rank, all of it
    ordinary process memory, so what a memory cgroup sees is the total:
    ``model + dp x constant``. Beside it, the published technique's estimates."""
    return extrapolate_memory(p.framework_bytes + p.per_rank_bytes.get("allgather", 0), cases)


def extrapolate_memory(per_rank: float, cases: list[tuple[float, int]] | None = None,
                       ) -> list[dict[str, float | None]]:
    """``model + dp x per_rank`` for each (model GB, dp) case (default: the published ones),
    beside the published technique's estimates where it has one."""
    rows: list[dict[str, float | None]] = []
    for gb, dp in cases or list(PUBLISHED_MEMORY):
        published = PUBLISHED_MEMORY.get((int(gb), dp))
        rows.append({"model_gb": gb, "dp": dp, "per_rank_gb": per_rank / 1e9,
                     "kiln_gb": (gb * 1e9 + dp * per_rank) / 1e9,
                     "published_cgroup_gb": published[0] if published else None,
                     "published_total_gb": published[1] if published else None})
    return rows

"""DLO resident blocks: the first k blocks stay on the device, the rest stream; exact outputs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from dlo_models import UnevenNet, build, make_input
from multirank import run_ranks
from safetensors.torch import save_file
from torch import nn

from runtime.dlo import apply_dlo
from runtime.dlo.layout import build_layout

FORWARDS = 3  # the third forward uses the first streamed block prefetched by the last one
UNIFORM_BLOCKS = 6


def _build(model_name: str, *, meta: bool = False) -> nn.Module:
    """The shared test models, plus "uniform": equal blocks, like a DiT's."""
    if model_name != "uniform":
        return build(model_name, torch.float32, meta=meta)
    if meta:
        with torch.device("meta"):
            return UnevenNet(num_blocks=UNIFORM_BLOCKS).eval()
    torch.manual_seed(0)
    return UnevenNet(num_blocks=UNIFORM_BLOCKS).eval()


def block_sizes(model_name: str, shard_count: int) -> list[tuple[int, int]]:
    """(padded bytes, shard bytes) of every block in streaming order, as DLO lays them out."""
    model = _build(model_name, meta=True)
    lists = [(n, m) for n, m in model.named_children() if isinstance(m, nn.ModuleList)]
    blocks = [(f"{n}.{i}", b) for n, m in lists for i, b in enumerate(m)]
    layouts = [build_layout(i, path, b, shard_count) for i, (path, b) in enumerate(blocks)]
    return [(lay.padded_bytes, lay.shard_bytes) for lay in layouts]


def budget_for(sizes: list[tuple[int, int]], k: int) -> int:
    """Device bytes for k resident blocks plus two slots for the largest block still streamed."""
    padded = [p for p, _ in sizes]
    return sum(padded[:k]) + 2 * max(padded[k:], default=0)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [b for _, m in model.named_children() if isinstance(m, nn.ModuleList) for b in m]


def _scenario(rank: int, world: int, model_name: str, *, ckpt: str | None = None,
              idle_rank: int | None = None, **kwargs: Any) -> dict[str, Any]:
    """Resident model vs DLO model with ``kwargs``; what stays resident; gathers over time."""
    reference = _build(model_name)
    if ckpt is not None:
        model = _build(model_name, meta=True)
    else:
        model = copy.deepcopy(reference)
    handle = apply_dlo(model, checkpoint=ckpt, **kwargs)
    setup_gathers = handle.stats()["num_gathers"]
    equal, gathers_after = [], []
    with torch.no_grad():
        for call in range(FORWARDS):
            if rank == idle_rank:
                handle.idle_forward()
            else:
                x = make_input(rank, call, torch.float32)
                equal.append(torch.equal(reference(x), model(x)))
            gathers_after.append(handle.stats()["num_gathers"])
    # Outside any forward: resident blocks hold real tensors, streamed ones meta placeholders.
    resident_mask = [not any(p.is_meta for p in b.parameters()) for b in _blocks(model)]
    streamed_meta = [all(p.is_meta for p in b.parameters()) for b in _blocks(model)]
    stats = handle.stats()
    counts = (handle.num_blocks, handle.resident_blocks, handle.streamed_blocks,
              handle.num_acquired)
    handle.close()
    return {"equal": equal, "stats": stats, "resident_mask": resident_mask,
            "streamed_meta": streamed_meta, "counts": counts, "setup_gathers": setup_gathers,
            "gathers_after": gathers_after, "final_gathers": handle.stats()["num_gathers"]}


def resident_rank(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    uneven2, uneven1 = block_sizes("uneven", 2), block_sizes("uneven", 1)
    uniform2, uniform1 = block_sizes("uniform", 2), block_sizes("uniform", 1)
    everything = sum(p for p, _ in uneven2)
    out = {
        "budget3-allgather": _scenario(rank, world, "uniform",
                                       device_budget_bytes=budget_for(uniform2, 3)),
        "budget3-allgather-ckpt": _scenario(rank, world, "uniform", ckpt=ckpt,
                                            device_budget_bytes=budget_for(uniform2, 3)),
        "budget3-rank-local": _scenario(rank, world, "uniform", use_allgather=False,
                                        device_budget_bytes=budget_for(uniform1, 3)),
        "all-allgather": _scenario(rank, world, "uneven", device_budget_bytes=everything),
        "all-rank-local": _scenario(rank, world, "uneven", use_allgather=False,
                                    device_budget_bytes=sum(p for p, _ in uneven1)),
        "explicit3-allgather": _scenario(rank, world, "uneven", resident_blocks=3),
        "explicit4-two-lists": _scenario(rank, world, "two_lists", resident_blocks=4),
        "explicit3-rank-local": _scenario(rank, world, "uneven", use_allgather=False,
                                          resident_blocks=3),
        # Rank 1 has room for every block, rank 0 for one: both keep one.
        "disagree": _scenario(rank, world, "uneven", device_budget_bytes=(
            budget_for(uneven2, 1) if rank == 0 else everything)),
        # Rank 1 only takes part in the streamed blocks' gathers.
        "idle": _scenario(rank, world, "uneven", idle_rank=1, resident_blocks=2),
    }
    try:  # one rank's bad value is a ValueError on every rank, not a hang
        apply_dlo(build("uneven", torch.float32), resident_blocks=-1 if rank == 1 else 2)
        out["bad-on-one-rank"] = "no error"
    except ValueError as exc:
        out["bad-on-one-rank"] = f"ValueError: {exc}"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = tmp_path_factory.mktemp("resident") / "uniform.safetensors"
    state = _build("uniform").state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return run_ranks(2, resident_rank, str(path), timeout=180)


def _check_resident(r: dict[str, Any], k: int, sizes: list[tuple[int, int]],
                    allgather: bool) -> None:
    n = len(sizes)
    padded = [p for p, _ in sizes]
    assert r["equal"] == [True] * FORWARDS
    assert r["resident_mask"] == [True] * k + [False] * (n - k)
    assert r["streamed_meta"] == [False] * k + [True] * (n - k)
    assert r["counts"] == (n, k, n - k, FORWARDS * (n - k))
    stats = r["stats"]
    assert stats["resident_blocks"] == k
    assert stats["resident_block_bytes"] == sum(padded[:k])
    assert stats["device_weight_buffer_bytes"] == sum(padded[:k]) + 2 * max(padded[k:],
                                                                          default=0)
    assert stats["num_blocks"] == n
    if allgather:
        # Set-up gathers each resident block once; each forward gathers only the streamed ones,
        # plus the prefetch of the first streamed block for the next forward.
        assert r["setup_gathers"] >= k
        streamed = n - k
        assert r["final_gathers"] == k + FORWARDS * streamed + (1 if streamed else 0)
        # The slab holds only the streamed blocks' shards.
        assert stats["host_shard_bytes"] == sum(s for _, s in sizes[k:])
    else:
        assert r["final_gathers"] == 0


@pytest.mark.parametrize("name", ["budget3-allgather", "budget3-allgather-ckpt",
                                  "budget3-rank-local"])
def test_budget_for_k_blocks_keeps_exactly_k_resident_and_output_is_exact(
        results: list[dict[str, Any]], name: str) -> None:
    allgather = "allgather" in name
    sizes = block_sizes("uniform", 2 if allgather else 1)
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["stats"]["mode"] == ("allgather" if allgather else "rank-local"), rank
        _check_resident(r, 3, sizes, allgather)


@pytest.mark.parametrize("name", ["all-allgather", "all-rank-local"])
def test_budget_for_all_blocks_gathers_nothing_per_forward(
        results: list[dict[str, Any]], name: str) -> None:
    allgather = "allgather" in name
    sizes = block_sizes("uneven", 2 if allgather else 1)
    for per_rank in results:
        r = per_rank[name]
        _check_resident(r, 5, sizes, allgather)
        # No slots: the device holds the blocks and nothing more.
        assert r["stats"]["device_weight_buffer_bytes"] == r["stats"]["resident_block_bytes"]
        assert r["setup_gathers"] == (5 if allgather else 0)
        assert r["gathers_after"] == [r["setup_gathers"]] * FORWARDS
        assert r["counts"][3] == 0  # nothing acquired


@pytest.mark.parametrize(("name", "model", "k", "allgather"), [
    ("explicit3-allgather", "uneven", 3, True),
    ("explicit4-two-lists", "two_lists", 4, True),  # resident blocks span both block lists
    ("explicit3-rank-local", "uneven", 3, False),
])
def test_explicit_resident_blocks(results: list[dict[str, Any]], name: str, model: str, k: int,
                                  allgather: bool) -> None:
    sizes = block_sizes(model, 2 if allgather else 1)
    for per_rank in results:
        _check_resident(per_rank[name], k, sizes, allgather)


def test_ranks_agree_on_the_fewest_resident_blocks(results: list[dict[str, Any]]) -> None:
    sizes = block_sizes("uneven", 2)
    for per_rank in results:
        _check_resident(per_rank["disagree"], 1, sizes, True)


def test_idle_rank_joins_only_the_streamed_blocks_gathers(results: list[dict[str, Any]]) -> None:
    busy, idle = results[0]["idle"], results[1]["idle"]
    assert busy["equal"] == [True] * FORWARDS
    assert idle["equal"] == []
    assert busy["final_gathers"] == idle["final_gathers"] == 2 + FORWARDS * 3 + 1
    assert idle["counts"] == (5, 2, 3, FORWARDS * 3)


def test_bad_value_on_one_rank_is_a_value_error_on_every_rank(
        results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        r = per_rank["bad-on-one-rank"]
        assert r.startswith("ValueError: ") and "resident_blocks must be a non-negative" in r


# ---- one process ------------------------------------------------------------------------------

def test_budget_one_byte_short_keeps_fewer_blocks_and_too_small_a_budget_streams_all() -> None:
    sizes = block_sizes("uniform", 1)
    for budget, expected in ((budget_for(sizes, 3), 3), (budget_for(sizes, 3) - 1, 2),
                             (budget_for(sizes, 0) - 1, 0), (0, 0)):
        handle = apply_dlo(_build("uniform"), device_budget_bytes=budget)
        assert handle.resident_blocks == expected, budget
        handle.close()


def test_budget_that_holds_every_block_without_slots_keeps_them_all() -> None:
    # The uneven model's largest block is its second: 2 blocks plus two slots for the largest
    # still streamed take more than all 5 blocks with no slot at all.
    sizes = block_sizes("uneven", 1)
    budget = budget_for(sizes, 2)
    assert sum(p for p, _ in sizes) <= budget
    handle = apply_dlo(build("uneven", torch.float32), device_budget_bytes=budget)
    assert (handle.resident_blocks, handle.stats()["device_weight_buffer_bytes"]) == (
        5, sum(p for p, _ in sizes))
    handle.close()


def test_resident_blocks_beyond_the_block_count_is_clamped_and_needs_no_idle_work() -> None:
    reference = build("uneven", torch.float32)
    model = copy.deepcopy(reference)
    handle = apply_dlo(model, resident_blocks=99, device_budget_bytes=0)  # the count wins
    assert (handle.resident_blocks, handle.streamed_blocks, handle.num_blocks) == (5, 0, 5)
    handle.idle_forward()
    handle.idle_until(handle.num_acquired + 3 * handle.streamed_blocks)
    x = make_input(0, 0, torch.float32)
    with torch.no_grad():
        assert torch.equal(reference(x), model(x))
    assert handle.num_acquired == 0
    handle.close()
    assert all(p.is_meta for p in model.blocks.parameters())  # the buffers went with the handle


def test_default_streams_every_block() -> None:
    handle = apply_dlo(build("uneven", torch.float32))
    stats = handle.stats()
    assert (stats["resident_blocks"], stats["resident_block_bytes"]) == (0, 0)
    assert stats["device_weight_buffer_bytes"] == 2 * stats["max_block_bytes"]
    assert handle.streamed_blocks == handle.num_blocks == 5
    handle.close()


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"resident_blocks": -1}, "resident_blocks must be a non-negative integer"),
    ({"resident_blocks": 1.5}, "resident_blocks must be a non-negative integer"),
    ({"resident_blocks": True}, "resident_blocks must be a non-negative integer"),
    ({"device_budget_bytes": -5}, "device_budget_bytes must be a non-negative integer"),
    ({"resident_blocks": 2, "device_budget_bytes": -5}, "device_budget_bytes must be"),
])
def test_bad_values_are_value_errors(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        apply_dlo(build("uneven", torch.float32), **kwargs)


def test_resident_blocks_load_from_a_checkpoint_in_one_process(tmp_path: Path) -> None:
    """One CPU process, rank-local: resident blocks are the checkpoint's mapping, not copies."""
    path = tmp_path / "uneven.safetensors"
    reference = build("uneven", torch.float32)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    model = build("uneven", torch.float32, meta=True)
    handle = apply_dlo(model, checkpoint=path, resident_blocks=2)
    x = make_input(0, 1, torch.float32)
    with torch.no_grad():
        assert torch.equal(reference(x), model(x))
        assert torch.equal(reference(x), model(x))
    assert handle.num_acquired == 2 * 3
    stats = handle.stats()
    assert stats["mapped_blocks"] == 2
    # Only the two slots are this rank's own; the resident blocks live in the file's pages.
    assert stats["device_weight_buffer_bytes"] == 2 * max(
        lay.padded_bytes for lay in handle._layouts[2:])
    mapping = handle._source.checkpoint.files[0]._bytes
    lo, hi = mapping.data_ptr(), mapping.data_ptr() + mapping.numel()
    block = next(iter(model.get_submodule(handle._layouts[0].path).parameters()))
    assert lo <= block.data_ptr() < hi
    handle.close()

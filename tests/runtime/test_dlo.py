"""DLO engine: bit-exactness against the resident model across dp sizes, bounded slots, errors."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from dlo_models import MODELS, NoBlocksNet, UnevenNet, build, make_input, param_count
from multirank import run_ranks
from safetensors.torch import save_file
from torch import nn

from runtime.dlo import apply_dlo, find_block_lists

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCENARIOS = [
    (model, dtype, source, mode)
    for model, dtype, source, mode in itertools.product(
        MODELS, DTYPES, ("materialised", "checkpoint"), ("allgather", "rank-local"))
    if not (model == "mixed_dtype" and dtype == "bf16")  # mixed_dtype has its own dtypes
]


def _scenario_id(s: tuple[str, str, str, str]) -> str:
    return "-".join(s)


def _input_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def write_checkpoints(directory: Path) -> dict[str, str]:
    """One safetensors file per (model, dtype), from the same seed the ranks build with."""
    paths = {}
    for name, dt in itertools.product(MODELS, DTYPES):
        path = directory / f"{name}-{dt}.safetensors"
        save_file({k: v.contiguous() for k, v in build(name, DTYPES[dt]).state_dict().items()},
                  str(path))
        paths[f"{name}-{dt}"] = str(path)
    return paths


def exactness_rank(rank: int, world: int, checkpoints: dict[str, str]) -> dict[str, Any]:
    """On every rank: resident forward vs DLO forward, different inputs per rank, all scenarios."""
    results = {}
    for model_name, dt, source, mode in SCENARIOS:
        dtype = DTYPES[dt]
        reference = build(model_name, dtype)
        if source == "checkpoint":
            model = build(model_name, dtype, meta=True)
            ckpt = checkpoints[f"{model_name}-{dt}"]
        else:
            model, ckpt = copy.deepcopy(reference), None
        handle = apply_dlo(model, checkpoint=ckpt, use_allgather=(mode == "allgather"))
        equal = []
        with torch.no_grad():
            for call in range(3):  # the third forward uses block 0 prefetched by the last block
                x = make_input(rank, call, _input_dtype(reference))
                equal.append(torch.equal(reference(x), model(x)))
        stats = handle.stats()
        handle.close()
        results[_scenario_id((model_name, dt, source, mode))] = {"equal": equal, "stats": stats}
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_checkpoints(tmp_path_factory.mktemp("dlo-ckpt"))


_exactness_cache: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def exactness(checkpoints: dict[str, str]) -> Any:
    def results_for(dp: int) -> list[dict[str, Any]]:
        if dp not in _exactness_cache:
            _exactness_cache[dp] = run_ranks(dp, exactness_rank, checkpoints, timeout=300)
        return _exactness_cache[dp]

    return results_for


def test_test_models_have_parameter_counts_not_divisible_by_dp() -> None:
    for name in MODELS:
        n = param_count(build(name, torch.float32))
        assert all(n % dp for dp in (2, 3, 4)), (name, n)


# Four ranks on two cores take longest: `make chaos` runs them; three already shard unevenly.
@pytest.mark.parametrize("dp", [1, 2, 3, pytest.param(4, marks=pytest.mark.chaos)])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=_scenario_id)
def test_dlo_forward_equals_resident_forward_bit_for_bit(
    exactness: Any, dp: int, scenario: tuple[str, str, str, str]
) -> None:
    for rank, per_rank in enumerate(exactness(dp)):
        result = per_rank[_scenario_id(scenario)]
        assert result["equal"] == [True, True, True], f"rank {rank} of dp={dp}"
        expected_shards = dp if scenario[3] == "allgather" else 1
        assert result["stats"]["shard_count"] == expected_shards


def idle_rank(rank: int, world: int) -> list[bool]:
    """Rank 0 runs forwards; rank 1 only takes part in the gathers, without computing."""
    reference = build("uneven", torch.float32)
    model = copy.deepcopy(reference)
    handle = apply_dlo(model)
    equal = []
    with torch.no_grad():
        for call in range(4):
            if rank == 0:
                x = make_input(rank, call, torch.float32)
                equal.append(torch.equal(reference(x), model(x)))
            else:
                handle.idle_forward()
    handle.close()
    return equal


def test_idle_rank_joins_gathers_without_computing_so_busy_rank_stays_exact() -> None:
    busy, idle = run_ranks(2, idle_rank, timeout=120)
    assert busy == [True] * 4
    assert idle == []


def reorder_rank(rank: int, world: int) -> list[bool]:
    reference = build("reversed", torch.float32)
    model = copy.deepcopy(reference)
    handle = apply_dlo(model)
    with torch.no_grad():
        out = [torch.equal(reference(x), model(x))
               for x in (make_input(rank, c, torch.float32) for c in range(2))]
    handle.close()
    return out


def test_blocks_run_out_of_declared_order_still_exact_on_every_rank() -> None:
    results = run_ranks(2, reorder_rank, timeout=120)
    assert results == [[True, True], [True, True]]


def subgroup_rank(rank: int, world: int) -> list[bool]:
    """Two worker groups of 2 ranks in one world of 4, each sharing its own copy of the weights."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    reference = build("two_lists", torch.float32)
    equal = []
    for attempt in range(2):  # a second handle over the same group after the first is closed
        model = copy.deepcopy(reference)
        handle = apply_dlo(model, group=mine)
        assert handle.stats()["shard_count"] == 2
        with torch.no_grad():
            x = make_input(rank, attempt, torch.float32)
            equal.append(torch.equal(reference(x), model(x)))
        handle.close()
    return equal


def test_two_worker_groups_in_one_world_each_gather_within_their_group() -> None:
    assert run_ranks(4, subgroup_rank, timeout=120) == [[True, True]] * 4


class _Boom(RuntimeError):
    pass


def failing_rank(rank: int, world: int) -> list[bool]:
    """Rank 1's forward raises inside block 2; it makes up the missing gathers with idle_until."""
    reference = build("uneven", torch.float32)
    model = copy.deepcopy(reference)
    handle = apply_dlo(model)
    if rank == 1:
        model.blocks[2].register_forward_pre_hook(_explode)
    results = []
    with torch.no_grad():
        for call in range(2):
            target = handle.num_acquired + handle.num_blocks
            x = make_input(rank, call, torch.float32)
            try:
                results.append(torch.equal(reference(x), model(x)))
            except _Boom:
                handle.idle_until(target)
                results.append(False)
    handle.close()
    return results


def test_rank_whose_forward_raised_completes_its_gathers_and_others_are_unaffected() -> None:
    busy, failing = run_ranks(2, failing_rank, timeout=120)
    assert busy == [True, True]
    assert failing == [False, False]


def _explode(module: nn.Module, args: Any) -> None:
    raise _Boom("block 2 failed")


def test_forward_that_raises_inside_a_block_leaves_the_handle_usable() -> None:
    torch.manual_seed(0)
    reference = UnevenNet().eval()
    model = copy.deepcopy(reference)
    handle = apply_dlo(model)

    hook = model.blocks[2].register_forward_pre_hook(_explode)
    x = make_input(0, 0, torch.float32)
    with torch.no_grad(), pytest.raises(_Boom):
        model(x)
    hook.remove()
    with torch.no_grad():
        assert torch.equal(reference(x), model(x))
        assert torch.equal(reference(x), model(x))
    handle.close()


# ---- bounded device weights ------------------------------------------------------------------

def _stats_for_depth(num_blocks: int) -> tuple[dict[str, Any], int, int]:
    model = UnevenNet(num_blocks=num_blocks, width=32).eval()
    block_bytes = sum(t.numel() * t.element_size()
                      for t in itertools.chain(model.blocks[0].parameters(),
                                               model.blocks[0].buffers()))
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if not n.startswith("blocks."))
    handle = apply_dlo(model)
    stats = handle.stats()
    handle.close()
    return stats, block_bytes, resident


def test_device_weight_buffers_are_two_max_blocks_identical_for_8_and_64_blocks() -> None:
    shallow, block_bytes, resident = _stats_for_depth(8)
    deep, _, _ = _stats_for_depth(64)
    assert (shallow["num_blocks"], deep["num_blocks"]) == (8, 64)
    for stats in (shallow, deep):
        # Up to padding: each of the block's 7 tensors starts on a 64-byte boundary.
        assert block_bytes <= stats["max_block_bytes"] < block_bytes + 64 * 7
        assert stats["device_weight_buffer_bytes"] == 2 * stats["max_block_bytes"]
        # Non-block tensors are counted apart.
        assert stats["resident_bytes"] == resident
    assert shallow["device_weight_buffer_bytes"] == deep["device_weight_buffer_bytes"]
    assert deep["host_shard_bytes"] == 8 * shallow["host_shard_bytes"]


def test_block_parameters_hold_no_memory_outside_their_forward() -> None:
    model = UnevenNet().eval()
    handle = apply_dlo(model)
    seen: list[bool] = []
    # Registered after DLO's own pre-hook, so it runs once the block is bound to its slot.
    hook = model.blocks[1].register_forward_pre_hook(
        lambda m, a: seen.append(m.up.weight.device.type == "cpu"))
    with torch.no_grad():
        model(make_input(0, 0, torch.float32))
    hook.remove()
    assert seen == [True]  # a real tensor in the slot during the block's forward
    assert all(p.is_meta for p in model.blocks.parameters())  # placeholders otherwise
    assert not any(p.is_meta for n, p in model.named_parameters() if not n.startswith("blocks"))
    handle.close()


def test_block_lists_are_found_by_parameter_share() -> None:
    assert find_block_lists(build("two_lists", torch.float32)) == ["double_blocks",
                                                                   "single_blocks"]
    assert find_block_lists(build("uneven", torch.float32)) == ["blocks"]


# ---- errors: a clear ValueError on every rank, never a hang ----------------------------------

def errors_rank(rank: int, world: int, case: str, ckpt_dir: str) -> str:
    ckpt: str | None = f"{ckpt_dir}/uneven.safetensors"
    model: nn.Module = build("uneven", torch.float32, meta=True)
    if case == "missing_key" and rank == 1:
        ckpt = f"{ckpt_dir}/missing.safetensors"
    elif case == "shape":
        ckpt = f"{ckpt_dir}/shape.safetensors"
    elif case == "dtype":
        ckpt = f"{ckpt_dir}/dtype.safetensors"
    elif case == "layout" and rank == 1:
        model, ckpt = UnevenNet(width=16).eval(), None
    elif case == "no_blocks":
        model, ckpt = NoBlocksNet(), None
    try:
        apply_dlo(model, checkpoint=ckpt)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


@pytest.fixture(scope="module")
def broken_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("broken")
    good = {k: v.contiguous() for k, v in build("uneven", torch.float32).state_dict().items()}
    save_file(good, str(d / "uneven.safetensors"))
    save_file({k: v for k, v in good.items() if k != "blocks.3.up.weight"},
              str(d / "missing.safetensors"))
    save_file({**good, "blocks.1.down.weight": torch.zeros(3, 3)}, str(d / "shape.safetensors"))
    save_file({**good, "head.bias": good["head.bias"].to(torch.float16)},
              str(d / "dtype.safetensors"))
    return str(d)


@pytest.mark.parametrize(("case", "needle"), [
    ("missing_key", "missing 1 key(s): 'blocks.3.up.weight'"),
    ("shape", "'blocks.1.down.weight' has shape [3, 3], the model expects [24, 64]"),
    ("dtype", "'head.bias' has dtype torch.float16, the model expects torch.float32"),
    ("layout", "shard layouts differ across ranks"),
    ("no_blocks", "no block list found in NoBlocksNet"),
])
def test_bad_checkpoint_or_layout_raises_clear_value_error_on_every_rank(
        broken_checkpoints: str, case: str, needle: str) -> None:
    results = run_ranks(2, errors_rank, case, broken_checkpoints, timeout=120)
    for rank, r in enumerate(results):
        assert r.startswith("ValueError: ") and needle in r, f"rank {rank}: {r}"
    if case == "missing_key":  # only rank 1 was missing it: rank 1 is named on both ranks
        assert all("rank(s) 1:" in r for r in results)


class TiedNet(UnevenNet):
    """One weight under two state_dict names, as T5's shared embedding is."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 24, bias=False)
        self.head = nn.Linear(24, 3, bias=False)
        self.unembed = self.head  # the same module, so the same weight, under a second name


def test_tied_weight_stored_under_one_name_loads_from_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = TiedNet().eval()
    state = reference.state_dict()
    assert "unembed.weight" in state and "head.weight" in state
    stored = {k: v.contiguous() for k, v in state.items() if not k.startswith("unembed.")}
    save_file(stored, str(tmp_path / "tied.safetensors"))
    with torch.device("meta"):
        model = TiedNet().eval()
    handle = apply_dlo(model, checkpoint=tmp_path / "tied.safetensors")
    assert model.head.weight is model.unembed.weight  # still tied after loading
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        assert torch.equal(reference(x), model(x))
    handle.close()


def test_meta_model_without_checkpoint_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="on the meta device"):
        apply_dlo(build("uneven", torch.float32, meta=True))


def test_blocks_argument_naming_a_missing_list_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="block list 'layers' not found"):
        apply_dlo(build("uneven", torch.float32), blocks=["layers"])

"""What of a job's denoising state a checkpoint holds, as tensors and JSON values, and putting it
back into a state that ``prepare`` built: the default of `VideoPipeline`'s resume hooks
(``runtime.resume`` writes them with safetensors).

A checkpoint holds only what a step changes: the latents, the step index, the state of every
diffusers scheduler in ``state.extra`` (a multistep scheduler's history), every
``torch.Generator`` reachable from it (a stochastic step's noise), and the entries of
``state.extra`` a family names in ``resume_keys`` (what its step replaces). ``prepare`` rebuilds
the rest from the request: text embeddings, the initial noise, the schedule.

Values travel as JSON: None, booleans, numbers and strings as themselves, everything else as an
object with one tag (``{"tensor": name, "cpu": bool}``, ``{"list": [...]}``, ``{"tuple": [...]}``,
``{"dict": {...}}``), so restoring runs no code from the checkpoint (nothing is unpickled).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

# The tags of the JSON objects that stand for containers JSON has no type for (a tensor is
# ``{"tensor": name, "cpu": bool}``).
_TAGS = ("list", "tuple", "dict")


class IncompatibleCheckpoint(ValueError):
    """A checkpoint this job cannot resume from; the message says why (``reason``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"cannot resume from this checkpoint: {reason}")
        self.reason = reason


def _is_scheduler(value: Any) -> bool:
    # diffusers is not imported here (a kiln-tiny process never loads it), and no object is one
    # of its schedulers before it is loaded.
    utils = sys.modules.get("diffusers.schedulers.scheduling_utils")
    return utils is not None and isinstance(value, utils.SchedulerMixin)


def _find(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The diffusers schedulers and torch generators in ``value`` (through dicts, lists and
    tuples), by dotted path."""
    if _is_scheduler(value) or isinstance(value, torch.Generator):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                yield from _find(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _find(item, f"{path}.{i}")


def _plain(value: Any) -> bool:
    """Whether a scheduler attribute is state a checkpoint carries: tensors, numbers, booleans,
    None, and lists or tuples of them. Its config (a dict) and the objects it holds are not."""
    if value is None or isinstance(value, bool | int | float | torch.Tensor):
        return True
    return isinstance(value, list | tuple) and all(_plain(v) for v in value)


def _scheduler_attributes(scheduler: Any) -> dict[str, Any]:
    # All of them, not a list of what each class's step() mutates (UniPC: its history of model
    # outputs and timesteps, last_sample, lower_order_nums, this_order, _step_index): a newer
    # diffusers may mutate more, and the constant tables (betas, alphas_cumprod) are kilobytes
    # next to the latents.
    return {name: v for name, v in vars(scheduler).items() if _plain(v)}


class _Writer:
    """Encodes values as JSON, collecting their tensors by name."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[int, dict[str, Any]] = {}  # id(tensor) -> its node

    def encode(self, value: Any, name: str) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, torch.Tensor):
            # One tensor held in two places is saved once and restored as one object.
            if id(value) not in self._seen:
                self.tensors[name] = value
                self._seen[id(value)] = {"tensor": name, "cpu": value.device.type == "cpu"}
            return self._seen[id(value)]
        if isinstance(value, list | tuple):
            return {type(value).__name__: [self.encode(v, f"{name}.{i}")
                                           for i, v in enumerate(value)]}
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return {"dict": {k: self.encode(v, f"{name}.{k}") for k, v in value.items()}}
        raise TypeError(f"{name}: a checkpoint cannot hold a {type(value).__name__} (the "
                        "pipeline's resume hooks must say how to save it)")


class _Reader:
    """Decodes the JSON of `_Writer`, checking tensors against what ``prepare`` built."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.tensors = tensors
        self.device = device  # where a tensor saved off the CPU goes, without a counterpart
        self.used: set[str] = set()
        self._made: dict[str, torch.Tensor] = {}

    def decode(self, node: Any, where: str, like: Any = None) -> Any:
        """``node`` as a value; ``like``: what ``prepare`` put there, if anything. Where it is a
        tensor, the checkpoint's must be one of the same shape and dtype."""
        value = self._decode(node, where, like)
        if isinstance(like, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise IncompatibleCheckpoint(f"{where} is a {type(value).__name__} in the "
                                             "checkpoint, a tensor in this job")
            if value.shape != like.shape or value.dtype != like.dtype:
                raise IncompatibleCheckpoint(
                    f"{where} is {value.dtype} {tuple(value.shape)} in the checkpoint, "
                    f"{like.dtype} {tuple(like.shape)} in this job")
        return value

    def _decode(self, node: Any, where: str, like: Any) -> Any:
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if isinstance(node, dict) and set(node) == {"tensor", "cpu"}:
            return self._tensor(node, where, like)
        if not (isinstance(node, dict) and len(node) == 1 and next(iter(node)) in _TAGS):
            raise IncompatibleCheckpoint(f"{where}: unreadable value {str(node)[:80]!r}")
        (tag, items), = node.items()
        if tag == "dict":
            if not isinstance(items, dict):
                raise IncompatibleCheckpoint(f"{where}: unreadable value")
            likes = like if isinstance(like, Mapping) else {}
            return {k: self.decode(v, f"{where}.{k}", likes.get(k)) for k, v in items.items()}
        if not isinstance(items, list):
            raise IncompatibleCheckpoint(f"{where}: unreadable value")
        item_likes = (like if isinstance(like, list | tuple) and len(like) == len(items)
                      else [None] * len(items))
        out = [self.decode(v, f"{where}.{i}", w) for i, (v, w) in
               enumerate(zip(items, item_likes, strict=True))]
        return tuple(out) if tag == "tuple" else out

    def _tensor(self, node: dict[str, Any], where: str, like: Any) -> torch.Tensor:
        name, on_cpu = node["tensor"], node["cpu"]
        if not isinstance(name, str) or not isinstance(on_cpu, bool):
            raise IncompatibleCheckpoint(f"{where}: unreadable value {str(node)[:80]!r}")
        if name in self._made:
            return self._made[name]
        if name not in self.tensors:
            raise IncompatibleCheckpoint(f"{where}: the checkpoint lacks tensor {name!r}")
        # Beside its counterpart; else a host tensor stays on the host (UniPC keeps its sigmas
        # there) and a device one goes to this job's device.
        device = (like.device if isinstance(like, torch.Tensor)
                  else torch.device("cpu") if on_cpu else self.device)
        tensor = self.tensors[name].to(device)
        self.used.add(name)
        self._made[name] = tensor
        return tensor


def _state_paths(state: Any) -> tuple[dict[str, Any], dict[str, torch.Generator]]:
    schedulers: dict[str, Any] = {}
    generators: dict[str, torch.Generator] = {}
    for path, obj in _find(state.extra, "extra"):
        (generators if isinstance(obj, torch.Generator) else schedulers)[path] = obj
    return schedulers, generators


def capture(state: Any, keys: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by name, JSON values) of ``state``'s dynamic parts: the latents, the step
    index, the schedulers and generators in ``state.extra``, and its entries ``keys``."""
    writer = _Writer()
    schedulers, generators = _state_paths(state)
    values = {
        "step_index": state.step_index,
        "latents": writer.encode(state.latents, "latents"),
        "extra": {k: writer.encode(state.extra.get(k), f"extra.{k}") for k in keys},
        "schedulers": {path: {"class": type(s).__name__, "state": {
            attr: writer.encode(v, f"{path}.{attr}")
            for attr, v in _scheduler_attributes(s).items()}}
            for path, s in schedulers.items()},
        "generators": {path: {"device": str(g.device),
                              "state": writer.encode(g.get_state(), path)}
                       for path, g in generators.items()},
    }
    return writer.tensors, values


def _same_paths(what: str, saved: Mapping[str, Any], found: Mapping[str, Any]) -> None:
    if set(saved) != set(found):
        raise IncompatibleCheckpoint(f"the checkpoint holds {what} {sorted(saved)}, this job "
                                     f"has {sorted(found)}")


def load(state: Any, keys: tuple[str, ...], tensors: Mapping[str, torch.Tensor],
         values: Any) -> None:
    """Overwrite ``state`` (as ``prepare`` built it) with what `capture` saved; an
    `IncompatibleCheckpoint` saying what differs when the checkpoint does not fit it."""
    parts = ("step_index", "latents", "extra", "schedulers", "generators")
    if not isinstance(values, dict) or set(values) != set(parts) or not all(
            isinstance(values[p], dict) for p in parts[2:]):
        raise IncompatibleCheckpoint("its values are not those of a denoising state")
    reader = _Reader(tensors, state.latents.device)
    step = values["step_index"]
    if not isinstance(step, int) or isinstance(step, bool):
        raise IncompatibleCheckpoint(f"step_index is {step!r}, not a step")
    latents = reader.decode(values["latents"], "latents", state.latents)
    _same_paths("entries", values["extra"], dict.fromkeys(keys))
    extra = {k: reader.decode(values["extra"][k], f"extra.{k}", state.extra.get(k))
             for k in keys}
    schedulers, generators = _state_paths(state)
    _same_paths("schedulers", values["schedulers"], schedulers)
    _same_paths("generators", values["generators"], generators)
    settings: list[tuple[Any, str, Any]] = []
    for path, scheduler in schedulers.items():
        saved = values["schedulers"][path]
        if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
            raise IncompatibleCheckpoint(f"{path}: unreadable scheduler state")
        if saved.get("class") != type(scheduler).__name__:
            raise IncompatibleCheckpoint(f"{path} is a {saved.get('class')} in the checkpoint, "
                                         f"a {type(scheduler).__name__} in this job")
        own = vars(scheduler)
        for attr, node in saved["state"].items():
            # Only instance state: never a method, property or other class attribute.
            if not attr.isidentifier() or attr.startswith("__") or (
                    attr not in own and hasattr(type(scheduler), attr)):
                raise IncompatibleCheckpoint(f"{path}: {attr!r} is not scheduler state")
            settings.append((scheduler, attr, reader.decode(node, f"{path}.{attr}",
                                                            own.get(attr))))
    states: list[tuple[str, torch.Generator, torch.Tensor]] = []
    for path, generator in generators.items():
        saved = values["generators"][path]
        if not isinstance(saved, dict) or saved.get("device") != str(generator.device):
            raise IncompatibleCheckpoint(f"{path}: a generator on {saved.get('device')!r} in "
                                         f"the checkpoint, on {str(generator.device)!r} in "
                                         "this job")
        states.append((path, generator, reader.decode(saved.get("state"), path,
                                                      generator.get_state())))
    unused = set(tensors) - reader.used
    if unused:
        raise IncompatibleCheckpoint(f"the checkpoint holds tensors this job has no place for: "
                                     f"{sorted(unused)[:5]}")
    # Everything read and checked: only now is the state changed.
    for path, generator, rng in states:
        try:
            generator.set_state(rng)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise IncompatibleCheckpoint(f"{path}: {exc}") from exc
    for scheduler, attr, value in settings:
        setattr(scheduler, attr, value)
    state.extra.update(extra)
    state.latents = latents
    state.step_index = step

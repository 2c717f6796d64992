"""Per-job LoRA adapters, applied on the activation side of a transformer's ``nn.Linear`` layers.

Every rank of a DLO group gathers the same block weights, so an adapter cannot be merged into
them: the rank beside this one may render a job with another adapter, or none, on the very block
both just gathered. Instead a forward hook on each adapted Linear ``y = x @ W.T + b`` adds the
low-rank term of the job the rank is computing now::

    y + weight * alpha / rank * ((x @ A.T) @ B.T + bias_B)

with ``A`` (``lora_A``, ``[rank, in]``), ``B`` (``lora_B``, ``[out, rank]``), the optional
``bias_B`` (peft's ``lora_bias``), ``alpha`` and ``rank`` of that module (``alpha / sqrt(rank)``
with rsLoRA) and the job's ``weight`` for the adapter: the term peft's ``lora.Linear`` adds after
diffusers' ``load_lora_weights`` and ``set_adapters(names, weights)``, in the same order of
operations and in the same dtype (the Linear's), so the output is peft's bit for bit (fp32 and
bf16, tests/runtime/test_adapters.py). The gathers of a step are the same with or without
adapters.

- `load_adapter` reads a ``.safetensors`` LoRA in any layout diffusers' loader of the family
  accepts (its own ``lora_state_dict`` normalises the keys; kiln-tiny, which diffusers does not
  know, takes peft's names as diffusers writes them, ``transformer.<module>.lora_A.weight``)
  and checks it against the transformer's modules: a ``ValueError`` names the first key that
  matches no Linear, the first shape that does not fit, or a rank that disagrees with the
  file's config.
- ``VideoRequest.adapters`` holds a job's ``(Adapter, weight)`` pairs, and
  ``VideoPipeline.step`` runs the job's forwards inside `use_adapters`, which sets them as the
  rank's current adapters for the duration. A job without adapters sets nothing.
- Hooks are installed on a Linear only when the first adapter that adapts it is used, and stay:
  a transformer that never ran an adapter runs without any hook, and a Linear no adapter touches
  never gets one. Once installed, a job without adapters pays one hook call per adapted Linear
  (a context-variable read: about 4 us per Linear call on the CPU, ``bench/adapters.py``), until
  `remove_adapter_hooks` takes them off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

#: diffusers' LoRA loader of each family, whose ``lora_state_dict`` normalises a file's keys;
#: None: the keys are read as they are (kiln-tiny, which diffusers has no loader for).
LOADERS: dict[str, str | None] = {
    "kiln-tiny": None,
    "wan": "WanLoraLoaderMixin",
    "cogvideox": "CogVideoXLoraLoaderMixin",
    "cosmos3": "CosmosLoraLoaderMixin",
    "minimax-h3": "MiniMaxH3LoraLoaderMixin",
}
#: The attributes of a diffusers pipeline that may hold a transformer an adapter targets.
TRANSFORMER_NAMES = ("transformer", "transformer_2", "transformer_ref")


@dataclass(frozen=True, slots=True, eq=False)
class LoraLayer:
    """One adapted Linear: its low-rank factors and their scale, on the CPU as loaded."""

    down: torch.Tensor  # lora_A, [rank, in_features]
    up: torch.Tensor  # lora_B, [out_features, rank]
    up_bias: torch.Tensor | None  # lora_B's bias, [out_features] (peft's lora_bias)
    alpha: float
    rslora: bool = False  # scale by alpha / sqrt(rank) instead of alpha / rank
    # The factors on the device and in the dtype a forward computes in, made on first use.
    _placed: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor | None]] = field(
        default_factory=dict, repr=False, init=False)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def scaling(self, weight: float) -> float:
        """The factor on ``B(A(x))`` for a job's ``weight``: peft's ``set_scale``, term for term
        (``weight * alpha / rank``), so the float is the one peft multiplies by."""
        if self.rslora:
            return weight * self.alpha / math.sqrt(self.rank)
        return weight * self.alpha / self.rank

    def on(self, device: torch.device,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(A, B, bias) on ``device`` in ``dtype`` (the adapted Linear's, as diffusers loads a
        LoRA into a model); copied once per device and dtype."""
        placed = self._placed.get((device, dtype))
        if placed is None:
            bias = None if self.up_bias is None else self.up_bias.to(device, dtype)
            placed = (self.down.to(device, dtype), self.up.to(device, dtype), bias)
            self._placed[(device, dtype)] = placed
        return placed


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Adapter:
    """A LoRA for one transformer of a model: its layers by the Linear's module name."""

    name: str
    target: str  # the pipeline attribute it adapts: "transformer", "transformer_2", ...
    layers: Mapping[str, LoraLayer]
    # sha256 (hex) of every factor, alpha and scale rule: what a job's checkpoint records of it.
    digest: str

    @property
    def num_bytes(self) -> int:
        """Bytes of its factors as loaded (a device copy per dtype comes on top)."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values()
                   for t in (layer.down, layer.up, layer.up_bias) if t is not None)


#: The adapters of the job this rank (thread, task) is computing now, with their weights.
_ACTIVE: ContextVar[tuple[tuple[Adapter, float], ...]] = ContextVar("kiln_adapters", default=())


@contextlib.contextmanager
def use_adapters(pipe: Any, adapters: Sequence[tuple[Adapter, float]]) -> Iterator[None]:
    """The forwards inside run with ``adapters`` (``(Adapter, weight)`` pairs, applied in that
    order) on ``pipe``'s transformers; with none (and none around), nothing is installed or
    set."""
    if not adapters and not _ACTIVE.get():
        yield
        return
    transformers = named_transformers(pipe)
    for adapter, _ in adapters:
        _install(transformers, adapter)
    token = _ACTIVE.set(tuple(adapters))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def named_transformers(pipe: Any) -> dict[str, nn.Module]:
    """The transformers of a kiln pipeline around a diffusers one (its ``pipe``), by the
    attribute diffusers names them with, or kiln-tiny's (its ``model``); none for a pipeline of
    another kind."""
    inner = getattr(pipe, "pipe", None) or getattr(pipe, "model", None)
    return {name: module for name in TRANSFORMER_NAMES
            if isinstance(module := getattr(inner, name, None), nn.Module)}


def load_adapter(path: str | Path, family: str, transformers: Mapping[str, nn.Module], *,
                 into: str = "transformer", name: str | None = None) -> Adapter:
    """The LoRA file ``path`` for a model of ``family`` (a ``common.families`` name), checked
    against ``transformers`` (`named_transformers` of the pipeline that will run it).

    Keys for diffusers' ``transformer`` load into ``into`` (Wan2.2's low-noise expert:
    ``"transformer_2"``, as diffusers' ``load_into_transformer_2``); keys that name another of
    ``transformers`` (MiniMax-H3's ``transformer_ref.``) load into that one. An adapter adapts one
    transformer. The scale of each module is the file's LoRA config where diffusers wrote one
    (rank, alpha, their per-module patterns, rsLoRA), else ``alpha == rank`` (scale 1), as
    diffusers loads such a file."""
    path = Path(path)
    if family not in LOADERS:
        raise ValueError(f"{family} takes no LoRA adapters; {', '.join(LOADERS)} do")
    if not path.is_file():
        raise ValueError(f"{path}: no such adapter file")
    loader = LOADERS[family]
    try:
        if loader is None:
            state_dict, metadata = _read_plain(path)
        else:
            # Here, not at the top: runtime.pipelines.base imports this module, and a kiln-tiny
            # process never loads diffusers.
            import diffusers.loaders as loaders

            state_dict, metadata = getattr(loaders, loader).lora_state_dict(
                str(path), use_safetensors=True, local_files_only=True,
                return_lora_metadata=True)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path}: not a safetensors LoRA file ({e})") from e
    if not state_dict:
        raise ValueError(f"{path}: no LoRA tensors")
    target, prefix = _target(path, state_dict, transformers, into)
    state_dict = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items()}
    if "lora_A" not in next(iter(state_dict)):  # as diffusers' load_lora_adapter converts
        # Here: diffusers loads only for a file in another layout (a kiln-tiny process never).
        from diffusers.utils import convert_unet_state_dict_to_peft

        state_dict = convert_unet_state_dict_to_peft(state_dict)
    config = {k.removeprefix(f"{prefix}."): v for k, v in (metadata or {}).items()
              if k.startswith(f"{prefix}.")}
    layers = _layers(path, state_dict, config, transformers[target])
    return Adapter(name=name or path.stem, target=target, layers=layers, digest=_digest(layers))


def _read_plain(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The file's tensors as named, and the LoRA config diffusers' ``save_lora_weights`` writes
    in its ``lora_adapter_metadata`` entry (None without one)."""
    with safe_open(path, framework="pt") as f:
        raw = (f.metadata() or {}).get("lora_adapter_metadata")
        state_dict = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    try:
        metadata = json.loads(raw) if raw else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: its lora_adapter_metadata is not JSON ({e})") from e
    return state_dict, metadata


def _target(path: Path, state_dict: Mapping[str, torch.Tensor],
            transformers: Mapping[str, nn.Module], into: str) -> tuple[str, str]:
    """(the transformer the file adapts, the key prefix that names it in the file)."""
    if into not in transformers:
        raise ValueError(f"{path}: this model has no {into} (it has {', '.join(transformers)})")
    prefixes: set[str] = set()
    for key in state_dict:
        prefix = key.split(".", 1)[0]
        if prefix != "transformer" and prefix not in transformers:
            raise ValueError(f"{path}: key {key!r} is not for a transformer this model runs "
                             f"({', '.join(transformers)}); kiln adapts transformers only")
        prefixes.add(prefix)
    if len(prefixes) > 1:
        raise ValueError(f"{path}: keys for {' and '.join(sorted(prefixes))}; an adapter "
                         "adapts one transformer")
    prefix = prefixes.pop()
    return (into if prefix == "transformer" else prefix), prefix


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """peft's per-module rank or alpha: the first pattern that matches the module name's end
    (``peft.utils.other.get_pattern_key``), else ``default``."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _layers(path: Path, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any],
            model: nn.Module) -> dict[str, LoraLayer]:
    if config.get("use_dora"):
        raise ValueError(f"{path}: a DoRA adapter; kiln applies plain LoRA only")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        for part in ("lora_A.weight", "lora_B.weight", "lora_B.bias"):
            if key.endswith(f".{part}"):
                parts.setdefault(key[:-len(part) - 1], {})[part] = tensor
                break
        else:
            raise ValueError(f"{path}: unknown key {key!r} (kiln reads lora_A.weight, "
                             "lora_B.weight and lora_B.bias)")
    layers = {}
    for module_name, p in parts.items():
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            linear = None
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{path}: unknown key {module_name!r}: the transformer has no "
                             "Linear of that name")
        if "lora_A.weight" not in p or "lora_B.weight" not in p:
            raise ValueError(f"{path}: {module_name!r} lacks lora_A or lora_B")
        down, up, bias = p["lora_A.weight"], p["lora_B.weight"], p.get("lora_B.bias")
        rank = down.shape[0]
        if (down.ndim != 2 or up.ndim != 2 or down.shape[1] != linear.in_features
                or up.shape != (linear.out_features, rank)
                or (bias is not None and bias.shape != (linear.out_features,))):
            got = ", ".join(f"{tuple(t.shape)}" for t in (down, up, bias) if t is not None)
            raise ValueError(f"{path}: shape mismatch at {module_name!r}: lora_A, lora_B "
                             f"{got} for a Linear of {linear.in_features} -> "
                             f"{linear.out_features}")
        if config:
            r = _pattern_value(config.get("rank_pattern") or {}, module_name, config.get("r"))
            alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name,
                                   config.get("lora_alpha"))
            if r is not None and int(r) != rank:
                raise ValueError(f"{path}: wrong rank at {module_name!r}: the file's config "
                                 f"says {r}, its factors have {rank}")
        else:
            alpha = None
        layers[module_name] = LoraLayer(
            down=down.contiguous(), up=up.contiguous(),
            up_bias=None if bias is None else bias.contiguous(),
            alpha=float(rank if alpha is None else alpha),
            rslora=bool(config.get("use_rslora", False)))
    return layers


def _digest(layers: Mapping[str, LoraLayer]) -> str:
    h = hashlib.sha256()
    for module_name in sorted(layers):
        layer = layers[module_name]
        h.update(f"{module_name}:{layer.alpha!r}:{layer.rslora}".encode())
        for t in (layer.down, layer.up, layer.up_bias):
            if t is not None:
                h.update(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()


def remove_adapter_hooks(pipe: Any) -> int:
    """Take every adapter hook off ``pipe``'s transformers (a registry that unloads its last
    adapter: the next job without adapters then pays no hook call at all); returns how many.
    A later `use_adapters` installs them again."""
    removed = 0
    for model in named_transformers(pipe).values():
        for linear in model.modules():
            handle = getattr(linear, "_kiln_lora_hook", None)
            if handle is not None:
                handle.remove()
                del linear._kiln_lora_hook
                removed += 1
        _CHECKED.pop(model, None)
    return removed


# ---- the hooks -----------------------------------------------------------------------------

#: Per transformer, the adapters already checked against it (their Linears hooked).
_CHECKED: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Adapter]] = (
    weakref.WeakKeyDictionary())


def _install(transformers: Mapping[str, nn.Module], adapter: Adapter) -> None:
    """Hook every Linear ``adapter`` adapts in its transformer, once per Linear."""
    model = transformers.get(adapter.target)
    if model is None:
        raise ValueError(f"adapter {adapter.name!r} is for {adapter.target}, which this "
                         f"pipeline does not run (it runs {', '.join(transformers) or 'none'})")
    checked = _CHECKED.setdefault(model, weakref.WeakSet())
    if adapter in checked:
        return
    for module_name, layer in adapter.layers.items():
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            linear = None
        if not (isinstance(linear, nn.Linear) and linear.in_features == layer.down.shape[1]
                and linear.out_features == layer.up.shape[0]):
            raise ValueError(f"adapter {adapter.name!r} does not fit this pipeline's "
                             f"{adapter.target} at {module_name!r}: it was loaded for another "
                             "model")
        if not hasattr(linear, "_kiln_lora_hook"):
            hook = linear.register_forward_hook(_hook(adapter.target, module_name))
            linear._kiln_lora_hook = hook  # type: ignore[assignment]  # our own attribute
    checked.add(adapter)


def _hook(target: str, module_name: str) -> Any:
    def add_low_rank(module: nn.Linear, args: tuple[Any, ...], output: torch.Tensor) -> Any:
        active = _ACTIVE.get()
        if not active:
            return None
        # As peft's lora.Linear: the factors in the layer's dtype, the input cast to it, the sum
        # ``result + lora_B(lora_A(x)) * scaling`` per adapter, cast back to the result's dtype.
        dtype = module.weight.dtype
        x = args[0] if args[0].dtype == dtype else args[0].to(dtype)
        result_dtype = output.dtype
        for adapter, weight in active:
            layer = adapter.layers.get(module_name) if adapter.target == target else None
            if layer is not None:
                down, up, bias = layer.on(x.device, dtype)
                term = F.linear(F.linear(x, down), up, bias).mul_(layer.scaling(weight))
                # In place where nothing else can see the output (the same bits as peft's
                # out-of-place sum, without two more passes over an output-sized tensor).
                if term.dtype == output.dtype and not torch.is_grad_enabled():
                    output.add_(term)
                else:
                    output = output + term
        return output.to(result_dtype)
    return add_low_rank

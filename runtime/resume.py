"""Checkpoints of a job's denoising state, so that a job stopped between two steps resumes where
it stopped and renders the same video, bit for bit, as one that never stopped.

A checkpoint (`snapshot`) is a safetensors file: the tensors of what the job's steps changed
(the pipeline's resume hooks, ``runtime.pipelines.base``: latents, scheduler history, generator
states) and, in its string metadata, the format, the model's fingerprint, the request's digest,
the step reached and the hooks' JSON values. It holds no weights and no text embeddings:
`restore` runs ``prepare`` for the request again (deterministic from the seed) and overwrites
only the dynamic parts. The bytes come back from storage, which is not trusted to run code, so
nothing in them is ever unpickled; anything that does not fit the job is refused with an
`IncompatibleCheckpoint` saying why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from common.families import TINY, family_of, model_index_path
from runtime.models.tiny import TRAINED_WEIGHTS, TinyConfig
from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest
from runtime.pipelines.resumable import IncompatibleCheckpoint

__all__ = ["FORMAT", "IncompatibleCheckpoint", "model_fingerprint", "request_digest", "restore",
           "snapshot"]

#: The checkpoint layout this module writes and reads; a checkpoint of another is refused.
FORMAT = "kiln-denoise-state/1"

# Bytes read from a weights file at each of its start, middle and end for its fingerprint: a
# retrained model of the same shapes has the same headers, and hashing whole files of several GB
# at every worker start is not cheap.
_SAMPLE = 64 * 1024
# Weights files: fingerprinted by name, size, header and samples, never read whole.
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".msgpack", ".h5")
# Other files are hashed whole up to this size (a Qwen tokenizer.json is 11 MB), else sampled.
_WHOLE_LIMIT = 32 * 1024 * 1024


def request_digest(request: VideoRequest) -> str:
    """sha256 (hex) of the request's fields as sorted JSON: prompt, negative prompt, seed, size,
    frames, frame rate, steps and guidance, and the digest of its conditioning where it has
    one."""
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    # A conditioned request: the digest of its pixels stands for them; a text-only one digests
    # as it did before conditioning existed, so its checkpoints stay valid.
    conditioning = fields.pop("conditioning", None)
    if conditioning is not None:
        fields["conditioning"] = conditioning.digest()
    # Likewise its adapters' digests and weights; a request without adapters digests as before.
    adapters = fields.pop("adapters", ())
    if adapters:
        fields["adapters"] = [[adapter.digest, weight] for adapter, weight in adapters]
    # Likewise its step cache's threshold; an exact request digests as before.
    if fields.get("step_cache") is None:
        fields.pop("step_cache", None)
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    # A copy of its own, contiguous: safetensors refuses tensors that share memory (a view of
    # another, as UniPC's timestep history is of its timesteps) or are not dense.
    return tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def snapshot(pipe: VideoPipeline, state: DenoiseState, *, model_fingerprint: str) -> bytes:
    """The checkpoint of ``state`` (between two steps): safetensors bytes, a few times the
    latents' size."""
    tensors = {name: _host(t) for name, t in pipe.resume_tensors(state).items()}
    metadata = {
        "format": FORMAT,
        "model_fingerprint": model_fingerprint,
        "request_digest": request_digest(state.request),
        "step_index": str(state.step_index),
        "num_inference_steps": str(state.num_inference_steps),
        "values": json.dumps(pipe.resume_values(state), separators=(",", ":")),
    }
    return save_tensors(tensors, metadata=metadata)


def _metadata(blob: bytes) -> dict[str, str]:
    """The string metadata of safetensors bytes, after checking that the tensor data the header
    describes is all there (a write cut short is refused here, with its sizes)."""
    if len(blob) < 8:
        raise IncompatibleCheckpoint(f"unreadable: {len(blob)} bytes, not a safetensors file")
    (size,) = struct.unpack("<Q", bytes(blob[:8]))
    if size > len(blob) - 8:
        raise IncompatibleCheckpoint(f"truncated: {len(blob)} bytes, its header alone says "
                                     f"{8 + size}")
    try:
        header = json.loads(bytes(blob[8:8 + size]))
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items()
                if name != "__metadata__"]
        metadata = header.get("__metadata__") or {}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise IncompatibleCheckpoint(f"unreadable header ({type(exc).__name__})") from None
    expected = 8 + size + max(ends, default=0)
    if len(blob) != expected:
        raise IncompatibleCheckpoint(f"{'truncated' if len(blob) < expected else 'corrupt'}: "
                                     f"{len(blob)} bytes, its header says {expected}")
    if not isinstance(metadata, dict) or "format" not in metadata:
        raise IncompatibleCheckpoint("a safetensors file without kiln's metadata, not a "
                                     "checkpoint of a denoising state")
    return metadata


def _int(metadata: dict[str, str], key: str) -> int:
    try:
        return int(metadata[key])
    except (KeyError, TypeError, ValueError):
        raise IncompatibleCheckpoint(f"{key} is {metadata.get(key)!r}, not a number") from None


def restore(pipe: VideoPipeline, request: VideoRequest, blob: bytes, *,
            model_fingerprint: str) -> DenoiseState:
    """The state of ``request``'s job as ``blob`` (a `snapshot`) saved it, ready for its next
    step: ``pipe.prepare(request)`` with the dynamic parts overwritten. `IncompatibleCheckpoint`
    when the checkpoint is of another format, model or request, is cut short or unreadable, or
    does not fit what ``prepare`` builds; start the job from step 0 then."""
    metadata = _metadata(blob)
    written = metadata.get("format")
    if written != FORMAT:
        raise IncompatibleCheckpoint(f"written by format {written!r}, this worker reads "
                                     f"{FORMAT!r}")
    if metadata.get("model_fingerprint") != model_fingerprint:
        raise IncompatibleCheckpoint(
            f"model fingerprint differs: written with {metadata.get('model_fingerprint')!r}, "
            f"this worker has {model_fingerprint!r} (another model, or its files changed)")
    digest = request_digest(request)
    if metadata.get("request_digest") != digest:
        raise IncompatibleCheckpoint(
            f"written for another request (digest {str(metadata.get('request_digest'))[:12]}, "
            f"this job's {digest[:12]}): its prompt, negative prompt, seed, size, frames or "
            "steps differ")
    step, steps = _int(metadata, "step_index"), _int(metadata, "num_inference_steps")
    try:
        values = json.loads(metadata["values"])
        tensors = load_tensors(bytes(blob))
    except (SafetensorError, ValueError, TypeError, KeyError, RecursionError) as exc:
        raise IncompatibleCheckpoint(f"unreadable ({type(exc).__name__}: {exc})") from None
    state = pipe.prepare(request)
    if steps != state.num_inference_steps:
        raise IncompatibleCheckpoint(f"written for a job of {steps} steps, this one runs "
                                     f"{state.num_inference_steps}")
    if not 0 <= step <= steps:
        raise IncompatibleCheckpoint(f"step {step} is beyond the job's {steps} steps")
    pipe.load_resume(state, tensors, values)
    if state.step_index != step:
        raise IncompatibleCheckpoint(f"its values say step {state.step_index}, its metadata "
                                     f"step {step}")
    return state


def model_fingerprint(model: str) -> str:
    """``<family>:<sha256 hex>`` of what decides a model's numbers, cheap enough for every worker
    start and the same in every process: kiln-tiny's config and weights file (6 MB, hashed
    whole); a diffusers directory's index and config files, and each weights file's name, size,
    safetensors header and 64 KiB from its start, middle and end (not the whole file: real
    checkpoints are GBs). Hidden files and documentation do not count."""
    digest = hashlib.sha256()
    family = family_of(model)
    if family is TINY:
        digest.update(json.dumps(dataclasses.asdict(TinyConfig()), sort_keys=True).encode())
        # build_tiny loads the shipped weights when the file is there, else its seeded init.
        digest.update(TRAINED_WEIGHTS.read_bytes() if TRAINED_WEIGHTS.is_file() else b"init")
        return f"{family.name}:{digest.hexdigest()}"
    if model_index_path(model) is None:
        raise ValueError(f"{model!r} is neither kiln-tiny nor a diffusers model directory")
    root = Path(model)
    for path in _model_files(root):
        name = path.relative_to(root).as_posix()
        size = path.stat().st_size
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if path.suffix == ".safetensors":
                digest.update(_safetensors_header(f, size))
                start = f.tell()
                digest.update(_samples(f, start, size))
            elif path.suffix in _WEIGHTS or size > _WHOLE_LIMIT:
                digest.update(_samples(f, 0, size))
            else:
                digest.update(f.read())
    return f"{family.name}:{digest.hexdigest()}"


def _model_files(root: Path) -> list[Path]:
    # os.walk follows symlinks: a hub cache's snapshot is links to its blobs.
    files = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(folder) / n for n in names
                  if not n.startswith(".") and not n.lower().endswith(".md")
                  and not n.upper().startswith("LICENSE")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _safetensors_header(f: Any, size: int) -> bytes:
    """The 8-byte length and the JSON header (every tensor's name, dtype, shape and offsets)."""
    head = f.read(8)
    if len(head) < 8:
        return head
    (length,) = struct.unpack("<Q", head)
    return head + f.read(min(length, max(0, size - 8)))


def _samples(f: Any, start: int, size: int) -> bytes:
    out = b""
    for offset in sorted({start, max(start, (start + size) // 2 - _SAMPLE // 2),
                          max(start, size - _SAMPLE)}):
        f.seek(offset)
        out += f.read(_SAMPLE)
    return out

"""Distributed layerwise offload: see :mod:`runtime.dlo.engine`."""

from runtime.dlo.engine import DLOHandle, ForwardLeft, apply_dlo, find_block_lists

__all__ = ["DLOHandle", "ForwardLeft", "apply_dlo", "find_block_lists"]

"""Video pipelines driven step by step, in lock-step across a DLO group: see ``base``."""

from runtime.pipelines.base import DenoiseState, VideoPipeline, VideoRequest

__all__ = ["DenoiseState", "VideoPipeline", "VideoRequest"]

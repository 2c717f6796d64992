"""The ground floor: settings, process helpers and the model-family registry.

Every layer may import this package; it imports nothing of kiln above it and no torch, so the
API, the CLI and the Celery workers can read settings and model families without loading a
tensor library.
"""

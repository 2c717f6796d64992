"""Persistence: SQLAlchemy models and repositories (jobs, users, worker groups) and output
stores (local directory, S3-compatible)."""

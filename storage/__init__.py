"""Persistence: SQLAlchemy models and repositories (jobs, users, worker groups), the Redis ready
index, and output stores (local directory, S3-compatible)."""

"""Persistence: the database tables and the job repository (submission, queries, lifecycle),
users, batches, worker groups, webhooks, and the output stores and video files."""

"""The DP-aware batcher: a pure policy (`scheduler.policy`), job cost estimates
(`scheduler.cost`), the Redis index of queued jobs (`scheduler.queue_index`) and the claim
protocol against Redis and the database (`scheduler.claim`), and how an attempt ends
(`scheduler.attempts`). See docs/scheduler.md.

A worker group calls `scheduler.claim.claim_for_group` at a step boundary whenever ranks are free
and `scheduler.claim.record_result` when a job ends.
"""

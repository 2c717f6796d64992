"""The DP-aware batcher: a pure policy (`scheduler.policy`), job cost estimates
(`scheduler.cost`) and the claim protocol against Redis and the database (`scheduler.claim`).

A worker group calls `scheduler.claim.claim_for_group` at a step boundary whenever ranks are free
and `scheduler.claim.record_result` when a job ends.
"""

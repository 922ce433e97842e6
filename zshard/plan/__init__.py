"""The plan and the sharded state: everything static about a sharded model, each parameter's wire
resolved once (planner.py), ``init`` / ``unshard`` and ``ShardedState`` (state.py), and the weights in
and out of the shards (weights.py)."""

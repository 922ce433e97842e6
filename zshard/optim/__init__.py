"""The optimizer on shards: Optax on each device's slice and norms over all shards (optim.py), any Optax
transformation traced on logical shapes and run on shards (optim_global.py, with the shard arithmetic of
optim_shards.py), and host offload (offload.py)."""

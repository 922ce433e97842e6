"""The optimizer on shards: Optax on each device's slice and norms over all shards (optim.py), any Optax
transformation traced on logical shapes and run on shards (optim_global.py, with the shard arithmetic of
optim_shards.py), and host offload (offload.py)."""


def __getattr__(name):  # the flat module zshard.optim of zshard 0.1 (zshard/aliases.py)
    from zshard.aliases import package_attr

    return package_attr(__name__, name)

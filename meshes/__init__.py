"""Topology presets (``NAME.toml``: replica, shard, platform, description), read by
:func:`zshard.mesh.mesh_presets`. The repository keeps them here, at the top level; an
install places them as the package ``zshard.meshes`` (``pyproject.toml``, ``package-dir``)."""

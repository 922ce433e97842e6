"""The mesh and its axes: the device mesh and its presets (mesh.py), the one validated record of the axes
(axes.py, ``MeshAxes``) and the sharding strategies (strategy.py)."""


def __getattr__(name):  # the flat module zshard.mesh of zshard 0.1 (zshard/aliases.py)
    from zshard.aliases import package_attr

    return package_attr(__name__, name)

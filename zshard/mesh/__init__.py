"""The mesh and its axes: the device mesh and its presets (mesh.py), the one validated record of the axes
(axes.py, ``MeshAxes``) and the sharding strategies (strategy.py)."""

"""The parameters as zshard lays them out: the units a model splits into (units.py), the FlatParameter and
each parameter's layout in it (flat.py), and the tensor-parallel dimensions (tp.py)."""

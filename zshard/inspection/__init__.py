"""Reading traced and compiled programs: the jaxpr scopes and walkers (jaxprs.py), the collectives of a
compiled HLO (hlo.py) and the checks of a traced step (checks.py)."""

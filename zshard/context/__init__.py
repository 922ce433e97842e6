"""The context axis: the sequence split and its tracing state (sequence.py) and the blockwise attention
kernels (flash.py) that ``zshard.attention`` runs over it."""

"""Sharding strategies: which mesh axes split the model state, and which only replicate it.

Semantics follow PyTorch FSDP (arXiv 2304.11277, section 3.2) and ZeRO (arXiv 1910.02054,
section 5); DESIGN.md section 3 has the table.
"""

from __future__ import annotations

import enum

from zshard.mesh import REPLICA, SHARD

__all__ = ["Strategy"]


class Strategy(enum.Enum):
    """How parameters, gradients and optimizer state are split over the ``(replica, shard)`` mesh.

    - ``FULL_SHARD`` (ZeRO-3): everything sharded over all ``R*S`` devices; each unit is
      all-gathered before forward and again before backward, gradients reduce-scattered.
    - ``HYBRID_SHARD``: sharded over ``shard`` only and replicated over ``replica``; the
      all-gathers and reduce-scatters stay inside a shard group, and only the gradient
      *shard* is all-reduced across ``replica``.
    """

    FULL_SHARD = "FULL_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"

    @classmethod
    def parse(cls, value: "Strategy | str") -> "Strategy":
        """``Strategy`` or its name (case-insensitive) -> ``Strategy``.

        Raises:
          ValueError: an unknown name; the message lists the known ones.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper().lstrip("_")
            for member in cls:
                if member.value == key:
                    return member
        known = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown strategy {value!r}; choose one of: {known}")

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Mesh axes a parameter's FlatParameter is split over (all-gather / reduce-scatter)."""
        return (REPLICA, SHARD) if self is Strategy.FULL_SHARD else (SHARD,)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes the model state is replicated over (gradient shards all-reduced)."""
        return () if self is Strategy.FULL_SHARD else (REPLICA,)

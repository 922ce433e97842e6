"""TEMPORARY stand-in for ``zshard.make_forward`` until the lead's lands on main (issue 24).

Same signature and meaning as the public API announced there: ``make_forward(fn, *,
gather_once=False, prefetch=None)`` -> ``Forward``; ``fwd(state, *args)`` runs ``fn(model,
*local_args)`` on the sharded model, array arguments of rank >= 1 split along their leading
dimension over ``("replica", "shard")``, 0-d ones replicated, every output leaf split the same
way. Built on zshard's private forward; deleted (with its import in ``train/generate.py``)
once ``zshard.make_forward`` exists. tests/test_layout.py flags it until then.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.evaluate import forward
from zshard.mesh import AXES
from zshard.units import path_str

__all__ = ["Forward", "make_forward"]


class Forward:
    def __init__(self, fn, *, gather_once: bool = False, prefetch: int | None = None):
        self.fn, self.gather_once, self.prefetch = fn, gather_once, prefetch
        self._jitted = jax.jit(self._call)

    def _call(self, state, *args):
        plan = state.plan
        specs = tuple(P() if np.ndim(a) == 0 else P(AXES) for a in args)

        def whole(params, variables):  # every parameter all-gathered once: the model whole on every device
            var_flat = traverse_util.flatten_dict(variables) if variables else {}
            flat = []
            for path, v in plan.template:
                x = traverse_util.flatten_dict(params)[path]
                # [.., n_pad/N] --all_gather(shard axes, tiled)--> [.., n_pad] -> logical shape
                full = jax.lax.all_gather(x, plan.shard_axes, axis=x.ndim - 1, tiled=True) if plan.shard_axes else x
                flat.append((path, v.replace(plan.layouts[path].from_storage(full))))
            flat += [(p, v.replace(var_flat[p])) for p, v in plan.var_template]
            model = nnx.merge(plan.graphdef, nnx.from_flat_state(flat))
            model.eval()
            return model

        def local(params, variables, *args):
            if self.gather_once:
                return self.fn(whole(params, variables), *args)
            return forward(state, params, variables, self.fn, *args, prefetch=self.prefetch)

        return jax.shard_map(local, mesh=plan.mesh, in_specs=(plan.param_specs, state.specs().variables, *specs),
                             out_specs=P(AXES), check_vma=False)(state.params, state.variables, *args)

    def _put(self, state, args):
        batch = NamedSharding(state.plan.mesh, P(AXES))
        out = []
        for a in args:
            if np.ndim(a) == 0:
                out.append(a)
            elif isinstance(a, jax.Array):
                out.append(jax.device_put(a, batch) if a.is_fully_addressable else a)
            else:
                a = np.asarray(a)
                out.append(jax.make_array_from_callback(a.shape, batch, lambda index, a=a: a[index]))
        return out

    def __call__(self, state, *args):
        return self._jitted(state, *self._put(state, args))

    def lower(self, state, *args):
        return self._jitted.lower(state, *self._put(state, args))


def make_forward(fn, *, gather_once: bool = False, prefetch: int | None = None) -> Forward:
    return Forward(fn, gather_once=gather_once, prefetch=prefetch)

"""The compiled step's collectives (docs/design.md sections 3 and 6): count them in the HLO text.

One step of an L-block residual MLP (d=64) plus a root unit (input and head layers):

- FULL_SHARD: 2L+1 all-gathers (forward + backward per block, one for the root, which stays
  gathered for the whole step), L+1 reduce-scatters, all over the whole world; all-reduces
  only of scalars (loss, grad norm).
- HYBRID_SHARD: the same all-gathers / reduce-scatters, but inside each shard group only;
  across replica groups only the gradient *shards* are all-reduced, once: in total exactly
  sum over units of L_u/N elements. A full gradient crossing replicas is the "replica trap"
  of docs/design.md section 7.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import numpy as np
import optax
import pytest
from flax import nnx

import zshard
from conftest import ResMLP, mlp_batches, mse_loss
from zshard.report import parse_replica_groups as report_replica_groups

L = 4  # blocks
D = 64

# --------------------------------------------------------------------------------------
# HLO text parsing
# --------------------------------------------------------------------------------------

COLLECTIVES = {
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "reduce-scatter-start": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
}

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z][a-z\-]*)\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8\w*|c64|c128|token)\[(?P<dims>[\d,]*)\]")
_COMP = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%(?P<name>[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_sizes(shape: str) -> list[int]:
    """Element counts of every array in an HLO shape: ``f32[8,64]{1,0}`` or a tuple of them."""
    out = []
    for m in _ARRAY.finditer(shape):
        dims = [int(d) for d in m.group("dims").split(",") if d]
        out.append(int(np.prod(dims, dtype=np.int64)) if dims else 1)
    return out


def parse_replica_groups(text: str, num_devices: int) -> list[tuple[int, ...]]:
    """``replica_groups=`` in any of its HLO spellings -> sorted list of device-id groups.

    ``{{0,1,2,3},{4,5,6,7}}``; ``{}`` (all devices, one group); iota ``[2,4]<=[8]`` and
    ``[4,2]<=[2,4]T(1,0)`` (``arange(prod(dims)).reshape(dims).transpose(perm).reshape(shape)``);
    mesh axes ``mesh['replica'=2,'shard'=4] {'shard'}`` (jax 0.12; read by ``zshard.report``'s
    parser, whose notations tests/test_report.py checks).
    """
    text = text.strip()
    if re.match(r"@?mesh[<\[]", text):
        return sorted(tuple(g) for g in report_replica_groups(text, num_devices))
    m = re.fullmatch(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?", text)
    if m:
        shape = [int(x) for x in m.group("shape").split(",")]
        dims = [int(x) for x in m.group("dims").split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group("perm"):
            ids = ids.transpose([int(x) for x in m.group("perm").split(",")])
        groups = ids.reshape(shape[0], -1)
        return sorted(tuple(int(i) for i in g) for g in groups)
    if text in ("{}", "{{}}"):
        return [tuple(range(num_devices))]
    groups = re.findall(r"\{([\d,\s]+)\}", text)
    if not groups:
        raise ValueError(f"cannot parse replica_groups={text!r}")
    return sorted(tuple(int(i) for i in g.split(",") if i.strip()) for g in groups)


def _replica_groups_text(rest: str) -> str | None:
    m = re.search(
        r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{(?:\{[\d,\s]*\},?)*\}"
        r"|@?mesh(?:<[^>]*>|\[[^\]]*\])\s*\{[^}]*\})",  # the last: jax 0.12's mesh['replica'=2,'shard'=4] {'shard'}
        rest,
    )
    return m.group(1) if m else None


@dataclasses.dataclass
class Collective:
    kind: str  # all-gather | reduce-scatter | all-reduce
    op: str  # as written (all-gather-start, ...)
    sizes: list[int]  # element counts of the result (every element of a tuple result)
    groups: list[tuple[int, ...]]
    computation: str
    count: int = 1  # executions per step (trip count of enclosing while loops)
    line: str = dataclasses.field(default="", repr=False, compare=False)  # the instruction's HLO text (its metadata names the scope that emitted it)


def parse_collectives(hlo: str, num_devices: int = 8) -> list[Collective]:
    """Every all-gather / reduce-scatter / all-reduce of a compiled HLO module.

    Ops inside a ``while`` body are counted ``known_trip_count`` times (``Collective.count``).
    """
    comp = None
    ops: list[Collective] = []
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)  # callee -> [(caller, times)]
    entry = None
    for line in hlo.splitlines():
        cm = _COMP.match(line)
        if cm:
            comp = cm.group("name")
            if cm.group("entry"):
                entry = comp
            continue
        im = _INSTR.match(line)
        if not im or comp is None:
            continue
        op, rest = im.group("op"), im.group("rest")
        trip = 1
        if op == "while":
            t = _TRIP.search(rest)
            trip = int(t.group(1)) if t else 1
        for c in _CALLEE.finditer(rest):
            calls[c.group("name")].append((comp, trip if c.group(1) in ("body", "condition") else 1))
        if op in COLLECTIVES:
            sizes = shape_sizes(im.group("shape"))
            if op == "all-gather-start" and len(sizes) > 1:
                sizes = sizes[len(sizes) // 2 :]  # (operands..., results...)
            groups_text = _replica_groups_text(rest)
            groups = parse_replica_groups(groups_text if groups_text is not None else "{}", num_devices)
            ops.append(Collective(COLLECTIVES[op], op, sizes, groups, comp, line=line))

    def times(c: str, seen=()) -> int:
        if c == entry or c not in calls or c in seen:
            return 1
        return sum(times(caller, seen + (c,)) * t for caller, t in calls[c])

    for o in ops:
        o.count = times(o.computation)
    return ops


def count(ops, kind) -> int:
    return sum(o.count for o in ops if o.kind == kind)


def groups_of(mesh, axes) -> list[tuple[int, ...]]:
    """Device-id groups of a mesh axis set (ids as in the HLO: position in the mesh)."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = list(mesh.axis_names)
    keep = [names.index(a) for a in axes]
    other = [i for i in range(ids.ndim) if i not in keep]
    arr = ids.transpose(other + keep).reshape(-1, int(np.prod([ids.shape[i] for i in keep])))
    return sorted(tuple(int(i) for i in g) for g in arr)


# --------------------------------------------------------------------------------------
# The parser itself
# --------------------------------------------------------------------------------------


def test_parse_replica_groups_forms():
    assert parse_replica_groups("{{0,1,2,3},{4,5,6,7}}", 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert parse_replica_groups("{{0,4},{1,5},{2,6},{3,7}}", 8) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert parse_replica_groups("{}", 8) == [tuple(range(8))]
    assert parse_replica_groups("[2,4]<=[8]", 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert parse_replica_groups("[1,8]<=[8]", 8) == [tuple(range(8))]
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)", 8) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert parse_replica_groups("[2,4]<=[4,2]T(1,0)", 8) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert parse_replica_groups("mesh['replica'=2,'shard'=4] {'shard'}", 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]  # jax 0.12
    assert parse_replica_groups("mesh['replica'=2,'shard'=4] {'replica'}", 8) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    line = "%ag = f32[4,8]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['replica'=2,'shard'=4] {'shard'}, dimensions={0}"
    assert _replica_groups_text(line) == "mesh['replica'=2,'shard'=4] {'shard'}"


def test_parse_instructions():
    hlo = """
ENTRY %main (p: f32[4]) -> f32[4] {
  %ag = f32[8,266]{1,0} all-gather(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %ags = (f32[1,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%y), replica_groups={{0,1,2,3,4,5,6,7}}
  %rs = f32[1,520]{1,0} reduce-scatter(%c), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %all-reduce = (f32[1040]{0}, f32[532]{0}, f32[]) all-reduce(%a, %b, %c), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  ROOT %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce-start(%q), replica_groups={}, to_apply=%add
}
"""
    ops = parse_collectives(hlo)
    by = {o.op: o for o in ops}
    assert by["all-gather"].sizes == [8 * 266] and by["all-gather"].groups == [tuple(range(8))]
    assert by["all-gather-start"].sizes == [8 * 64]
    assert by["reduce-scatter"].sizes == [520] and by["reduce-scatter"].groups == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert by["all-reduce"].sizes == [1040, 532, 1] and by["all-reduce"].groups == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert by["all-reduce-start"].count == 3 and by["all-reduce"].count == 1
    assert count(ops, "all-gather") == 2 and count(ops, "all-reduce") == 4


# --------------------------------------------------------------------------------------
# The compiled step
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
    state: zshard.ShardedState
    ops: list[Collective]
    hlo: str


@functools.cache
def _compile(strategy, r, s) -> Compiled:
    model = ResMLP(16, D, 16, n_blocks=L, rngs=nnx.Rngs(0))
    state = zshard.init(model, optax.adamw(1e-3), zshard.make_mesh(r, s), strategy=strategy)
    step = zshard.make_train_step(mse_loss)
    hlo = step.lower(state, mlp_batches(1, 16, 16, 16)[0]).compile().as_text()
    return Compiled(state, parse_collectives(hlo), hlo)


CASES = [("FULL_SHARD", 1, 8), ("FULL_SHARD", 2, 4), ("HYBRID_SHARD", 2, 4), ("HYBRID_SHARD", 4, 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-{r}x{n}" for s, r, n in CASES])
def compiled(request):
    return _compile(*request.param)


def describe(ops):
    return "\n".join(f"  {o.op} x{o.count} sizes={o.sizes} groups={o.groups}" for o in ops)


def test_plan_units(compiled):
    units = compiled.state.plan.units
    assert [u.name for u in units] == ["root"] + [f"blocks.{i}" for i in range(L)]


def test_all_gathers(compiled):
    plan = compiled.state.plan
    ags = [o for o in compiled.ops if o.kind == "all-gather"]
    slots = [(u, sl) for u in plan.units for f in u.flats for sl in f.slots]
    assert count(compiled.ops, "all-gather") == sum(1 if u.name == "root" else 2 for u, _ in slots), describe(ags)
    shard_groups = groups_of(plan.mesh, plan.shard_axes)
    for o in ags:
        assert o.groups == shard_groups, describe([o])
    # each gather materialises one whole parameter, straight into its own [n_pad] buffer
    # (collectives._gather_all): the root's once, every block's twice (fwd + bwd)
    expected = collections.Counter()
    for u, sl in slots:
        expected[sl.padded] += 1 if u.name == "root" else 2
    got = collections.Counter()
    for o in ags:
        for n in o.sizes:
            got[n] += o.count
    assert got == expected, describe(ags)


def test_reduce_scatters(compiled):
    plan = compiled.state.plan
    rss = [o for o in compiled.ops if o.kind == "reduce-scatter"]
    slots = [sl for u in plan.units for f in u.flats for sl in f.slots]
    assert count(compiled.ops, "reduce-scatter") == len(slots), describe(rss)  # one per parameter
    shard_groups = groups_of(plan.mesh, plan.shard_axes)
    for o in rss:
        assert o.groups == shard_groups, describe([o])
    got = collections.Counter()
    for o in rss:
        for n in o.sizes:
            got[n] += o.count
    assert got == collections.Counter(sl.padded // plan.num_shards for sl in slots), describe(rss)


def test_all_reduces(compiled):
    plan = compiled.state.plan
    ars = [o for o in compiled.ops if o.kind == "all-reduce"]
    scalars = [o for o in ars if max(o.sizes) <= 1]
    # the loss and the grad norm: a few scalars at most
    assert sum(len(o.sizes) * o.count for o in scalars) <= 4, describe(scalars)
    big = [o for o in ars if max(o.sizes) > 1]
    if plan.strategy is zshard.Strategy.FULL_SHARD:
        assert not big, "FULL_SHARD must not all-reduce anything but scalars:\n" + describe(big)
        return
    replica_groups = groups_of(plan.mesh, plan.replica_axes)
    assert replica_groups == [tuple(int(i) for i in range(j, 8, plan.mesh.shape["shard"])) for j in range(plan.mesh.shape["shard"])]
    for o in big:
        assert o.groups == replica_groups, "a non-scalar all-reduce outside the replica groups:\n" + describe([o])
    shard_sizes = [f.shard_size for u in plan.units for f in u.flats]
    # The replica trap: no element across replica larger than one gradient shard, and in
    # total exactly one all-reduce of each unit's gradient shard.
    elements = [n for o in big for n in o.sizes for _ in range(o.count)]
    assert max(elements) <= max(shard_sizes), describe(big)
    assert sum(elements) == sum(shard_sizes), (
        f"{sum(elements)} elements all-reduced across replica, expected the {L + 1} gradient shards "
        f"= {sum(shard_sizes)}:\n" + describe(big)
    )


def test_hybrid_2x4_groups_literal():
    """The groups of docs/design.md section 3, spelled out for the 2x4 mesh (independent of groups_of)."""
    c = _compile("HYBRID_SHARD", 2, 4)
    for o in c.ops:
        if o.kind in ("all-gather", "reduce-scatter"):
            assert o.groups == [(0, 1, 2, 3), (4, 5, 6, 7)]
        elif max(o.sizes) > 1:
            assert o.groups == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # block gradient shard: (64*64 + 64) / 4 elements per device
    assert sorted({f.shard_size for u in c.state.plan.units[1:] for f in u.flats}) == [(D * D + D) // 4]


def test_no_other_collectives(compiled):
    # nothing else moves data between devices (all-to-all, collective-permute, send/recv)
    for op in ("all-to-all(", "collective-permute(", "collective-permute-start(", " send(", " recv("):
        assert op not in compiled.hlo, op

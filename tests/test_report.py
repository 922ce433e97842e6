"""The HLO collective parser: every replica_groups notation, tuple-shaped collectives,
async pairs, while-loop trip counts; checked on snippets and on real compiled dumps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from zshard.report import parse_collectives, parse_replica_groups


@pytest.mark.parametrize(
    "text,groups",
    [
        ("{{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("{{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("{}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("[1,8]<=[8]", [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ('@mesh<"replica"=2,"shard"=4> {shard}', [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ('@mesh<"replica"=2,"shard"=4> {replica}', [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ('@mesh<"replica"=2,"shard"=4> {replica,shard}', [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ('@mesh<"a"=8> {a:(1)2}', [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['replica'=2,'shard'=4] {'shard'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),  # jax 0.12
        ("mesh['replica'=2,'shard'=4] {'replica'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['replica'=2,'shard'=4] {'replica','shard'}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ],
)
def test_replica_group_notations(text, groups):
    assert parse_replica_groups(text, 8) == groups


def test_unknown_notation_is_an_error():
    with pytest.raises(ValueError, match="unrecognised"):
        parse_replica_groups("<<0,1>>", 8)


SNIPPET = """\
HloModule snippet

%body.1 (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %ag = f32[8,16]{1,0} all-gather(%x), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %y)
}

%cond.2 (p: (s32[], f32[64])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main.3 (a: f32[64]) -> f32[64] {
  %all-reduce = (f32[100]{0}, bf16[50]{0}, /*index=2*/f32[10,10]{1,0}) all-reduce(%a, %b, %c), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %rs = f32[1,32]{1,0} reduce-scatter(%d), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%e), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %w = (s32[], f32[64]{0}) while(%init), condition=%cond.2, body=%body.1, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[64]{0} add(%a, %a)
}
"""


def test_snippet_kinds_bytes_axes_and_trips():
    mesh = zshard.make_mesh(2, 4)
    got = {c.name: c for c in parse_collectives(SNIPPET, mesh)}
    assert set(got) == {"ag", "all-reduce", "rs", "ags"}
    ar = got["all-reduce"]  # tuple: 400 + 100 + 400 bytes, groups along replica
    assert (ar.kind, ar.axis, ar.group_size, ar.buffer_bytes) == ("all-reduce", "replica", 2, 900)
    assert ar.sent_bytes == 2 * 900 * 1 / 2
    rs = got["rs"]  # result is the shard; X = 8 * 128 bytes over the world
    assert (rs.kind, rs.axis, rs.buffer_bytes, rs.sent_bytes) == ("reduce-scatter", "world", 1024, 1024 * 7 / 8)
    ags = got["ags"]  # async start: (operand, output) -> output f32[16]
    assert (ags.kind, ags.axis, ags.buffer_bytes) == ("all-gather", "shard", 64)
    ag = got["ag"]  # inside the while body: 5 trips
    assert (ag.axis, ag.trips, ag.buffer_bytes, ag.sent_bytes) == ("shard", 5, 512, 512 * 3 / 4)


def test_real_dump_scan_counts_collectives_per_iteration():
    mesh = zshard.make_mesh(2, 4)

    def body(c, w):  # one all-gather over shard per iteration
        full = jax.lax.all_gather(w, "shard", tiled=True)
        return c + jnp.sum(full), None

    def f(ws):
        c0 = jax.lax.pcast(jnp.zeros((), jnp.float32), ("shard",), to="varying")
        c, _ = jax.lax.scan(body, c0, ws)
        return jax.lax.psum(c, "shard")

    ws = jax.device_put(np.ones((6, 32), np.float32), NamedSharding(mesh, P(None, "shard")))
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "shard"), out_specs=P()))
    colls = parse_collectives(fn.lower(ws).compile().as_text(), mesh)
    gathers = [c for c in colls if c.kind == "all-gather"]
    assert sum(c.trips for c in gathers) == 6, gathers
    assert all(c.axis == "shard" and c.buffer_bytes == 32 * 4 for c in gathers)

"""``zshard.moe`` (zshard/moe.py): the MoE op against a dense formula, and over the ``expert`` axis.

1. On one device (``X = 1``) it equals a dense numpy formula (every expert on every token in
   float64, masked by the top-k choice) for softmax / sigmoid scores, normalised or not, with a
   selection bias, a scaling factor and shared experts (gated or not); the router runs in
   float32 under bfloat16 inputs.
2. Inside a ``shard_map`` over a mesh ``("expert",)`` of X = 2 and 4 emulated devices (each with
   ``E/X`` experts and ``1/X`` of the tokens), the all-to-all dispatch equals ``X = 1`` on all the
   tokens within 1e-5 (fp32): the output and the gradients w.r.t. ``x``, the router and the expert
   weights (each device's expert gradients, concatenated over ``expert``, equal the single-device ones).
3. Capacity mode drops exactly the slots a hand-computed example predicts (``X = 1`` and ``X = 2``).
4. Bad input raises a ValueError naming the argument: ``top_k > E``, a router / expert mismatch,
   ``X > 1`` without a bound ``expert`` axis.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import zshard
from zshard.moe import MoEStats, a2a_bytes, capacity, recording

D, E, F, K = 8, 8, 6, 2


def _silu(a):
    return a / (1 + np.exp(-a))


def dense(x, router, wgu, wd, k, *, score="softmax", norm=True, bias=None, scale=1.0, shared=None, groups=None):
    """Every expert on every token in float64, masked by the top-k choice: ``[N, D]``."""
    x, router, wgu, wd = (np.asarray(a, np.float64) for a in (x, router, wgu, wd))
    logits = x @ router  # [N, E]
    if score == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        p = z / z.sum(-1, keepdims=True)
    else:
        p = 1 / (1 + np.exp(-logits))
    pick = p if bias is None else p + np.asarray(bias, np.float64)  # [N, E]
    if groups is not None:  # only the experts of the topk_group groups with the best two-expert sums
        G, top_g = groups
        best2 = np.sort(pick.reshape(len(pick), G, -1), axis=-1)[..., -2:].sum(-1)  # [N, G]
        out_groups = np.argsort(-best2, axis=-1)[:, top_g:]  # [N, G - top_g]
        for n, gs in enumerate(out_groups):
            for g in gs:
                pick[n, g * (E // G):(g + 1) * (E // G)] = -np.inf
    choice = np.argsort(-pick, axis=-1)[:, :k]  # [N, k]
    mask = np.zeros_like(p)
    np.put_along_axis(mask, choice, 1.0, axis=-1)
    w = p * mask
    if norm:
        w = w / w.sum(-1, keepdims=True)
    w = w * scale  # [N, E], 0 off the top-k
    h = np.einsum("nd,edf->enf", x, wgu)  # [E, N, 2F]
    g, u = np.split(h, 2, axis=-1)
    out = np.einsum("enf,efd->end", _silu(g) * u, wd)  # [E, N, D]: every expert on every token
    y = np.einsum("ne,end->nd", w, out)
    if shared is not None:
        sg, sd, gate = (None if a is None else np.asarray(a, np.float64) for a in shared)
        g, u = np.split(x @ sg, 2, axis=-1)
        s = (_silu(g) * u) @ sd
        y = y + (s if gate is None else s / (1 + np.exp(-(x @ gate))))
    return y, logits, p, choice


def _weights(seed=0, n=16):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f32(n, D), f32(D, E), f32(E, D, 2 * F) * 0.5, f32(E, F, D) * 0.5, f32(E) * 0.3, (f32(D, 2 * F), f32(F, D), f32(D, 1))


CASES = {  # name: (score, norm_topk_prob, bias, routed_scaling_factor, shared, shared_gate[, limit_groups])
    "softmax-norm (Qwen3-MoE, Mixtral)": ("softmax", True, False, 1.0, False, False),
    "softmax-raw (Switch)": ("softmax", False, False, 1.0, False, False),
    "softmax-raw-gated-shared (Qwen2-MoE)": ("softmax", False, False, 1.0, True, True),
    "sigmoid-bias-norm-scaled-shared (DeepSeek-V3)": ("sigmoid", True, True, 2.5, True, False),
    "sigmoid-raw": ("sigmoid", False, False, 1.0, False, False),
    "sigmoid-bias-groups (DeepSeek-V3 n_group=4, topk_group=2)": ("sigmoid", True, True, 2.5, False, False, (4, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_device_equals_the_dense_formula(case):
    score, norm, use_bias, scale, use_shared, use_gate, *groups = CASES[case]
    groups = groups[0] if groups else None
    x, router, wgu, wd, bias, (sg, sd, gate) = _weights()
    shared = (sg, sd, gate if use_gate else None) if use_shared else None
    kw = dict(top_k=K, score=score, norm_topk_prob=norm, router_bias=bias if use_bias else None,
              routed_scaling_factor=scale, limit_groups=groups)
    if shared:
        kw.update(shared_gate_up=sg, shared_down=sd, shared_gate=shared[2])
    y, stats = jax.jit(lambda *a: zshard.moe(*a, **kw))(x.reshape(2, 8, D), router, wgu, wd)
    want, logits, p, choice = dense(x, router, wgu, wd, K, score=score, norm=norm, bias=bias if use_bias else None,
                                    scale=scale, shared=shared, groups=groups)
    if groups:  # the group limit changed some token's choice (else this case tests nothing new)
        assert not np.array_equal(choice, dense(x, router, wgu, wd, K, score=score, bias=bias, scale=scale)[3])
    assert y.shape == (2, 8, D) and y.dtype == jnp.float32 and isinstance(stats, MoEStats)
    np.testing.assert_array_equal(np.sort(np.asarray(stats.top_e).reshape(-1, K), -1), np.sort(choice, -1))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats.logits).reshape(-1, E), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats.probs).reshape(-1, E), p, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stats.load), np.bincount(choice.ravel(), minlength=E))
    assert float(stats.dropped) == 0.0


def test_router_runs_in_float32_under_bfloat16():
    x, router, wgu, wd, *_ = _weights(1)
    xb = jnp.asarray(x, jnp.bfloat16)
    y, stats = jax.jit(lambda *a: zshard.moe(*a, top_k=K))(xb, router.astype(jnp.bfloat16), wgu.astype(jnp.bfloat16),
                                                          wd.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and stats.logits.dtype == jnp.float32 and stats.probs.dtype == jnp.float32
    want = np.asarray(xb, np.float64) @ np.asarray(router.astype(jnp.bfloat16), np.float64)
    np.testing.assert_allclose(np.asarray(stats.logits), want, rtol=1e-6, atol=1e-6)  # fp32, not bf16's 1e-2
    ref, *_ = dense(np.asarray(xb, np.float32), np.asarray(router.astype(jnp.bfloat16), np.float32),
                    np.asarray(wgu.astype(jnp.bfloat16), np.float32), np.asarray(wd.astype(jnp.bfloat16), np.float32), K)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=0.05, atol=0.05)


def _mesh(X):
    return Mesh(np.array(jax.devices()[:X]), ("expert",))


def _expert_parallel(X, kw, n):
    """``zshard.moe`` in a shard_map over ``("expert",)`` of X devices: ``(x [X*n, D], router, wgu, wd) -> (y, dropped, load)``."""
    mesh = _mesh(X)

    def body(x, router, wgu, wd):
        y, s = zshard.moe(x, router, wgu, wd, **kw)
        return y, jax.lax.psum(s.dropped, "expert")[None], s.dropped[None], jax.lax.psum(s.load, "expert")

    return jax.shard_map(body, mesh=mesh, in_specs=(P("expert"), P(), P("expert"), P("expert")),
                         out_specs=(P("expert"), P(), P("expert"), P()))


@pytest.mark.parametrize("X", [2, 4])
def test_expert_parallel_equals_one_device_forward_and_gradients(X):
    x, router, wgu, wd, *_ = _weights(2, n=8 * X)
    ct = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)  # a cotangent for y

    def run(f):  # (loss, (y, aux)), (dx, drouter, dwgu, dwd)
        def loss(*a):
            y, *aux = f(*a)
            return jnp.sum(y * ct), (y, aux)

        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)).lower(x, router, wgu, wd).compile()
        return compiled(x, router, wgu, wd), compiled.as_text()

    ((l1, (y1, _)), g1), _ = run(lambda *a: zshard.moe(*a, top_k=K))
    ((lx, (yx, (dropped, _, load))), gx), hlo = run(_expert_parallel(X, dict(top_k=K), 8))
    np.testing.assert_allclose(np.asarray(yx), np.asarray(y1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(lx), float(l1), rtol=1e-5)
    for name, a, b in zip(("x", "router", "w_gate_up", "w_down"), gx, g1):
        assert np.abs(np.asarray(b)).max() > 0, name  # the gradient exists
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
    # every device's experts got slots (the all-to-all carried rows), none dropped
    assert float(dropped[0]) == 0.0 and np.asarray(load).reshape(X, -1).sum(1).min() > 0
    # the program's all-to-alls: the counts [X, E/X] int32 once, and the rows [X, cap, D] (cap = n * min(k, E/X))
    # dispatched and combined, forward and backward, each sending a2a_bytes off the device
    sent = sorted(c.sent_bytes for c in zshard.parse_collectives(hlo, _mesh(X)) if c.kind == "all-to-all")
    assert sent == [(X - 1) * (E // X) * 4] + [a2a_bytes(8, K, X, E, D, 4)] * 4, sent
    assert a2a_bytes(8, K, X, E, D, 4) == (X - 1) * 8 * min(K, E // X) * D * 4


def test_expert_parallel_with_shared_sigmoid_bias():
    """DeepSeek-style routing and shared experts over X = 2: equal to one device."""
    x, router, wgu, wd, bias, (sg, sd, _) = _weights(4, n=16)
    kw = dict(top_k=3, score="sigmoid", router_bias=bias, routed_scaling_factor=2.0, shared_gate_up=sg, shared_down=sd)
    mesh = _mesh(2)
    ep = jax.shard_map(lambda x, r, a, b: zshard.moe(x, r, a, b, **kw)[0], mesh=mesh,
                       in_specs=(P("expert"), P(), P("expert"), P("expert")), out_specs=P("expert"))
    want, *_ = dense(x, router, wgu, wd, 3, score="sigmoid", bias=bias, scale=2.0, shared=(sg, sd, None))
    np.testing.assert_allclose(np.asarray(jax.jit(ep)(x, router, wgu, wd)), want, rtol=1e-5, atol=1e-5)


def _routed(logits):
    """Tokens whose router logits are exactly ``logits`` ``[N, E]``: ``x[:, :E] = logits``, router = [I; 0]."""
    n = logits.shape[0]
    x = np.concatenate([np.asarray(logits, np.float32), np.random.default_rng(5).standard_normal((n, D - E))
                        .astype(np.float32)], axis=1) if D > E else np.asarray(logits, np.float32)
    return x, np.eye(D, E, dtype=np.float32)


def test_capacity_drops_the_slots_past_capacity_in_slot_order_one_device():
    # 4 tokens, k = 1: tokens 0, 1, 2 pick expert 0, token 3 picks expert 1. capacity_factor 0.5 ->
    # cap = ceil(0.5 * 4 * 1 / 1) = 2 rows for the one destination: slots 0, 1 kept, 2 and 3 dropped.
    logits = np.full((4, E), -5.0, np.float32)
    logits[[0, 1, 2], 0] = 5.0
    logits[3, 1] = 5.0
    x, router = _routed(logits)
    _, _, wgu, wd, *_ = _weights(6)
    assert capacity(4, 1, 1, E, 0.5) == 2
    y, stats = jax.jit(lambda *a: zshard.moe(*a, top_k=1, capacity_factor=0.5))(x, router, wgu, wd)
    full, *_ = dense(x, router, wgu, wd, 1)
    assert float(stats.dropped) == 2.0
    np.testing.assert_allclose(np.asarray(y)[:2], full[:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y)[2:], 0.0)
    np.testing.assert_array_equal(np.asarray(stats.load)[:2], [3, 1])  # routed slots, dropped ones included


def test_capacity_drops_the_slots_past_capacity_over_expert():
    # X = 2 (experts 0-3 on device 0, 4-7 on device 1), k = 2, 4 tokens per device, capacity_factor 1:
    # cap = ceil(1 * 4 * 2 / 2) = 4 rows per destination. Device 0's tokens pick {0,1} {0,1} {0,4} {1,5}:
    # slots s = 2n + j to destination 0: s0 s1 s2 s3 s4 s6 (6 > 4: s4 = token 2's expert 0 and s6 = token
    # 3's expert 1 are dropped), to destination 1: s5 s7 (kept). Device 1's tokens pick {4,5} {0,1}
    # {2,6} {3,7}: 4 slots to each destination, none dropped.
    picks = [(0, 1), (0, 1), (0, 4), (1, 5), (4, 5), (0, 1), (2, 6), (3, 7)]
    logits = np.full((8, E), -5.0, np.float32)
    for n, (a, b) in enumerate(picks):
        logits[n, a], logits[n, b] = 5.0, 4.0
    x, router = _routed(logits)
    _, _, wgu, wd, *_ = _weights(7)
    assert capacity(4, 2, 2, E, 1.0) == 4
    compiled = jax.jit(_expert_parallel(2, dict(top_k=2, capacity_factor=1.0), 4)).lower(x, router, wgu, wd).compile()
    y, total, per_device, load = compiled(x, router, wgu, wd)
    sent = sorted(c.sent_bytes for c in zshard.parse_collectives(compiled.as_text(), _mesh(2)) if c.kind == "all-to-all")
    assert sent == [(2 - 1) * (E // 2) * 4] + [(2 - 1) * 4 * D * 4] * 2 == [16, 128, 128], sent  # cap = 4 rows
    assert a2a_bytes(4, 2, 2, E, D, 4, capacity_factor=1.0) == 128
    np.testing.assert_array_equal(np.asarray(per_device), [2.0, 0.0])
    assert float(total[0]) == 2.0
    np.testing.assert_array_equal(np.asarray(load), np.bincount(np.ravel(picks), minlength=E))
    # expected: the dense formula with the dropped slots' weights set to 0
    want, _, p, _ = dense(x, router, wgu, wd, 2)
    w = np.zeros((8, E))
    for n, (a, b) in enumerate(picks):
        w[n, [a, b]] = p[n, [a, b]] / (p[n, a] + p[n, b])
    w[2, 0] = w[3, 1] = 0.0  # the two dropped slots
    h = np.einsum("nd,edf->enf", x.astype(np.float64), wgu.astype(np.float64))
    g, u = np.split(h, 2, axis=-1)
    want = np.einsum("ne,end->nd", w, np.einsum("enf,efd->end", _silu(g) * u, wd.astype(np.float64)))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_recording_sees_each_call():
    x, router, wgu, wd, *_ = _weights(8)
    with recording() as calls:  # traced only (eval_shape): the record is made while tracing
        jax.eval_shape(lambda *a: zshard.moe(*a, top_k=K), x, router, wgu, wd)
        jax.eval_shape(_expert_parallel(2, dict(top_k=K), 8), x, router, wgu, wd)
    jax.eval_shape(lambda *a: zshard.moe(*a, top_k=K), x, router, wgu, wd)  # outside: not recorded
    assert [(c.experts, c.groups, c.local_experts, c.tokens, c.capacity, c.dropless) for c in calls] == [
        (E, 1, E, 16, 16 * K, True), (E, 2, E // 2, 8, 8 * K, True)]


def test_bad_input_is_refused_with_the_argument_and_fix():
    x, router, wgu, wd, *_ = _weights(9)
    with pytest.raises(ValueError, match=r"top_k = 9 must be an int in \[1, E = 8\]"):
        zshard.moe(x, router, wgu, wd, top_k=9)
    with pytest.raises(ValueError, match=r"router \[D, E\] names E = 8 experts but w_gate_up holds 3"):
        zshard.moe(x, router, wgu[:3], wd[:3], top_k=K)
    with pytest.raises(ValueError, match=r"router has shape \(6, 8\); it must be \[D, E\] = \[8, experts\]"):
        zshard.moe(x, router[:6], wgu, wd, top_k=K)
    with pytest.raises(ValueError, match=r"w_gate_up .* and w_down .* do not match"):
        zshard.moe(x, router, wgu, wd[:, :4], top_k=K)
    with pytest.raises(ValueError, match=r"X = 2 expert groups, but no mesh axis 'expert' is bound.*expert=2"):
        zshard.moe(x, router, wgu[:4], wd[:4], top_k=K)
    with pytest.raises(ValueError, match=r"score = 'tanh'"):
        zshard.moe(x, router, wgu, wd, top_k=K, score="tanh")
    with pytest.raises(ValueError, match=r"limit_groups = \(3, 1\) \(n_group, topk_group\) must split the E = 8"):
        zshard.moe(x, router, wgu, wd, top_k=K, limit_groups=(3, 1))
    with pytest.raises(ValueError, match=r"capacity_factor = 0 must be > 0"):
        zshard.moe(x, router, wgu, wd, top_k=K, capacity_factor=0)


def test_zoo_moe_layer_over_expert_equals_one_device():
    """train/models/moe.py's MoE layer, its expert weights split over ``expert`` (X = 2) and the batch
    too, gives the output and per-sequence (counts, probs) of the whole layer on one device."""
    from flax import nnx

    from train.model import MoEConfig
    from train.models.moe import MoE

    cfg = MoEConfig(vocab_size=64, seq_len=8, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, n_experts=E,
                    top_k=K, d_expert=F)
    graphdef, state = nnx.split(MoE(cfg, rngs=nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(10).standard_normal((4, 8, D)), jnp.float32)
    specs = jax.tree.map(lambda v: P("expert") if v.ndim == 3 else P(), state)  # w_gate_up, w_down: [E, ...]
    run = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=_mesh(2), in_specs=(specs, P("expert")),
                        out_specs=P("expert"))
    (y, (counts, probs, *_)), (y1, (counts1, probs1, *_)) = jax.jit(run)(state, x), jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts1))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(probs1), rtol=1e-6, atol=1e-6)
    assert np.asarray(counts1).sum() == 4 * 8 * K

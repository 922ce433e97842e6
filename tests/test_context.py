"""Context parallelism: a ``context`` mesh axis, each sequence split over it in the head-tail order,
parameters FSDP-sharded over ``shard x context`` (docs/long-sequences.md).

Numbers against a plain single-device Optax step (the same model: ``zshard.attention`` is
``jax.nn.dot_product_attention`` there, ``zshard.positions`` is ``arange``); bytes from the
compiled HLO against the report's formula; bad inputs refused before compiling."""

import functools
import re
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import reference_run, rel_l2, state_copy
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import zshard
from zshard.context.sequence import head_tail_order

# --- a Llama-style model: GQA, RoPE from zshard.positions, zshard.attention ------------------------------

V, D, H, KV, L = 64, 32, 4, 2, 64  # vocabulary, width, heads, kv heads, sequence length
HD = D // H


def rope(x, pos):  # x [B, T, h, hd], pos [T] global positions
    freqs = 1.0 / 10000 ** (jnp.arange(0, HD, 2) / HD)  # [hd/2]
    ang = pos[:, None].astype(jnp.float32) * freqs[None]  # [T, hd/2]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Attn(nnx.Module):
    def __init__(self, rngs, impl, window):
        self.impl, self.window = impl, window
        self.qkv = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, (H + 2 * KV) * HD)))  # q | k | v
        self.out = nnx.Linear(H * HD, D, use_bias=False, rngs=rngs)

    def __call__(self, x, pos, seg):
        B, T, _ = x.shape
        qkv = x @ self.qkv[...]  # [B, T, (H + 2 KV) hd]
        q = qkv[..., : H * HD].reshape(B, T, H, HD)
        k = qkv[..., H * HD : (H + KV) * HD].reshape(B, T, KV, HD)
        v = qkv[..., (H + KV) * HD :].reshape(B, T, KV, HD)
        q, k = rope(q, pos), rope(k, pos)
        o = zshard.attention(q, k, v, segment_ids=seg, sliding_window=self.window, impl=self.impl)  # [B, T, H, hd]
        return self.out(o.reshape(B, T, H * HD))


class Block(nnx.Module):
    def __init__(self, rngs, impl, window):
        self.n1, self.attn = nnx.RMSNorm(D, rngs=rngs), Attn(rngs, impl, window)
        self.n2, self.up, self.down = nnx.RMSNorm(D, rngs=rngs), nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x, pos, seg):
        x = x + self.attn(self.n1(x), pos, seg)
        return x + self.down(jax.nn.gelu(self.up(self.n2(x))))


class Llama(nnx.Module):
    def __init__(self, rngs, impl="allgather", window=None, n=2):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs, impl, window) for _ in range(n)])
        self.norm, self.head = nnx.RMSNorm(D, rngs=rngs), nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tok, seg=None):
        pos = zshard.positions(tok.shape[1])  # each local token's global position
        x = self.embed(tok)
        for b in self.blocks:
            x = b(x, pos, seg)
        return self.head(self.norm(x))


def loss_fn(model, batch):
    logp = jax.nn.log_softmax(model(batch["tokens"], batch.get("segments")).astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]  # [B, T]
    return jnp.mean(nll * batch["weight"][:, None]) if "weight" in batch else jnp.mean(nll)


def token_loss(model, batch):  # packed documents: the last token of each document predicts nothing
    logp = jax.nn.log_softmax(model(batch["tokens"], batch["segments"]).astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return zshard.TokenMean(jnp.sum(nll * batch["mask"]), jnp.sum(batch["mask"]))


def token_mean(model, batch):  # the same loss on one device
    t = token_loss(model, batch)
    return t.total / t.count


def batches(steps=10, rows=4, segments=False, weight=False, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tok = rng.integers(0, V, size=(rows, L + 1), dtype=np.int32)
        b = {"tokens": tok[:, :-1], "targets": tok[:, 1:]}
        if segments:  # 1-4 documents per row, packed
            cuts = np.sort(rng.integers(1, L, size=(rows, 3)), axis=1)
            seg = (np.arange(L)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)  # [rows, L]
            b["segments"] = seg
            b["mask"] = np.concatenate([seg[:, 1:] == seg[:, :-1], np.ones((rows, 1), bool)], 1).astype(np.float32)
        if weight:
            b["weight"] = rng.uniform(0.5, 1.5, size=(rows,)).astype(np.float32)
        out.append(b)
    return out


def make(impl="allgather", window=None):
    return lambda: Llama(nnx.Rngs(0), impl, window)


@functools.cache
def built(impl="allgather", window=None) -> nnx.Module:
    """``make(impl, window)()`` built once (eagerly) for the training cases: ``zshard.init`` copies a
    module to its shards without compiling its initialisers for each mesh (the callable path: the
    other tests of this file)."""
    return make(impl, window)()


def mesh(r, s, c, t=1):
    return zshard.make_mesh(r, s, context=c, tensor=t)


@functools.cache
def reference(window, segments, weight, loss="mean"):
    """One device's run (its attention is the same whatever the sharded step's impl: one run for both)."""
    fn = token_mean if loss == "token" else loss_fn
    return reference_run(make("allgather", window), optax.adamw(1e-3), fn, batches(segments=segments, weight=weight))


TP_PLAN = {"blocks.*.attn.qkv": -1, "blocks.*.attn.out.kernel": 0, "blocks.*.up.kernel": -1, "blocks.*.up.bias": 0,
           "blocks.*.down.kernel": 0}

# --- the mesh ------------------------------------------------------------------------------------------


def test_mesh_with_a_context_axis():
    m = mesh(2, 2, 2)
    assert tuple(m.axis_names) == ("replica", "shard", "context")
    assert tuple(m.axis_types) == (AxisType.Explicit,) * 3
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(m.devices), np.arange(8).reshape(2, 2, 2))
    m = mesh(1, 2, 2, 2)
    assert tuple(m.axis_names) == ("replica", "shard", "context", "tensor")
    assert tuple(m.axis_types) == (AxisType.Explicit,) * 3 + (AxisType.Auto,)
    assert tuple(mesh(1, 8, 1).axis_names) == ("replica", "shard")  # C = 1: today's mesh
    with pytest.raises(ValueError, match=r"valid \(replica x shard x context\) shapes with context=2: 1x4x2, 2x2x2, 4x1x2"):
        zshard.make_mesh(2, 4, context=2)
    with pytest.raises(ValueError, match="context=3 does not divide the 8 devices"):
        zshard.make_mesh(context=3)


def test_parameters_are_sharded_over_shard_x_context():
    full = zshard.init(built(), optax.adamw(1e-3), mesh(2, 2, 2), strategy="FULL_SHARD")
    hyb = zshard.init(built(), optax.adamw(1e-3), mesh(2, 2, 2), strategy="HYBRID_SHARD")
    up_full, up_hyb = full.params["blocks"][0]["up"]["kernel"], hyb.params["blocks"][0]["up"]["kernel"]
    assert up_full.sharding.spec == P(("replica", "shard", "context"))
    assert up_full.addressable_shards[0].data.shape == (D * 4 * D // 8,)  # 1/(R S C)
    assert up_hyb.sharding.spec == P(("shard", "context"))  # replica stays the replica axis
    assert up_hyb.addressable_shards[0].data.shape == (D * 4 * D // 4,)
    assert (full.plan.world, hyb.plan.world, hyb.plan.num_shards, hyb.plan.replica_axes) == (8, 8, 4, ("replica",))
    opt = zshard.init(built(), optax.adamw(1e-3), mesh(2, 2, 2), strategy="HYBRID_SHARD_OPT")
    assert opt.opt_state[0].mu["blocks"][0]["up"]["kernel"].sharding.spec == P(None, ("shard", "context", "replica"))


def test_head_tail_order():
    order = head_tail_order(16, 4)  # 8 chunks of 2 tokens: device i holds chunks i and 7 - i
    np.testing.assert_array_equal(order.reshape(4, 4) // 2, [[0, 0, 7, 7], [1, 1, 6, 6], [2, 2, 5, 5], [3, 3, 4, 4]])
    np.testing.assert_array_equal(np.sort(order), np.arange(16))


# --- numbers: 10 steps equal to one device ------------------------------------------------------------


def _train_step(segments: bool, remat: str, options: tuple = ()) -> zshard.TrainStep:
    """The step of the training cases (and of the report's, which compile the same program: one
    step object, one compile on one plan, :func:`_placed`): packed documents with a token mean, or
    rows weighted by ``weight``. Cached by :func:`_step_for` under ``(segments, remat, options)``
    whether ``options`` is given or not (functools.cache keys ``f(True, "block")`` and
    ``f(True, "block", ())`` apart: two step objects, two compiles of one program)."""
    return _step_for(segments, remat, tuple(options))


@functools.cache
def _step_for(segments: bool, remat: str, options: tuple) -> zshard.TrainStep:
    axes = {"tokens": 1, "targets": 1, "segments": 1, "mask": 1} if segments else {"tokens": 1, "targets": 1, "weight": None}
    return zshard.make_train_step(token_loss if segments else loss_fn, sequence_axis=axes, remat=remat, prefetch=1, **dict(options))


@functools.cache
def _placed(strategy, shape, impl, window, tensor: bool) -> zshard.ShardedState:
    """A training case's initial state (AdamW), placed once. Each ``zshard.init`` makes a new plan, and a
    step traces, lowers and compiles once per plan (the plan is the jit's static argument): the report's
    tests lower the two FULL_SHARD 1x2x4 cases' states (not consumed) and so reuse the programs those
    cases compiled. A training case steps its own copy (conftest.state_copy: the step donates its input)."""
    return zshard.init(built(impl, window), optax.adamw(1e-3), mesh(*shape), strategy=strategy,
                       tensor_parallel=TP_PLAN if tensor else None)


CASES = [  # strategy, mesh, impl, remat, sliding window, packed documents, step options, tensor plan
    # -m exhaustive: its path is the default run's in parts: FULL_SHARD with allgather and block remat (the
    # packed case below, FULL_SHARD 1x2x4), a context of 2 on FULL_SHARD 1x4x2 (test_train_models_equal_one_device
    # [llama-FULL_SHARD-shape1], allgather; test_eval_step_gives_the_single_device_loss), rows weighted by
    # ``weight`` (the ring cases below, the same _train_step(False, ...) loss and batches)
    pytest.param("FULL_SHARD", (1, 4, 2), "allgather", "block", None, False, {}, None, marks=pytest.mark.exhaustive,
                 id="FULL_SHARD-1x4x2-allgather-block-None-False-{}-None"),
    # the program of test_report_context_row_is_the_formula[ring-none-False-1] (replica 2 with a context
    # axis, HYBRID_SHARD 2x2x2, meets one device in test_train_models_equal_one_device[gpt-...])
    ("FULL_SHARD", (1, 2, 4), "ring", "none", None, False, {}, None),
    # the program of test_report_context_row_is_the_formula[allgather-block-True-2] (_train_step: compiled once)
    ("FULL_SHARD", (1, 2, 4), "allgather", "block", None, True, {}, None),
    ("HYBRID_SHARD", (1, 2, 4), "ring", "block", 48, False, {"clip_norm": 0.5}, None),
    # gradient accumulation of a token mean over split sequences (here since the case above is the report's)
    ("FULL_SHARD", (1, 2, 2, 2), "allgather", "none", 48, True, {"grad_accum": 2}, TP_PLAN),
    ("HYBRID_SHARD", (1, 2, 2, 2), "ring", "block", None, False, {}, TP_PLAN),
]


@pytest.mark.parametrize("strategy,shape,impl,remat,window,segments,options,tp", CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else "tp" if isinstance(v, dict) and v is TP_PLAN
                         else str(v))
def test_training_equals_one_device(strategy, shape, impl, remat, window, segments, options, tp):
    clip = options.get("clip_norm")
    loss = "token" if segments else "mean"
    if clip is None:
        want = reference(window, segments, not segments, loss)
    else:
        want = reference_run(make("allgather", window), optax.chain(optax.clip_by_global_norm(clip), optax.adamw(1e-3)), loss_fn,
                             batches(segments=segments, weight=not segments))
    state = state_copy(_placed(strategy, shape, impl, window, tp is not None))
    step = _train_step(segments, remat, tuple(sorted(options.items())))
    losses, norms = [], []
    for b in batches(segments=segments, weight=not segments):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    np.testing.assert_allclose(losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose(norms, want.grad_norms, rtol=1e-5)
    flat = dict(nnx.to_flat_state(nnx.state(zshard.unshard(state), nnx.Param)))
    for path, ref in want.params.items():
        assert rel_l2(np.asarray(flat[path].get_value()), ref) <= 1e-5, path


# --- evaluation and forward ----------------------------------------------------------------------------


def test_eval_step_gives_the_single_device_loss():
    ref = make()()
    # jitted (one program per batch shape): op by op, the single-device loss and forward compiled
    # each operation apart, most of this test's time
    one_loss, one_forward = nnx.jit(loss_fn), nnx.jit(lambda model, tok: model(tok))
    state = zshard.init(ref, optax.adamw(1e-3), mesh(1, 4, 2), strategy="FULL_SHARD")
    split = zshard.make_eval_step(loss_fn, sequence_axis={"tokens": 1, "targets": 1, "weight": None})
    rows = zshard.make_eval_step(loss_fn)  # no sequence axis: the rows over context too, whole sequences
    # both steps on the same 8 rows (2 per replica x shard device): one single-device loss program
    eight = batches(1, rows=8, weight=True)[0]
    want = float(one_loss(ref, jax.tree.map(jnp.asarray, eight)))
    assert float(split(state, eight)["loss"]) == pytest.approx(want, rel=1e-6)
    assert float(rows(state, eight)["loss"]) == pytest.approx(want, rel=1e-6)
    # generation's forward: rows over every data axis (R S C), each device whole sequences
    fwd = zshard.make_forward(lambda model, tok: model(tok))
    tok = batches(1, rows=8)[0]["tokens"]
    np.testing.assert_allclose(np.asarray(fwd(state, tok)), np.asarray(one_forward(ref, jnp.asarray(tok))), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"must divide by the 8 devices"):
        fwd(state, tok[:4])


# --- bytes of keys and values in the compiled step ---------------------------------------------------------


@functools.cache
def _report(impl, remat, segments):
    """The report of the training cases' step (prefetch 1; a batch as theirs) on FULL_SHARD 1x2x4:
    the programs two of test_training_equals_one_device's cases compiled (their state's plan, the same
    step object: one compile for both; the state is lowered, not consumed)."""
    state = _placed("FULL_SHARD", (1, 2, 4), impl, None, False)
    return zshard.report(_train_step(segments, remat), state, batches(1, segments=segments, weight=not segments)[0])


@pytest.mark.parametrize("impl,remat,segments,passes", [("allgather", "block", True, 2), ("ring", "none", False, 1)])
def test_report_context_row_is_the_formula(impl, remat, segments, passes):
    rep = _report(impl, remat, segments)
    C, b, n = 4, 4 // 2, 2  # local rows: 4 rows over (replica x shard) = 2; 2 blocks
    kv = b * L * KV * HD * 4  # one of K or V gathered: b s n_kv d e (fp32)
    ring = (C - 1) / C
    seg = b * L * 4 if segments else 0
    want = n * ring * (passes + 1) * 2 * kv + ring * seg  # forward (x2 recomputed) + dK, dV back; segment ids once
    row = rep.comm_bytes_per_step["context"]
    assert row["measured"] == pytest.approx(want) and row["formula"] == pytest.approx(want), (row, want)
    assert rep.context["calls"] == n and rep.context["kv_bytes"] == 2 * kv
    ops = {(c["kind"], c["buffer_bytes"]): c["count"] for c in rep.context["collectives"]}
    if impl == "allgather":  # K, V (and segment ids) all-gathered, each X = b s n_kv d e; dK, dV reduce-scattered
        want_ops = {("all-gather", kv): n * passes * 2, ("reduce-scatter", kv): 2 * n}
        assert ops == (want_ops | {("all-gather", seg): 1} if segments else want_ops)
    else:  # C - 1 permutes of K and V (X / C each) forward, and of dK, dV backward
        assert ops == {("permute", kv // C): n * (C - 1) * 2 * (passes + 1)}
    assert "context" in rep.table()


def test_a_trace_returns_what_it_found():
    """What a trace found (the split, the attention calls per unit) comes back with it as a
    zshard.programs.program.TraceInfo, not on the step object: each plan's trace returns its own, and a
    trace JAX answers from its cache the same as the first (traced only, nothing compiled)."""
    step = zshard.make_train_step(loss_fn, sequence_axis={"tokens": 1, "targets": 1}, prefetch=0)
    b = {k: v for k, v in batches(1)[0].items() if k in ("tokens", "targets")}
    four, two = (zshard.init(make(), optax.adamw(1e-3), mesh(1, s, c), abstract=True) for s, c in ((2, 4), (4, 2)))
    _, info4 = step.trace(four, b)
    _, info2 = step.trace(two, b)
    _, again = step.trace(four, b)
    assert (info4.split.context, info4.split.length, info2.split.context) == (4, L, 2)
    assert [(unit, call.batch, call.length, call.kv_heads) for unit, _, call in info4.calls] == \
        [("blocks.0", 2, L, KV), ("blocks.1", 2, L, KV)]  # 4 rows over replica x shard = 2 per device
    assert [call.batch for _, _, call in info2.calls] == [1, 1] and info4.asked
    assert again == info4 and not hasattr(step, "last_trace")


# --- bad input ------------------------------------------------------------------------------------------


def test_bad_sequences_are_refused_before_compiling():
    state = zshard.init(make(), optax.adamw(1e-3), mesh(1, 2, 4), strategy="FULL_SHARD", abstract=True)
    step = zshard.make_train_step(loss_fn, sequence_axis=1)
    b = batches(1)[0]
    odd = {k: v[:, :60] for k, v in b.items()}
    with pytest.raises(ValueError, match=r"batch\['targets'\]: sequence length 60 does not divide by 2 x context = 8"):
        step.put_batch(state, odd)
    with pytest.raises(ValueError, match=r"batch\['weight'\] has shape \(4,\) and no sequence axis 1.*'weights': None"):
        step.put_batch(state, {**b, "weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"different lengths"):
        step.put_batch(state, {"tokens": b["tokens"], "targets": b["targets"][:, :32]})
    with pytest.raises(ValueError, match=r"must divide by the 2 devices \(replica x shard: the sequences are split over context\)"):
        step.put_batch(state, {k: v[:1] for k, v in b.items()})
    with pytest.raises(ValueError, match=r"sequence_axis=0: each entry must be a non-zero int"):
        zshard.make_train_step(loss_fn, sequence_axis=0)


def test_a_model_that_never_asks_for_positions_is_warned():
    class NoPositions(Llama):
        def __call__(self, tok, seg=None):
            x = self.embed(tok)
            for b in self.blocks:
                x = b(x, jnp.arange(tok.shape[1]), seg)  # local positions: wrong on a split sequence
            return self.head(self.norm(x))

    state = zshard.init(lambda: NoPositions(nnx.Rngs(0)), optax.adamw(1e-3), mesh(1, 4, 2), abstract=True)
    b = {k: v for k, v in batches(1)[0].items()}
    # the warning comes while tracing (zshard.context.sequence): traced only, nothing lowered
    with pytest.warns(UserWarning, match=r"never called zshard.positions\(\).*Fix: positions = zshard.positions"):
        zshard.make_train_step(loss_fn, sequence_axis=1).trace(state, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model that asks is not warned
        zshard.make_train_step(loss_fn, sequence_axis=1).trace(zshard.init(make(), optax.adamw(1e-3), mesh(1, 4, 2), abstract=True), b)


def test_a_context_axis_the_model_never_reads_is_refused_before_compiling():
    """Without sequence_axis a context mesh ran silently as data parallelism; with it, a model that
    never calls zshard.attention computed attention on each device's tokens only. Both are refused
    while tracing (abstract state: nothing is compiled)."""
    state = zshard.init(make(), optax.adamw(1e-3), mesh(1, 4, 2), abstract=True)
    b = batches(1)[0]
    with pytest.raises(ValueError, match=r"context axis of 2 devices but make_train_step\(...\) got no sequence_axis.*"
                                         r"sequence_axis=1.*zshard.attention"):
        zshard.make_train_step(loss_fn).lower(state, b8 := batches(1, rows=8)[0])

    class OwnAttention(Llama):  # positions right, attention by hand: wrong on a split sequence
        def __call__(self, tok, seg=None):
            x = self.embed(tok)
            q = x[:, :, None, :]  # [B, T, 1, D]
            return self.head(self.norm(x + jax.nn.dot_product_attention(q, q, q, is_causal=True)[:, :, 0]))

    own = zshard.init(lambda: OwnAttention(nnx.Rngs(0)), optax.adamw(1e-3), mesh(1, 4, 2), abstract=True)
    with pytest.raises(ValueError, match=r"split over context=2 .*never called zshard.attention.*"
                                         r"Fix: compute attention with zshard.attention"):
        zshard.make_train_step(loss_fn, sequence_axis=1).lower(own, b)
    with pytest.raises(ValueError, match=r"never called zshard.attention"):
        zshard.make_eval_step(loss_fn, sequence_axis=1).lower(own, b)
    rows = {k: None for k in b8}  # every leaf without a sequence: rows over context too, said on purpose
    zshard.make_train_step(loss_fn, sequence_axis=rows).lower(state, b8)


# --- the reference GPT and the Llama of train/models on a context mesh -------------------------------------


def _train_models():
    from train.models import GPT, GPTConfig, Llama as TrainLlama, LlamaConfig, cross_entropy_loss

    gpt = GPTConfig(vocab_size=V, seq_len=L, d_model=D, n_layers=2, n_heads=2)  # learned positions
    llama = LlamaConfig(vocab_size=V, seq_len=L, d_model=D, n_layers=2, n_heads=H, n_kv_heads=KV, d_ff=2 * D,
                        sliding_window=24, layer_types=("sliding", "full"))  # RoPE, GQA, a sliding layer
    return {"gpt": lambda: GPT(gpt, rngs=nnx.Rngs(0)), "llama": lambda: TrainLlama(llama, rngs=nnx.Rngs(0))}, cross_entropy_loss


@pytest.mark.parametrize("name,strategy,shape", [("gpt", "HYBRID_SHARD", (2, 2, 2)), ("llama", "FULL_SHARD", (1, 4, 2))])
def test_train_models_equal_one_device(name, strategy, shape):
    models, ce = _train_models()
    data = [(b["tokens"], b["targets"]) for b in batches()]
    model = models[name]()  # built once, eagerly: zshard.init copies it to its shards, then the reference trains it
    state = zshard.init(model, optax.adamw(1e-3), mesh(*shape), strategy=strategy)
    want = reference_run(lambda: model, optax.adamw(1e-3), ce, data)
    step = zshard.make_train_step(ce, sequence_axis=1, prefetch=1)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, want.losses, rtol=1e-5)
    flat = dict(nnx.to_flat_state(nnx.state(zshard.unshard(state), nnx.Param)))
    for path, ref in want.params.items():
        assert rel_l2(np.asarray(flat[path].get_value()), ref) <= 1e-5, path


def test_plan_cli_with_a_context_axis(capsys):
    """``python -m train.plan --context C``: the scanned GPT-2 preset's step on 1 x 2 x 2 emulated devices; its
    ``context`` row measured = formula (calls in a scanned unit counted once per layer, not again when the scan is
    differentiated); a sequence that does not split into 2C chunks refused before compiling."""
    from test_plan import planned  # noqa: PLC0415  (python -m train.plan's main in this process)

    from train import plan  # noqa: PLC0415

    base = ["--model", "gpt2-124m", "--mesh", "1x2", "--context", "2", "--batch-size", "2"]
    out = planned(base + ["--seq-len", "64"])
    row = re.search(r"^\| context \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|(?: [^|]* \|)?$", out, re.M)  # (+ moves)
    assert row and float(row.group(1)) > 0 and row.group(3) == "1.0000", out[-2500:]
    assert "each sequence split over context 2 (32 tokens per device)" in out and "FITS" in out
    with pytest.raises(SystemExit) as e:  # refused before compiling
        plan.main(base + ["--seq-len", "62"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--seq-len 62 must divide by 2 x --context = 4" in err, err[-500:]


# --- python -m train --context C ------------------------------------------------------------------------


def test_main_job_with_a_context_axis_equals_the_1x8_run(tmp_path):
    """``python -m train --mesh 1x4 --context 2``: the same losses and eval losses as ``--mesh 1x8`` (the nano GPT,
    same batches and weights; each sequence split over context, the rows over replica x shard). Both runs are
    ``python -m train``'s ``main`` in this process (tests/runs.py's ``train_main``: two subprocesses spent 26 s of
    CPU, against 8 s)."""
    import json
    from pathlib import Path

    from runs import train_main  # noqa: PLC0415

    root = Path(__file__).resolve().parent.parent
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(p.read_bytes() for p in sorted((root / "zshard").glob("*.py"))))
    runs = {}
    # the context run samples (generation's forward on a context mesh); the 1x8 run is the numbers' reference
    # only: no samples (the trainer's samples on 1x8: tests/test_cli.py, tests/test_main_eval.py), two eval
    # batches each (what is compared is the eval losses at steps 2 and 4, not how many batches they average),
    # no TensorBoard events (written the same whatever the mesh: tests/test_main_job.py, tests/test_cli.py)
    for name, flags in (("context", ["--mesh", "1x4", "--context", "2", "--sample-tokens", "4"]),
                        ("rows", ["--mesh", "1x8", "--sample-tokens", "0"])):
        out = tmp_path / name
        assert train_main(["--model", "nano", "--steps", "4", "--seq-len", "32", "--batch-size", "8", "--data", corpus,
                           "--eval-every", "2", "--eval-batches", "2", "--no-tensorboard", "--out", out, *flags]) == 0
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "context" / "summary.json").read_text())["mesh"] == {"replica": 1, "shard": 4, "context": 2}
    for key in ("loss", "eval_loss"):
        got, want = ([r[key] for r in runs[n] if key in r] for n in ("context", "rows"))
        assert len(got) == len(want) >= 3
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_main_job_context_errors_name_the_key():
    from train.cli import build_parser
    from train.flags import ConfigError

    def error(argv):
        with pytest.raises(ConfigError) as e:
            build_parser().parse_args(["--model", "nano", *argv]).run.validate(8)
        return str(e.value)

    assert "model.seq_len (--seq-len)" in (m := error(["--context", "2", "--seq-len", "30"])) and "2 x mesh.context = 4" in m, m
    m = error(["--context", "2", "--mesh", "2x2", "--batch-size", "6"])
    assert "training.batch_size (--batch-size)" in m and "4 row devices (replica x shard)" in m, m
    m = error(["--context", "2", "--mesh", "2x4"])
    assert "is 2x4 x context 2 = 16 devices, but there are 8" in m and "1x4, 2x2, 4x1" in m, m
    m = error(["--context", "3", "--mesh", "1x4"])  # no RxS fits: the suggestion names the context sizes that do
    assert "context 3 x tensor 1 = 3 does not divide 8: use --context 1, 2, 4 or 8; or --devices 12" in m, m

"""studies.lib.regimes: each regime does what it says, measured on the quantity it claims.

References are computed independently: NumPy float64 (and ml_dtypes / NumPy's float16 for
the rounding), hand-worked values, and the closed-form cross-entropy gradient.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from studies.lib import regimes
from studies.lib.models import NnxTransformerLM, TransformerConfig, TransformerLM, lm_loss

CFG = TransformerConfig(d_model=32, num_heads=2, num_layers=1, d_ff=64, max_len=16)
BATCH, SEQ = 4, 16


@pytest.fixture(scope="module")
def tiny():
    """(params, tokens, grads of the mean loss) of a tiny f32 TransformerLM."""
    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ), 0, 256, jnp.int32)
    params = jax.jit(TransformerLM(CFG).init)(jax.random.PRNGKey(0), tokens)["params"]
    grads = jax.jit(jax.grad(lambda p: lm_loss(TransformerLM(CFG).apply({"params": p}, tokens),
                                               tokens)))(params)
    return params, tokens, grads


def _np_weights(tree):
    """The weight matrices, by the documented rule, via flax's flattened dict paths."""
    from flax.traverse_util import flatten_dict

    flat = flatten_dict(jax.tree.map(np.asarray, tree))
    return [np.asarray(x, np.float64) for k, x in sorted(flat.items())
            if x.ndim >= 2 and k[-1] not in ("bias", "scale")]


# ----------------------------------------------------------------------------- late training


def test_late_training_lr_gives_the_target_ratio(tiny):
    params, _, grads = tiny
    reg = regimes.LateTraining()
    assert reg.update_to_weight == 3e-4
    opt = optax.adam(1.0)
    state = opt.init(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int and f32
        direction, _ = jax.jit(opt.update)(grads, state, params)  # Adam at unit lr
    lr = float(reg.lr(params, direction))
    w = _np_weights(params)
    d = _np_weights(direction)
    norm = lambda xs: math.sqrt(sum(float(np.sum(x * x)) for x in xs))  # noqa: E731
    assert lr == pytest.approx(3e-4 * norm(w) / norm(d), rel=1e-5)
    # The same Adam, now at that learning rate, from the same state: the step taken.
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = jax.jit(optax.adam(lr).update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    delta = [n - o for n, o in zip(_np_weights(new), w)]
    ratio64 = norm(delta) / norm(w)
    # f32 rounding of w + u perturbs the difference by ~eps_f32 / 3e-4 = 2e-4 relative.
    assert ratio64 == pytest.approx(3e-4, rel=2e-3)
    got = jax.jit(regimes.update_ratio)(params, new)
    assert float(got["global"]) == pytest.approx(ratio64, rel=1e-4)
    per = [math.sqrt(float(np.sum(x * x))) / math.sqrt(float(np.sum(o * o)))
           for x, o in zip(delta, w)]
    assert float(got["median"]) == pytest.approx(float(np.median(per)), rel=1e-4)
    assert float(got["max"]) == pytest.approx(max(per), rel=1e-4)
    assert float(got["min"]) == pytest.approx(min(per), rel=1e-4)


def test_stalled_fraction_hand_computed():
    # bf16 around 1.0: spacing 2^-7 above, 2^-8 below. 1 + 1e-3 and 1 - 1e-3 round back
    # to 1 (less than half a spacing); 1 + 4e-3 passes the midpoint 1 + 2^-8 and moves.
    w = jnp.ones(4, jnp.float32)
    u = jnp.array([1e-3, 4e-3, 0.0, -1e-3], jnp.float32)
    assert float(regimes.stalled_fraction(w, u)) == pytest.approx(2 / 3, rel=1e-7)
    assert float(regimes.stalled_fraction(w, u, jnp.float32)) == 0.0
    assert float(regimes.stalled_fraction(w, jnp.zeros(4, jnp.float32))) == 0.0


def test_late_training_stalls_most_bf16_elements(tiny):
    params, _, grads = tiny
    opt = optax.adam(1.0)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int and f32
        direction, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    lr = regimes.LateTraining().lr(params, direction)
    updates = jax.tree.map(lambda d: lr * d, direction)
    stalled = jax.jit(regimes.stalled_fraction)
    got = float(stalled(params, updates))
    # Independent: ml_dtypes' bf16 rounding in NumPy.
    lost = nonzero = 0
    for p, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates)):
        w_lp = np.asarray(p).astype(ml_dtypes.bfloat16)
        u32 = np.asarray(u, np.float32)
        new = (w_lp.astype(np.float32) + u32).astype(ml_dtypes.bfloat16)
        lost += int(np.sum((u32 != 0) & (new == w_lp)))
        nonzero += int(np.sum(u32 != 0))
    assert got == pytest.approx(lost / nonzero, rel=1e-6)
    # The regime's claim: at a 3e-4 ratio most bf16 parameters no longer move, while the
    # tiny model's own step (Adam at lr 3e-3) moves most of them.
    assert got > 0.5
    own = jax.tree.map(lambda d: 3e-3 * d, direction)
    assert float(stalled(params, own)) < 0.5


# ------------------------------------------------------------------------- tokens per update


def test_underflow_hand_computed():
    g = jnp.array([2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-26, 0.0, 1e-3, 2.0**-14,
                   2.0**-15], jnp.float32)
    u = regimes.underflow({"a": g})
    # 7 nonzero. Under 2^-24: 2^-25, 1.5*2^-25, 2^-26. Flushed by round-to-nearest-even:
    # 2^-25 (a tie, to the even 0) and 2^-26; 1.5*2^-25 rounds up to 2^-24.
    # Under 2^-14: all but 1e-3 and 2^-14. Median of the 7 nonzero: 2^-24.
    assert float(u["below_min_subnormal"]) == pytest.approx(3 / 7, rel=1e-7)
    assert float(u["flushed"]) == pytest.approx(2 / 7, rel=1e-7)
    assert float(u["subnormal"]) == pytest.approx(5 / 7, rel=1e-7)
    assert float(u["median_abs"]) == 2.0**-24
    assert regimes.FP16_MIN_SUBNORMAL == float(np.finfo(np.float16).smallest_subnormal)


def test_tokens_per_update_scales_gradients_under_fp16_range(tiny):
    params, tokens, grads = tiny
    reg = regimes.TokensPerUpdate()
    micro = BATCH * (SEQ - 1)
    w = reg.loss_weight(micro)
    assert w == micro / 4_194_304
    model = TransformerLM(CFG)
    scaled = jax.jit(jax.grad(lambda p: lm_loss(model.apply({"params": p}, tokens), tokens)
                              * jnp.float32(w)))(params)
    for a, b in zip(jax.tree.leaves(scaled), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64) * w,
                                   rtol=1e-4, atol=1e-12)

    def reference(tree):
        g = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(tree)])
        nz = g != 0
        return (np.mean(np.abs(g[nz]).astype(np.float64) < 2.0**-24),
                np.mean(g[nz].astype(np.float16) == 0))

    got = regimes.underflow(scaled)
    below, flushed = reference(scaled)
    assert float(got["below_min_subnormal"]) == pytest.approx(below, rel=1e-6)
    assert float(got["flushed"]) == pytest.approx(flushed, rel=1e-6)
    # The regime's claim: gradients that were in fp16's range fall under 2^-24.
    before = float(regimes.underflow(grads)["below_min_subnormal"])
    assert before == pytest.approx(reference(grads)[0], abs=1e-9)
    assert float(got["below_min_subnormal"]) > before + 0.05


# --------------------------------------------------------------------------- outlier features


def _gemm_inputs(model, params, tokens):
    """Inputs of every Dense in the model, by module path (via nn.intercept_methods)."""
    seen = {}

    def record(next_fun, args, kwargs, context):
        if (isinstance(context.module, (nn.Dense, nn.DenseGeneral))
                and context.method_name == "__call__"):
            seen["/".join(context.module.path)] = np.asarray(args[0], np.float64)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        model.apply({"params": params}, tokens)
    return seen


def test_outlier_features_in_what_the_gemms_read(tiny):
    params, tokens, _ = tiny
    reg = regimes.OutlierFeatures()
    assert (reg.magnitude, reg.channels) == (1e4, 1)
    scale = reg.channel_scale(CFG.d_model)
    ch = reg.outlier_channels(CFG.d_model)
    assert ch.shape == (1,) and scale[ch[0]] == 1e4
    assert np.sum(scale == 1.0) == CFG.d_model - 1
    cfg = reg.apply(CFG)
    assert cfg.outlier_scale == tuple(float(v) for v in scale)
    base = _gemm_inputs(TransformerLM(CFG), params, tokens)
    hot = _gemm_inputs(TransformerLM(cfg), params, tokens)  # the hook adds no parameters
    q = "Block_0/attn/query"
    # The first GEMM's input is the base one with the outlier channel multiplied.
    np.testing.assert_allclose(hot[q], base[q] * scale, rtol=1e-6, atol=1e-6)
    amax = np.abs(base[q] * scale).reshape(-1, CFG.d_model).max(axis=0)
    expected = amax.max() / np.median(amax)
    assert float(regimes.channel_amax_ratio(hot[q])) == pytest.approx(expected, rel=1e-5)
    assert expected > 1e3  # the channel's own amax over the median: ~magnitude
    # The MLP's input (after attention changed the stream): the outlier channel dominates.
    mlp = "Block_0/MlpBlock_0/Dense_0"
    amax_mlp = np.abs(hot[mlp]).reshape(-1, CFG.d_model).max(axis=0)
    assert int(np.argmax(amax_mlp)) == ch[0]
    assert float(regimes.channel_amax_ratio(hot[mlp])) > 1e4 / 20
    assert float(regimes.channel_amax_ratio(base[mlp])) < 20


def test_outlier_readers_held_at_zero_leave_only_the_quantizers_to_see_the_outliers(tiny):
    """With the outlier channel's rows of the reading kernels at zero, the model in the
    regime computes bit for bit what the model without it computes (the channel times 0
    adds exact zeros), and training keeps those rows at exactly zero."""
    params, tokens, _ = tiny
    reg = regimes.OutlierFeatures()
    ch = reg.outlier_channels(CFG.d_model)[0]
    mask = reg.reader_mask(params, CFG.d_model)
    masked = jax.tree.map(lambda x, m: x * m, params, mask)
    readers = {"Block_0/attn/query/kernel", "Block_0/attn/key/kernel",
               "Block_0/attn/value/kernel", "Block_0/MlpBlock_0/Dense_0/kernel"}
    for path, m in jax.tree_util.tree_leaves_with_path(mask):
        key = "/".join(k.key for k in path)
        assert np.all(m[ch] == 0) if key in readers else np.all(m == 1), key
        if key in readers:
            assert np.sum(m == 0) == m[ch].size  # that row only
    hot = TransformerLM(reg.apply(CFG)).apply({"params": masked}, tokens)
    cold = TransformerLM(CFG).apply({"params": masked}, tokens)
    np.testing.assert_array_equal(np.asarray(hot), np.asarray(cold))

    from studies.training import TrainConfig, batch_at, load_data, make_train_step

    cfg = TrainConfig(model=CFG, regime="outlier-features", steps=2, batch=4, seq_len=16,
                      corpus_bytes=4096, warmup=1)
    init_fn, step_fn = make_train_step("fp8-current", cfg)
    state = init_fn()
    data = load_data(cfg)
    for i in range(2):
        state, _ = step_fn(state, batch_at(data, cfg, i))
    q = np.asarray(state.params["Block_0"]["attn"]["query"]["kernel"])
    assert np.all(q[ch] == 0) and np.all(np.any(q != 0, axis=(1, 2)) | (np.arange(32) == ch))


def test_outlier_scale_is_off_by_default_and_exact_at_one(tiny):
    params, tokens, _ = tiny
    assert CFG.outlier_scale is None
    ones = TransformerConfig(**{**CFG.__dict__, "outlier_scale": (1.0,) * CFG.d_model})
    a = TransformerLM(CFG).apply({"params": params}, tokens)
    b = TransformerLM(ones).apply({"params": params}, tokens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="outlier_scale must be None or d_model=32"):
        TransformerConfig(d_model=32, num_heads=2, outlier_scale=(1.0,) * 31)
    with pytest.raises(ValueError, match="outlier_scale"):
        TransformerConfig(d_model=2, num_heads=1, outlier_scale=(1.0, 0.0))
    hash(regimes.OutlierFeatures().apply(CFG))  # still a valid static argument


def test_outlier_scale_nnx_matches_linen_effect():
    from flax import nnx

    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 8), 0, 256, jnp.int32)
    cfg = TransformerConfig(d_model=16, num_heads=2, num_layers=1, d_ff=32, max_len=8)
    plain = NnxTransformerLM(cfg, rngs=nnx.Rngs(0))
    ones = NnxTransformerLM(TransformerConfig(**{**cfg.__dict__,
                                                 "outlier_scale": (1.0,) * 16}),
                            rngs=nnx.Rngs(0))
    hot = NnxTransformerLM(regimes.OutlierFeatures(magnitude=100.0).apply(cfg),
                           rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(plain(tokens)), np.asarray(ones(tokens)))
    assert not np.allclose(np.asarray(plain(tokens)), np.asarray(hot(tokens)))


def test_channel_amax_hand_computed():
    x = jnp.array([[1.0, -2.0, 3.0], [-4.0, 1.0, 0.5]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(regimes.channel_amax(x)), [4.0, 2.0, 3.0])
    assert float(regimes.channel_amax_ratio(x)) == pytest.approx(4 / 3, rel=1e-7)


# ----------------------------------------------------------------- token-wise gradient outliers


def test_loss_weights():
    reg = regimes.TokenGradOutliers()
    assert reg.count(252) == 1 and reg.count(504) == 2 and reg.count(10) == 1
    w = np.asarray(reg.loss_weights(jax.random.PRNGKey(0), (8, 63)), np.float64)
    assert w.shape == (8, 63)
    assert w.mean() == pytest.approx(1.0, rel=1e-6)
    hi, lo = np.unique(w)[::-1][:1], np.unique(w)[:1]
    assert np.sum(w == hi) == 2 and np.sum(w == lo) == 502
    assert hi[0] / lo[0] == pytest.approx(100.0, rel=1e-6)
    w2 = np.asarray(reg.loss_weights(jax.random.PRNGKey(1), (8, 63)))
    assert not np.array_equal(w == w.max(), w2 == w2.max())


def test_token_gradient_outliers_measured_at_the_logits(tiny):
    params, tokens, _ = tiny
    logits = TransformerLM(CFG).apply({"params": params}, tokens)
    reg = regimes.TokenGradOutliers(fraction=2 / 60)  # 2 of the 60 predicted tokens
    w = reg.loss_weights(jax.random.PRNGKey(7), (BATCH, SEQ - 1))
    g = jax.grad(regimes.weighted_lm_loss)(logits, tokens, w)
    # Closed form: d/dlogits of mean_t(w_t * nll_t) = w_t * (softmax - onehot) / N.
    z = np.asarray(logits, np.float64)[:, :-1]
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(256)[np.asarray(tokens)[:, 1:]]
    ref = np.asarray(w, np.float64)[..., None] * (p - onehot) / (BATCH * (SEQ - 1))
    np.testing.assert_allclose(np.asarray(g, np.float64)[:, :-1], ref, rtol=1e-4, atol=1e-9)
    assert np.all(np.asarray(g)[:, -1] == 0)
    norms = np.linalg.norm(ref, axis=-1).ravel()
    expected = norms.max() / np.median(norms)
    got = float(regimes.token_norm_ratio(g[:, :-1]))
    assert got == pytest.approx(expected, rel=1e-4)
    # Without the weights the same logits give a much smaller ratio: the regime's claim.
    flat = jax.grad(regimes.weighted_lm_loss)(logits, tokens, jnp.ones_like(w))
    assert float(regimes.token_norm_ratio(flat[:, :-1])) * 10 < got


def test_weighted_loss_with_unit_weights_is_lm_loss(tiny):
    params, tokens, _ = tiny
    logits = TransformerLM(CFG).apply({"params": params}, tokens)
    ones = jnp.ones((BATCH, SEQ - 1), jnp.float32)
    assert float(regimes.weighted_lm_loss(logits, tokens, ones)) == pytest.approx(
        float(lm_loss(logits, tokens)), rel=1e-6)


def test_token_norms_hand_computed():
    g = jnp.array([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]], jnp.float32)
    np.testing.assert_allclose(np.asarray(regimes.token_norms(g)), [5.0, 1.0, 10.0])
    assert float(regimes.token_norm_ratio(g)) == pytest.approx(2.0, rel=1e-7)


# ------------------------------------------------------------------------------------ registry


def test_registry_and_validation():
    assert list(regimes.REGIMES) == ["late-training", "tokens-per-update", "outlier-features",
                                     "token-grad-outliers", "fp4-training"]
    assert regimes.get_regime("late-training") == regimes.LateTraining()
    assert regimes.get_regime("outlier-features").describe() == {
        "regime": "outlier-features", "magnitude": 1e4, "channels": 1, "seed": 0}
    with pytest.raises(ValueError, match="unknown regime 'x'; known: late-training"):
        regimes.get_regime("x")
    with pytest.raises(ValueError, match="update_to_weight must be"):
        regimes.LateTraining(update_to_weight=0.0)
    with pytest.raises(ValueError, match="global_tokens must be an int"):
        regimes.TokensPerUpdate(global_tokens=1.5)
    with pytest.raises(ValueError, match="exceeds global_tokens"):
        regimes.TokensPerUpdate(global_tokens=8).loss_weight(16)
    with pytest.raises(ValueError, match="channels=5 exceeds d_model=4"):
        regimes.OutlierFeatures(channels=5).channel_scale(4)
    with pytest.raises(ValueError, match="fraction must be in"):
        regimes.TokenGradOutliers(fraction=2.0)
    with pytest.raises(ValueError, match="num_layers must be >= 2"):
        regimes.FP4Training(num_layers=1)
    for r in regimes.REGIMES.values():
        hash(r)


def test_grad_noise_ratio_hand_values():
    # ||ref|| = 5 (a 3-4 right triangle); the noise is (0, 1): ratio 5. Biases are ignored.
    ref = {"k": {"kernel": jnp.array([[3.0, 4.0]])}, "b": {"bias": jnp.ones((1, 2))}}
    got = {"k": {"kernel": jnp.array([[3.0, 5.0]])}, "b": {"bias": jnp.zeros((1, 2))}}
    assert float(regimes.grad_noise_ratio(ref, got)) == pytest.approx(5.0, rel=1e-7)
    with pytest.raises(ValueError, match="weight matrix"):
        regimes.grad_noise_ratio({"bias": jnp.ones((1, 2))}, {"bias": jnp.ones((1, 2))})

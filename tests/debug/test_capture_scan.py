"""fmtkit.debug inside loop bodies: per-iteration statistics of GEMMs in nn.scan, nnx.scan
and lax.scan layer stacks.

The reference is independent of the scan: the same model unrolled by hand (a Python loop over
the layers, each layer's parameters sliced from the stacked ones), whose GEMM tensors the
zero-addition hook of ``test_capture_stats`` captures (one GEMM per layer, no loop), with every
statistic computed in NumPy float64. Stacked statistic ``[i]`` must equal layer ``i``'s.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_capture_stats import RTOL, SQNR_ATOL, _captured, _np_base, _np_quant
from test_capture_stats import _debug_stats as _stats

import fmtkit.debug as debug
from fmtkit import with_policy
from fmtkit._switches import flipped
from fmtkit.policy import intercept_gemms

LAYERS = 3
WIDTH = 24


# -- the models, scanned and unrolled --------------------------------------------------------
class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(WIDTH)(h)), None


class ScanStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=LAYERS)
        return nn.Dense(8, name="head")(layers(name="layers")(x, None)[0])


class UnrolledStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = Block(name=f"layers_{i}")(x, None)[0]
        return nn.Dense(8, name="head")(x)


def _data():
    x = jax.random.normal(jax.random.key(1), (6, WIDTH), jnp.float32)
    c = jax.random.normal(jax.random.key(2), (6, 8), jnp.float32)
    return x, c


def _linen_case(preset):
    """(scanned loss, params, unrolled loss, unrolled params, {layer: (path, gemm)} of the
    unrolled model, (path, gemm) of the scanned GEMM)."""
    x, c = _data()
    scanned = with_policy(ScanStack(), preset)
    unrolled = with_policy(UnrolledStack(), preset)
    v = scanned.init(jax.random.key(0), x)
    stacked = v["params"]["layers"]
    vu = {"params": {"head": v["params"]["head"],
                     **{f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], stacked)
                        for i in range(LAYERS)}}}

    def loss(model):
        return lambda v: jnp.sum(model.apply(v, x).astype(jnp.float32) * c)

    layers = {i: (f"layers_{i}/Dense_0", "dot_general_0") for i in range(LAYERS)}
    return loss(scanned), v, loss(unrolled), vu, layers, ("layers/Dense_0", "dot_general_0")


def _nnx_case(preset):
    from flax import nnx

    class NBlock(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, h):
            return jnp.tanh(self.lin(h))

    class NScan(nnx.Module):
        def __init__(self, key):
            @nnx.vmap(in_axes=0, out_axes=0)
            def create(k):
                return NBlock(nnx.Rngs(k))

            self.blocks = create(jax.random.split(key, LAYERS))
            self.head = nnx.Linear(WIDTH, 8, rngs=nnx.Rngs(7))

        def __call__(self, h):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def run(block, h):
                return block(h)

            return self.head(run(self.blocks, h))

    class NUnrolled(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([NBlock(nnx.Rngs(i)) for i in range(LAYERS)])
            self.head = nnx.Linear(WIDTH, 8, rngs=nnx.Rngs(7))

        def __call__(self, h):
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    x, c = _data()
    scanned = with_policy(NScan(jax.random.key(0)), preset)
    gd, p, rest = nnx.split(scanned, nnx.Param, ...)
    unrolled = with_policy(NUnrolled(), preset)
    gdu, pu, restu = nnx.split(unrolled, nnx.Param, ...)
    pu = nnx.State({"head": p["head"],
                    "blocks": {i: jax.tree.map(lambda a, i=i: a[i], p["blocks"])
                               for i in range(LAYERS)}})

    def loss(gd, rest):
        return lambda p: jnp.sum(nnx.merge(gd, p, rest)(x).astype(jnp.float32) * c)

    layers = {i: (f"blocks/{i}/lin", "dot_general_0") for i in range(LAYERS)}
    return loss(gd, rest), p, loss(gdu, restu), pu, layers, ("blocks/lin", "dot_general_0")


def _stacked_weights():
    k = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(k[0], (LAYERS, WIDTH, WIDTH)) * 0.3,
            jax.random.normal(k[1], (6, WIDTH)), jax.random.normal(k[2], (WIDTH, 8)))


def _function_case(preset, reverse=False):
    """A plain function: lax.scan over stacked weights (reverse: the last layer first), then
    a head."""
    ws, x, wo = _stacked_weights()

    def scanned(ws):
        def body(h, w):
            return jnp.tanh(h @ w), None

        return jnp.sum(jnp.sin(jax.lax.scan(body, x, ws, reverse=reverse)[0] @ wo))

    def unrolled(ws):
        h = x
        for i in (reversed(range(LAYERS)) if reverse else range(LAYERS)):
            h = jnp.tanh(h @ ws[i])
        return jnp.sum(jnp.sin(h @ wo))

    order = list(reversed(range(LAYERS))) if reverse else list(range(LAYERS))
    # the unrolled GEMMs are numbered in the order they run
    layers = {layer: ("", f"dot_general_{k}") for k, layer in enumerate(order)}
    return (with_policy(scanned, preset, params_argnums=0), ws,
            with_policy(unrolled, preset, params_argnums=0), ws, layers,
            ("", "dot_general_0"))


def _want(site, t, x):
    want = _np_base(x)
    if site.fp8 is not None and t in ("activation", "weight", "output_grad"):
        recipe = site.fp8
        a2 = {"activation": x, "weight": x.T, "output_grad": x}[t]  # [free, contraction]
        fmt, op = {"activation": (recipe.x_format, "x"), "weight": (recipe.w_format, "w"),
                   "output_grad": (recipe.grad_format, "grad")}[t]
        want.update(_np_quant(a2, fmt, recipe.scaling(op)))
    return want


def _check(case):
    loss, params, unrolled, uparams, layers, (path, gemm) = case
    cfg = debug.DebugConfig([debug.Rule("")])
    state, value, grads, stats = _stats(loss, params, cfg)
    got = stats[path][gemm]
    assert set(got) == set(debug.TENSORS)
    for t in debug.TENSORS:
        for s in got[t]:
            assert state[path][gemm][t][s].shape == (LAYERS,), (t, s)
            assert got[t][s].shape == (LAYERS,), (t, s)
    # The taps change no number: loss and parameter gradients as without debugging.
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(params)
    assert value == ref_value
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), grads,
                                            ref_grads)))
    captured = _captured(unrolled, uparams)
    quantized = 0
    for i, key in layers.items():
        site, tensors = captured[key]
        for t, x in tensors.items():
            want = _want(site, t, x)
            quantized += "sqnr_db" in want
            assert set(got[t]) == set(want), (i, t)
            for s, v in want.items():
                np.testing.assert_allclose(float(got[t][s][i]), v, rtol=RTOL,
                                           atol=SQNR_ATOL if s == "sqnr_db" else 0,
                                           err_msg=f"layer {i}: {t}/{s}")
    return quantized


@pytest.mark.slow
def test_nn_scan_statistics_per_layer_match_numpy_float64():
    assert _check(_linen_case("fp8-current")) == 3 * LAYERS


@pytest.mark.slow
def test_nnx_scan_statistics_per_layer_match_numpy_float64():
    assert _check(_nnx_case("fp8-current")) == 3 * LAYERS


@pytest.mark.slow
@pytest.mark.parametrize("reverse", [False, True])
def test_lax_scan_statistics_per_iteration_match_numpy_float64(reverse):
    assert _check(_function_case("fp8-current", reverse)) == 3 * LAYERS


@pytest.mark.slow
def test_all_iterations_in_one_slot_fails_the_comparison():
    # Negative control: every iteration writes slot 0 (the others stay 0).
    with flipped(debug_loop_slots=False), pytest.raises(AssertionError, match="layer 0"):
        _check(_function_case("bf16-mixed"))


@pytest.mark.slow
def test_nested_scans_and_static_fori_loop_stack_every_iteration():
    ws = jax.random.normal(jax.random.key(4), (2, LAYERS, 8, 8)) * 0.5
    x = jax.random.normal(jax.random.key(5), (4, 8))

    def nested(ws):
        def outer(h, wo):
            def inner(h, w):
                return jnp.tanh(h @ w), None

            return jax.lax.scan(inner, h, wo)[0], None

        return jnp.sum(jax.lax.scan(outer, x, ws)[0])

    def fori(ws):  # static bounds: a scan
        w2 = ws.reshape(-1, 8, 8)
        return jnp.sum(jax.lax.fori_loop(0, w2.shape[0], lambda i, h: jnp.tanh(h @ w2[i]), x))

    def unrolled(ws):
        h = x
        for w in ws.reshape(-1, 8, 8):
            h = jnp.tanh(h @ w)
        return jnp.sum(h)

    assert "scan" in str(jax.make_jaxpr(fori)(ws))
    cfg = debug.DebugConfig([debug.Rule("", tensors=("activation", "wgrad"),
                                        stats=("amax", "l2_norm"))])
    captured = _captured(with_policy(unrolled, "bf16-mixed"), ws)
    n = 2 * LAYERS
    want_amax = [_np_base(captured[("", f"dot_general_{k}")][1]["activation"])["amax"]
                 for k in range(n)]
    want_l2 = [_np_base(captured[("", f"dot_general_{k}")][1]["wgrad"])["l2_norm"]
               for k in range(n)]
    assert len(set(want_l2)) == n  # every iteration's value is distinct
    for fn, shape in ((nested, (2, LAYERS)), (fori, (n,))):
        _, _, _, stats = _stats(with_policy(fn, "bf16-mixed"), ws, cfg)
        got = stats[""]["dot_general_0"]
        assert got["activation"]["amax"].shape == shape
        np.testing.assert_allclose(np.asarray(got["activation"]["amax"]).reshape(-1),
                                   want_amax, rtol=RTOL)
        np.testing.assert_allclose(np.asarray(got["wgrad"]["l2_norm"]).reshape(-1), want_l2,
                                   rtol=RTOL)


def test_non_logging_steps_are_nan_per_slot_and_steps_do_not_recompile():
    loss, params, *_ = _function_case("bf16-mixed")
    cfg = debug.DebugConfig([debug.Rule("", gemm="dot_general_0",
                                        tensors=("activation", "dgrad"),
                                        stats=("amax", "underflow_share"), freq=3)])
    state = debug.init(cfg, loss, params)
    traces = []

    @jax.jit
    def step(p, s, i):
        traces.append(1)

        def f(p, s):
            with debug.capture(cfg, s, i):
                return loss(p)

        return jax.grad(f, argnums=(0, 1))(p, s)[1]

    for i in range(5):
        leaves = np.stack([np.asarray(a) for a in jax.tree.leaves(step(params, state, i))])
        assert leaves.shape[1] == LAYERS
        if i % 3 == 0:
            assert np.isfinite(leaves).all(), i
        else:
            assert np.isnan(leaves).all(), i
    assert len(traces) == 1


@pytest.mark.slow
def test_static_schedule_quiet_steps_are_nan_per_slot():
    loss, params, *_ = _function_case("bf16-mixed")
    cfg = debug.DebugConfig([debug.Rule("", gemm="dot_general_0", tensors=("weight",),
                                        stats=("amax",), freq=2)])
    state = debug.init(cfg, loss, params)

    def stats_at(i):
        def f(p, s):
            with debug.capture(cfg, s, active=cfg.active_rules(i)):
                return loss(p)

        return jax.grad(f, argnums=(0, 1))(params, state)[1][""]["dot_general_0"]

    np.testing.assert_array_equal(stats_at(0)["weight"]["amax"],
                                  np.abs(np.asarray(params, np.float32).astype(
                                      jnp.bfloat16).astype(np.float32)).max(axis=(1, 2)))
    assert np.isnan(np.asarray(stats_at(1)["weight"]["amax"])).all()


def test_without_debugging_the_scanned_program_is_unchanged():
    # Off (and a hook that only passes the GEMMs through): the same lowered program, also
    # after fmtkit.debug has run; logging statistics in the scan body changes it.
    loss, params, *_ = _function_case("fp8-current")

    def lowered():
        return jax.jit(jax.value_and_grad(loss)).lower(params).as_text()

    plain = lowered()

    def passthrough(site, run, a, b):
        return run(a, b, site.fp8)

    with intercept_gemms(passthrough):
        assert lowered() == plain
    cfg = debug.DebugConfig([debug.Rule("", gemm="dot_general_0", stats=("amax",))])
    state = debug.init(cfg, loss, params)

    def f(p, s, i):
        with debug.capture(cfg, s, i):
            return loss(p)

    assert jax.jit(jax.grad(f, argnums=(0, 1))).lower(params, state, 0).as_text() != plain
    assert lowered() == plain


def test_a_while_loop_with_logged_statistics_raises_naming_the_gemm():
    ws, x, _ = _stacked_weights()

    def f(ws, n):
        return jnp.sum(jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ ws[i]), x))

    model = with_policy(f, "bf16-mixed")
    cfg = debug.DebugConfig([debug.Rule("", stats=("amax",))])
    with pytest.raises(ValueError, match=r"GEMM ''/dot_general_0, which runs inside a while "
                                         r"loop.*static bounds"):
        debug.init(cfg, model, ws, jnp.int32(LAYERS))


def test_a_state_without_the_layer_axis_raises():
    loss, params, *_ = _function_case("bf16-mixed")
    cfg = debug.DebugConfig([debug.Rule("", gemm="dot_general_0", tensors=("weight",),
                                        stats=("amax",))])
    state = jax.tree.map(lambda a: a[0], debug.init(cfg, loss, params))

    def f(p, s):
        with debug.capture(cfg, s, 0):
            return loss(p)

    with pytest.raises(ValueError, match=r"shape \(\).*trip counts \(3,\)"):
        jax.grad(f, argnums=(0, 1))(params, state)


def test_logs_hold_one_tag_per_layer(tmp_path):
    # (fmtkit debug on such a log: tests/studies/test_debug_cli.py)
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fmtkit.debug.log import StatsLogger, flatten_stats

    loss, params, *_ = _function_case("bf16-mixed")
    cfg = debug.DebugConfig([debug.Rule("", gemm="dot_general_0", tensors=("activation",),
                                        stats=("amax", "l2_norm"))])
    state, _, _, stats = _stats(loss, params, cfg)
    got = stats[""]["dot_general_0"]["activation"]
    with StatsLogger(tmp_path, layers=state) as log:
        assert log.write(0, stats) == 2 * LAYERS
    want = {f"[{i}]/dot_general_0/activation/{s}": float(got[s][i])
            for s in ("amax", "l2_norm") for i in range(LAYERS)}
    assert flatten_stats(stats, layers=state) == want
    # Without the layers, the layer axis counts as shards (reduced to one value).
    assert set(flatten_stats(stats)) == {"dot_general_0/activation/amax",
                                         "dot_general_0/activation/l2_norm"}
    (line,) = (tmp_path / "stats.jsonl").read_text().splitlines()
    assert json.loads(line)["stats"] == want
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(want)
    for tag, v in want.items():
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(0, float(np.float32(v)))]
    with pytest.raises(ValueError, match=r"shape \(3,\).*trip counts \(2,\)"):
        flatten_stats(stats, layers=jax.tree.map(lambda a: a[:2], state))


def test_the_worst_layer_moves_the_stacked_gemm():
    ap = debug.Autopilot(underflow_share=0.1, patience=1, ladder=("compute",))
    key = ("layers/Dense_0", "dot_general_0")
    st = ap.init({key[0]: {key[1]: {}}})
    quiet = {key[0]: {key[1]: {"activation": {"underflow_share": np.array([0.0, 0.05, 0.0]),
                                              "nonfinite_count": np.zeros(3)}}}}
    st, d = ap.update(st, quiet, step=0)
    assert d == []
    nan = jax.tree.map(lambda a: np.full_like(a, np.nan), quiet)
    st, d = ap.update(st, nan, step=1)
    assert d == []
    hot = {key[0]: {key[1]: {"activation": {"underflow_share": np.array([0.0, 0.5, 0.25]),
                                            "nonfinite_count": np.zeros(3)}}}}
    st, d = ap.update(st, hot, step=2)
    assert [(x.module, x.gemm, x.stat, x.value) for x in d] == [
        (*key, "underflow_share", 0.5)]
    # Its override names the stacked GEMM: the whole scan runs in the compute dtype.
    loss, params, *_ = _function_case("fp8-current")
    moved = ap.init({"": {"dot_general_0": {}}})
    moved, _ = ap.update(moved, {"": {"dot_general_0": hot[key[0]][key[1]]}}, step=0)

    def jaxpr(cfg):  # (the scanned GEMM is the only FP8 one: the head's weight is no param)
        def f(p):
            with debug.capture(cfg):
                return loss(p)

        return str(jax.make_jaxpr(f)(params))

    assert "f8_e4m3" in jaxpr(ap.config())  # (control: FP8 before the move)
    assert "f8_e4m3" not in jaxpr(ap.config(moved))


@pytest.mark.slow
def test_delayed_scaling_statistics_per_layer_use_that_layers_history():
    from test_capture_stats import DELAYED_AMAX

    from fmtkit import TensorScaling

    loss, v, unrolled, vu, layers, (path, gemm) = _linen_case("fp8-delayed")
    # Layer i's history holds DELAYED_AMAX * (i + 1): distinct scales per layer.
    hist = jnp.stack([jnp.zeros((3, 1024)).at[:, 3].set(jnp.asarray(DELAYED_AMAX) * (i + 1))
                      for i in range(LAYERS)])
    assert v["fp8_state"]["layers/Dense_0:dot0"].shape == hist.shape
    v = {**v, "fp8_state": {**v["fp8_state"], "layers/Dense_0:dot0": hist}}
    vu = {**vu, "fp8_state": {f"layers_{i}/Dense_0:dot0": hist[i] for i in range(LAYERS)}}
    cfg = debug.DebugConfig([debug.Rule("layers", tensors=("activation", "weight", "output_grad"),
                                        stats=("saturation_share", "scale_max", "sqnr_db"))])
    _, _, _, stats = _stats(loss, v, cfg)
    got = stats[path][gemm]
    captured = _captured(unrolled, vu)
    for i, key in layers.items():
        site, tensors = captured[key]
        recipe = site.fp8
        for t, x2, fmt, row in (("activation", tensors["activation"], recipe.x_format, 0),
                                ("weight", tensors["weight"].T, recipe.w_format, 1),
                                ("output_grad", tensors["output_grad"], recipe.grad_format,
                                 2)):
            want = _np_quant(x2, fmt, TensorScaling(recipe.power_of_two, recipe.margin),
                             jnp.float32(DELAYED_AMAX[row] * (i + 1)))
            for s in ("saturation_share", "scale_max", "sqnr_db"):
                np.testing.assert_allclose(float(got[t][s][i]), want[s], rtol=RTOL,
                                           atol=SQNR_ATOL if s == "sqnr_db" else 0,
                                           err_msg=f"layer {i}: {t}/{s}")

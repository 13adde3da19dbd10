"""The precision autopilot: decisions on hand-placed threshold crossings, argument checks,
and a training run whose decisions recompile once each and survive a checkpoint bit for
bit."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fmtkit.debug as debug
from fmtkit import with_policy
from fmtkit.debug.log import StatsLogger

NAN = float("nan")


def _stats(**gemms):
    """{"": {gemm: {tensor: {stat: value}}}} from gemm=(tensor, {stat: value}) pairs."""
    return {"": {g: {t: dict(s) for t, s in ops.items()} for g, ops in gemms.items()}}


def test_decisions_on_hand_placed_crossings():
    ap = debug.Autopilot(underflow_share=0.1, sqnr_db=20.0, saturation_share=0.0,
                         patience=3, ladder=("current", "compute"))
    keys = ("a", "b", "c", "d")
    state = ap.init({"": {k: {} for k in keys}})
    ok = {"underflow_share": 0.0, "sqnr_db": 30.0, "saturation_share": 0.0,
          "nonfinite_count": 0.0}
    quiet = dict.fromkeys(ok, NAN)
    # Per step and GEMM, the statistics of the activation (weight always fine).
    a = [{"underflow_share": 0.2}, {"underflow_share": 0.2}, {"underflow_share": 0.05},
         {"underflow_share": 0.2}, {"underflow_share": 0.2}, {"underflow_share": 0.2},
         {}, {}]
    b = [{}, {"saturation_share": 0.01}, {"sqnr_db": 10.0}, {"sqnr_db": 10.0},
         {"sqnr_db": 10.0}, {}, {}, {}]
    c = [{"underflow_share": 0.2}, None, {"underflow_share": 0.2}, None,
         {"underflow_share": 0.2}, {}, {}, {}]
    d = [{}, {}, {}, {"nonfinite_count": 1.0, "underflow_share": 0.5}, {}, {}, {}, {}]
    got = []
    for step in range(8):
        ops = {}
        for k, seq in zip(keys, (a, b, c, d)):
            act = quiet if seq[step] is None else {**ok, **seq[step]}
            w = quiet if seq[step] is None else ok
            ops[k] = {"activation": act, "weight": w}
        state, dec = ap.update(state, _stats(**ops), step)
        got += dec
    # By hand: a counts 1, 2, 0, 1, 2, 3 -> moves at step 5. b saturates at step 1 (at
    # once, to "current"), then SQNR < 20 dB at steps 2, 3, 4 -> "compute" at step 4.
    # c crosses at steps 0, 2, 4 with quiet (NaN) steps between: moves at step 4.
    # d is non-finite at step 3: at once, the non-finite count before the underflow.
    expected = [
        debug.Decision(1, "", "b", "current", "activation", "saturation_share",
                       float(np.float32(0.01))),
        debug.Decision(3, "", "d", "current", "activation", "nonfinite_count", 1.0),
        debug.Decision(4, "", "b", "compute", "activation", "sqnr_db", 10.0),
        debug.Decision(4, "", "c", "current", "activation", "underflow_share",
                       float(np.float32(0.2))),
        debug.Decision(5, "", "a", "current", "activation", "underflow_share",
                       float(np.float32(0.2))),
    ]
    assert sorted(got, key=lambda x: (x.step, x.gemm)) == expected
    assert ap.decisions(state) == expected
    assert ap.settings(state) == {"/a": "current", "/b": "compute", "/c": "current",
                                  "/d": "current"}
    assert [int(state.count[f"/{k}"]) for k in keys] == [0, 0, 0, 0]
    # b is at the top of the ladder: no more decisions, whatever its statistics.
    bad = {"activation": {**ok, "nonfinite_count": 5.0}}
    state2, dec = ap.update(state, _stats(b=bad), 9)
    assert dec == [] and ap.settings(state2) == ap.settings(state)


def test_watching_only_the_weight_ignores_the_activation():
    ap = debug.Autopilot(underflow_share=0.1, patience=1, tensors=("weight",))
    state = ap.init({"m": {"dot_general_0": {}}})
    hot = {"m": {"dot_general_0": {"activation": {"underflow_share": 0.9},
                                   "weight": {"underflow_share": 0.0}}}}
    state, dec = ap.update(state, hot, 0)
    assert dec == []
    hot["m"]["dot_general_0"]["weight"]["underflow_share"] = 0.11
    state, dec = ap.update(state, hot, 1)
    assert [(d.module, d.gemm, d.tensor, d.step) for d in dec] == [
        ("m", "dot_general_0", "weight", 1)]


def test_config_names_the_moved_gemm_exactly():
    ap = debug.Autopilot(patience=1)
    state = ap.init({"Block_0/Dense_1": {"dot_general_0": {}}, "Dense_1": {
        "dot_general_0": {}}})
    assert ap.config(state) == ap.config()
    state, _ = ap.update(state, {"Dense_1": {"dot_general_0": {
        "activation": {"underflow_share": 1.0}}}}, 0)
    rules = ap.config(state).rules
    # The default ladder's first rung: fine-grained scaling.
    assert [(r.pattern, r.gemm, r.override) for r in rules] == [
        ("^Dense_1$", "^dot_general_0$", "blockwise"), ("", None, None)]
    assert hash(ap.config(state)) == hash(ap.config(state))


@pytest.mark.parametrize("kwargs, arg", [
    ({"underflow_share": float("nan")}, "underflow_share"),
    ({"underflow_share": 1.5}, "underflow_share"),
    ({"underflow_share": -0.1}, "underflow_share"),
    ({"sqnr_db": float("inf")}, "sqnr_db"),
    ({"saturation_share": 2.0}, "saturation_share"),
    ({"patience": 0}, "patience"),
    ({"patience": 1.5}, "patience"),
    ({"ladder": ("compute_dtype",)}, "ladder"),
    ({"ladder": ("fake_quant:e9m9",)}, "ladder"),
    ({"ladder": ()}, "ladder"),
    ({"ladder": ("compute", "compute")}, "ladder"),
    ({"ladder": ("blockwise", "blockwise")}, "ladder"),
    ({"ladder": ("blockwise", "fake_quant:e9m9")}, "ladder"),
    ({"tensors": ("output",)}, "tensors"),
    ({"freq": 0}, "freq"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        debug.Autopilot(**kwargs)


def test_an_unknown_ladder_setting_lists_the_allowed_ones():
    assert debug.Autopilot().ladder == ("blockwise", "compute")
    with pytest.raises(ValueError, match=r"unknown setting 'block-wise'.*'current', "
                                         r"'blockwise', 'fake_quant:<format>', 'compute'"):
        debug.Autopilot(ladder=("block-wise", "compute"))
    with pytest.raises(ValueError, match=r"ladder must be a non-empty sequence of settings "
                                         r"from \['current', 'blockwise'"):
        debug.Autopilot(ladder=())
    with pytest.raises(ValueError, match=r"ladder: unknown setting None"):
        debug.Autopilot(ladder=(None,))


def test_bad_threshold_type_and_bad_update_arguments():
    with pytest.raises(TypeError, match="underflow_share"):
        debug.Autopilot(underflow_share="0.1")
    ap = debug.Autopilot()
    state = ap.init({"": {"dot_general_0": {}}})
    with pytest.raises(TypeError, match="step"):
        ap.update(state, {}, 1.0)
    with pytest.raises(TypeError, match="state"):
        ap.update({}, {}, 1)
    with pytest.raises(TypeError, match="stats_state"):
        ap.init([1, 2])


def test_decision_is_logged_with_step_and_statistic(tmp_path):
    d = debug.Decision(7, "Block_0/Dense_1", "dot_general_0", "compute", "activation",
                       "underflow_share", 0.25)
    with StatsLogger(tmp_path, tensorboard=False) as logger:
        d.log(logger)
    (line,) = (tmp_path / "decisions.jsonl").read_text().splitlines()
    assert json.loads(line) == {"step": 7, "module": "Block_0/Dense_1",
                                "gemm": "dot_general_0", "setting": "compute",
                                "stat": "activation/underflow_share", "value": 0.25}


# -- a training run ------------------------------------------------------------------------
OUTLIER = 1e6
"""An activation channel this large puts the per-tensor E4M3 scale at 1e6 / 448, so the
other entries (|x| ~ 1) fall below half the smallest subnormal 2**-10 after scaling: most
of them underflow, as in the large-outlier regime."""


def _problem(d_in=64):
    model = with_policy(lambda w, x: jnp.tanh(jnp.tanh(x @ w["w1"]) @ w["w2"]) @ w["w3"],
                        "fp8-current")
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (32, d_in)).at[:, 0].set(OUTLIER)
    # The first GEMM's weight row that reads the outlier channel is zero (and kept there):
    # the second GEMM does not see the outlier.
    w = {"w1": (jax.random.normal(k[1], (d_in, 64)) / 8).at[0].set(0.0),
         "w2": jax.random.normal(k[2], (64, 64)) / 8,
         "w3": jax.random.normal(k[3], (64, 8)) / 8}
    y = jax.random.normal(jax.random.key(5), (32, 8))

    def loss(w):
        return jnp.mean(jnp.square(model(w, x).astype(jnp.float32) - y))

    return loss, w


def _train(ap, loss, w, state, start, stop, traces):
    @functools.partial(jax.jit, static_argnums=0)
    def step(cfg, w, stats_state, i):
        traces.append(cfg)

        def f(w, s):
            with debug.capture(cfg, s, i):
                return loss(w)

        val, (g, stats) = jax.value_and_grad(f, argnums=(0, 1))(w, stats_state)
        g = {**g, "w1": g["w1"].at[0].set(0.0)}
        return jax.tree.map(lambda p, d: p - 0.5 * d, w, g), val, stats

    return _loop(ap, loss, w, state, start, stop, step)


def _loop(ap, loss, w, state, start, stop, step):
    losses, decisions = [], []
    for i in range(start, stop):
        cfg = ap.config(state)
        stats_state = debug.init(cfg, loss, w)
        w, val, stats = step(cfg, w, stats_state, jnp.int32(i))
        losses.append(np.asarray(val))
        state, dec = ap.update(state, stats, i)
        decisions += dec
    return w, state, losses, decisions


def _save(path, tree):
    np.savez(path, *[np.asarray(x) for x in jax.tree.leaves(tree)])


def _restore(path, template):
    with np.load(path) as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


@pytest.mark.slow  # a few compiled training steps, killed and resumed
def test_training_moves_the_outlier_gemm_recompiles_once_and_resumes_bit_for_bit(tmp_path):
    loss, w0 = _problem()
    ap = debug.Autopilot(underflow_share=0.1, patience=2, ladder=("compute",))
    state0 = ap.init(debug.init(ap.config(), loss, w0))
    # The head (the last GEMM) is not quantized by fp8-current: not watched.
    assert sorted(state0.rung) == ["/dot_general_0", "/dot_general_1"]
    traces = []
    w, state, losses, decisions = _train(ap, loss, w0, state0, 0, 8, traces)
    assert [(d.step, d.gemm, d.setting, d.tensor, d.stat) for d in decisions] == [
        (1, "dot_general_0", "compute", "activation", "underflow_share")]
    assert decisions[0].value > 0.5
    assert ap.settings(state) == {"/dot_general_0": "compute"}
    # One compile for the first configuration, one for the decision; 8 steps.
    assert len(traces) == 2 and traces[0] != traces[1]
    # Running the GEMM in the compute dtype lowers the loss against staying in FP8.
    frozen = debug.Autopilot(underflow_share=1.0, patience=2, ladder=("compute",))
    _, _, fp8_losses, none = _train(frozen, loss, w0, frozen.init(debug.init(
        frozen.config(), loss, w0)), 0, 8, [])
    assert none == [] and losses[-1] < fp8_losses[-1]

    # Resume: 4 steps, checkpoint (params and autopilot state), restore, 4 more.
    w_a, st_a, l_a, d_a = _train(ap, loss, w0, state0, 0, 4, [])
    _save(tmp_path / "w.npz", w_a)
    _save(tmp_path / "ap.npz", st_a)
    w_r = _restore(tmp_path / "w.npz", w0)
    st_r = _restore(tmp_path / "ap.npz", state0)
    assert isinstance(st_r, debug.AutopilotState)
    w_b, st_b, l_b, d_b = _train(ap, loss, w_r, st_r, 4, 8, [])
    assert np.array_equal(np.stack(l_a + l_b), np.stack(losses))
    for x, y in zip(jax.tree.leaves((w_b, st_b)), jax.tree.leaves((w, state))):
        assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    assert d_a + d_b == decisions
    assert ap.decisions(st_b) == decisions
    # Negative control: resuming with a fresh autopilot state (the decision forgotten) runs
    # the moved GEMM in FP8 again, and the losses differ.
    _, _, l_lost, _ = _train(ap, loss, w_r, state0, 4, 8, [])
    assert not np.array_equal(np.stack(l_a + l_lost), np.stack(losses))


@pytest.mark.slow  # 16 training steps, three configurations compiled per run
def test_the_default_ladder_moves_a_gemm_to_finer_scaling_then_to_the_compute_dtype():
    # 256 input channels: two 1x128 tiles per row, the outlier in the first.
    loss, w0 = _problem(d_in=256)
    ap = debug.Autopilot(underflow_share=0.1, patience=2)
    state0 = ap.init(debug.init(ap.config(), loss, w0))
    traces = []
    w, state, losses, decisions = _train(ap, loss, w0, state0, 0, 6, traces)
    # Steps 0, 1 per tensor: the outlier's scale flushes almost every other entry -> finer
    # scaling. Steps 2, 3 blockwise: the tile without the outlier keeps its entries, the one
    # with it still flushes them, about half of all -> the compute dtype.
    assert [(d.step, d.gemm, d.setting, d.tensor, d.stat) for d in decisions] == [
        (1, "dot_general_0", "blockwise", "activation", "underflow_share"),
        (3, "dot_general_0", "compute", "activation", "underflow_share")]
    assert decisions[0].value > 0.9 and 0.4 < decisions[1].value < 0.6
    assert ap.settings(state) == {"/dot_general_0": "compute"}
    assert [[r.override for r in c.rules] for c in traces] == [
        [None], ["blockwise", None], ["compute", None]]
    # The second GEMM never crosses: it stays per tensor.
    assert int(state.rung["/dot_general_1"]) == 0
    # Deterministic: a second run takes the same decisions with the same values and ends
    # in the same state, bit for bit.
    w2, state2, losses2, decisions2 = _train(ap, loss, w0, state0, 0, 6, [])
    assert decisions2 == decisions
    assert np.array_equal(np.stack(losses2), np.stack(losses))
    for x, y in zip(jax.tree.leaves((w2, state2)), jax.tree.leaves((w, state))):
        assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    # Negative control: straight to the compute dtype, the losses of steps 2 and 3 differ.
    direct = debug.Autopilot(underflow_share=0.1, patience=2, ladder=("compute",))
    _, _, l_direct, _ = _train(direct, loss, w0, state0, 0, 4, [])
    assert np.array_equal(np.stack(l_direct[:2]), np.stack(losses[:2]))
    assert not np.array_equal(np.stack(l_direct[2:]), np.stack(losses[2:4]))

"""The training studies (accumulation, memory, sensitivity, router-precision, fp8-recipes) in
tiny configurations, their key numbers checked against independently derived values: a NumPy
emulation of the truncated accumulator, hand-counted bytes, float64 recomputations, ml_dtypes
roundings. Never against the study's own earlier output."""

import dataclasses
import itertools
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from studies_testlib import assert_plots

import fmtkit
from fmtkit import fp8
from studies import training
from studies.lib import stats
from studies.lm import fp8_recipes, router_precision, sensitivity
from studies.numerics import accumulation, memory_footprint
from studies.training import TrainConfig

# accumulation -------------------------------------------------------------------------------

def _numpy_limited_matmul(a, b, bits, promote_every):
    """Independent emulation: float32 products and sums in NumPy (round-to-nearest-even per
    IEEE 754), the running sum truncated toward zero to ``bits`` mantissa bits by masking its
    low 23 - bits bits, added into a float32 total every ``promote_every`` elements."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    k = a.shape[1]
    mask = np.uint32((0xFFFFFFFF << (23 - bits)) & 0xFFFFFFFF)
    total = np.zeros((a.shape[0], b.shape[0]), np.float32)
    acc = np.zeros_like(total)
    chunk = k if promote_every is None else promote_every
    for i in range(k):
        acc = np.add(acc, np.multiply.outer(a[:, i], b[:, i]), dtype=np.float32)
        acc = (acc.view(np.uint32) & mask).view(np.float32)
        if (i + 1) % chunk == 0:
            total = np.add(total, acc, dtype=np.float32)
            acc = np.zeros_like(acc)
    return total


def test_accumulation_matches_numpy_emulation_bit_for_bit(tmp_path):
    ks = (128, 1024, 4096)
    bits = 13
    cfg = accumulation.Config(m=4, n=3, ks=ks, mantissa_bits=bits, bits_sweep=(13, 23),
                              data=("positive",))
    res = accumulation.run(cfg)
    a, b = accumulation.make_operands(cfg, "positive")
    # The operands are E4M3 values (so every product is exact in f32).
    np.testing.assert_array_equal(a, a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert np.all(a >= 0) and np.all(b >= 0)
    curves = res["data"]["positive"]["curves"]
    # The library function the study runs (jitted as the study runs it).
    limited = jax.jit(fp8.limited_precision_matmul, static_argnames=("mantissa_bits",
                                                                      "promote_every"))
    for i, k in enumerate(ks):
        ref = a[:, :k].astype(np.float64) @ b[:, :k].astype(np.float64).T
        for variant, pe in (("limited", None), ("promoted", 128)):
            emu = _numpy_limited_matmul(a[:, :k], b[:, :k], bits, pe)
            got = np.asarray(limited(a[:, :k], b[:, :k], mantissa_bits=bits, promote_every=pe))
            np.testing.assert_array_equal(got.view(np.uint32), emu.view(np.uint32))
            err = emu.astype(np.float64) - ref
            # The study's numbers are those of the independent emulation (float64 error
            # arithmetic on both sides: only the summation order of the norm differs).
            assert curves[variant]["rel_error"][i] == pytest.approx(
                np.linalg.norm(err) / np.linalg.norm(ref), rel=1e-12)
            assert curves[variant]["max_rel_error"][i] == pytest.approx(
                np.max(np.abs(err) / ref), rel=1e-12)  # positive data: |A||B|^T = C
    lim, pro = curves["limited"]["rel_error"], curves["promoted"]["rel_error"]
    # Without promotion the truncation bias accumulates: the error grows with K ...
    assert all(x < y for x, y in itertools.pairwise(lim))
    # ... towards the half-ulp-per-addition estimate 2^-(m+1) K / 2 at most (module docstring).
    assert lim[-1] <= 2.0 ** -(bits + 1) * ks[-1] / 2
    # With promotion every 128 the error stays at its K = 128 level (within 2x) ...
    assert max(pro) < 2 * min(pro)
    assert lim[0] == pro[0]  # K = 128: one chunk, the same arithmetic
    # ... so at K = 4096 the unpromoted error is a large factor above it (~K/128 = 32).
    assert res["data"]["positive"]["ratio_at_max_k"] > 10
    # The f32 dot of FP8 operands is exact to f32 rounding (24 bits, K <= 4096 terms).
    assert max(curves["f32"]["rel_error"]) < 4096 * 2.0**-24
    # Wider accumulators make smaller errors; 23 bits is the f32 sum itself.
    sw = res["data"]["positive"]["bits_sweep"]
    assert sw["limited"][0] == lim[-1]  # 13 bits at K = 4096: the same computation
    assert sw["limited"][0] > sw["limited"][1]
    assert sw["limited"][1] < 1e-5
    assert_plots(accumulation.plot(res, tmp_path))


def test_accumulation_gaussian_promotion_helps():
    # The same shapes as above (m=4, n=3, K in ks): jit's cache, no new compiles.
    res = accumulation.run(accumulation.Config(m=4, n=3, ks=(128, 4096), bits_sweep=(13, 23),
                                               data=("gaussian",)))
    rec = res["data"]["gaussian"]
    lim = rec["curves"]["limited"]["rel_error"]
    assert lim[1] > 4 * lim[0]
    assert rec["ratio_at_max_k"] > 4


def test_accumulation_config_validation():
    with pytest.raises(ValueError, match="multiples of promote_every"):
        accumulation.Config(ks=(100,))
    with pytest.raises(ValueError, match=r"in \[1, 23\]"):
        accumulation.Config(mantissa_bits=24)
    with pytest.raises(ValueError, match="data must be"):
        accumulation.Config(data=("uniform",))
    with pytest.raises(ValueError, match="8-bit"):
        accumulation.Config(fmt="bf16")


# memory -------------------------------------------------------------------------------------

def _transformer_params(cfg):
    """Parameter count of studies.lib.models.TransformerLM, by hand from Flax's layer definitions:
    Embed (vocab x d), learned positions (max_len x d); per block RMSNorm scales (d each),
    four attention DenseGeneral projections with bias (d x d + d), MLP Dense kernels and
    biases; final LayerNorm (scale and bias); head Dense (d x vocab + vocab)."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    block = d + 4 * (d * d + d) + d + (d * f + f) + (f * d + d)
    return v * d + cfg.max_len * d + cfg.num_layers * block + 2 * d + (d * v + v)


MEMORY_CFG = memory_footprint.Config(d_model=32, num_heads=2, d_ff=64, num_layers=2, batch=2,
                                     seq_len=16, layers=(1, 2), policies=("fp32",),
                                     remat=("none", "full"), compile="deepest")


def test_memory_state_bytes_against_hand_counts(tmp_path):
    res = memory_footprint.run(MEMORY_CFG)
    n = _transformer_params(MEMORY_CFG.model_config())
    leaves = 2 + 2 * 14 + 2 + 2  # embeds, 2 blocks x 14 arrays, ln_f scale+bias, head
    rows = {r["row"]: r for r in res["state"]}
    # (params, grads, master, optimizer state) bytes: ZeRO's accounting (section 3.1) with
    # each dtype's width (f32 4, bf16 2, fp16 2, e4m3 1).
    expected = {
        "fp32-adamw": (4, 4, 0, 4 + 4),
        "bf16-mixed-adamw": (4, 4, 0, 4 + 4),  # f32 params: the cotangents are f32 too
        "fp8-delayed-adamw": (4, 4, 0, 4 + 4),
        "pure-bf16-adamw": (2, 2, 0, 2 + 2),  # moments in the parameters' dtype
        "bf16-master-adamw": (2, 2, 4, 4 + 4),  # inner AdamW runs on the f32 masters
        "bf16-master-adamw-bf16m": (2, 2, 4, 2 + 2),
        "bf16-kahan-adamw": (2, 2, 0, 2 + 2 + 2),  # + a bf16 compensation buffer
        "bf16-sr-adamw": (2, 2, 0, 2 + 2),
        "fp32-sgdm": (4, 4, 0, 4),
    }
    for name, (p, g, m, o) in expected.items():
        r = rows[name]
        assert r["num_params"] == n
        assert (r["param_bytes"], r["grad_bytes"], r["master_bytes"], r["opt_state_bytes"]) \
            == (p * n, g * n, m * n, o * n), name
    assert rows["fp32-adamw"]["bytes_per_param"]["total"] == 16
    assert rows["bf16-master-adamw"]["bytes_per_param"]["total"] == 16
    assert rows["bf16-master-adamw-bf16m"]["bytes_per_param"]["total"] == 12
    # MS-AMP O2 moments: e4m3 m (1 byte) + fp16 v (2 bytes) + one f32 scale per tensor each.
    r = rows["bf16-master-adamw-fp8m"]
    assert r["opt_state_bytes"] == 3 * n + 2 * 4 * leaves
    assert rows["pure-bf16-adamw"]["grad_dtypes"] == ["bfloat16"]
    assert rows["bf16-mixed-adamw"]["grad_dtypes"] == ["float32"]

    # Activations. Full remat keeps only each block's input: B*T*d f32 values per layer
    # (Korthikanti et al. 2022: 2sbh bytes in 16-bit; here 4 bytes per value).
    btd = MEMORY_CFG.batch * MEMORY_CFG.seq_len * MEMORY_CFG.d_model
    acts = {a["remat"]: a for a in res["activations"]}
    assert acts["full"]["per_layer"]["saved_bytes"] == pytest.approx(4 * btd)
    assert acts["none"]["per_layer"]["saved_bytes"] > 10 * 4 * btd
    # XLA's compiled peak temp memory at L=2: full remat needs less than no remat.
    none_t = acts["none"]["points"][-1]["temp_bytes"]
    full_t = acts["full"]["points"][-1]["temp_bytes"]
    assert full_t < none_t
    assert acts["full"]["points"][-1]["argument_bytes"] == acts["none"]["points"][-1][
        "argument_bytes"]
    assert_plots(memory_footprint.plot(res, tmp_path))


def test_memory_bf16_activations_halve_the_saved_input():
    res = memory_footprint.run(dataclasses.replace(
        MEMORY_CFG, policies=("bf16-mixed",), compile="none", state_rows=("fp32-adamw",),
        remat=("full", "dots", "dots_no_batch")))
    btd = MEMORY_CFG.batch * MEMORY_CFG.seq_len * MEMORY_CFG.d_model
    acts = {a["remat"]: a["per_layer"]["saved_bytes"] for a in res["activations"]}
    # Under bf16-mixed the residual stream between blocks is bf16: 2 bytes per value.
    assert acts["full"] == pytest.approx(2 * btd)
    # Selective policies keep more than the input; keeping only batch-free dots keeps less
    # than keeping every dot (attention's QK^T and PV are batched dots).
    assert acts["full"] < acts["dots_no_batch"] < acts["dots"]


def test_memory_config_validation():
    with pytest.raises(ValueError, match="two distinct"):
        memory_footprint.Config(layers=(2, 2))
    with pytest.raises(ValueError, match="unknown variant"):
        memory_footprint.Config(remat=("some",))
    with pytest.raises(ValueError, match="unknown preset"):
        memory_footprint.Config(policies=("fp7",))


# sensitivity --------------------------------------------------------------------------------

SENS_MODULES = r"^(Block_0/MlpBlock_0/Dense_1|Block_0/ln_2|Block_0/attn)$"
# One block; batch * seq_len = 128 tokens: one 1x128 block per column for blockwise.
SENS_CFG = sensitivity.Config(pretrain=False, modules=SENS_MODULES,
                              train=TrainConfig(num_layers=1, batch=2, seq_len=64))


def _sqnr64(ref, y):
    """SQNR in dB computed in float64 NumPy over all leaves (independent of telemetry)."""
    r = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(ref)])
    o = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(y)])
    noise = np.sum((o - r) ** 2)
    return math.inf if noise == 0 else 10 * math.log10(np.sum(r**2) / noise)


def test_sensitivity_fp8_rows_match_float64_recomputation(tmp_path):
    res = sensitivity.run(SENS_CFG)
    rows = {r["path"]: r for r in res["rows"]}
    assert set(rows) == {"Block_0/MlpBlock_0/Dense_1", "Block_0/ln_2", "Block_0/attn"}
    assert rows["Block_0/MlpBlock_0/Dense_1"]["applied"] == "fp8 blockwise"
    assert rows["Block_0/ln_2"]["applied"].startswith("bf16")
    # Ranked by gradient SQNR, most sensitive (lowest) first.
    sq = [r["grad_sqnr_db"] for r in res["rows"]]
    assert sq == sorted(sq)
    mcfg, params, tokens = sensitivity.prepare(SENS_CFG)
    assert res["execution"] == "jit"  # "auto" with 3 modules
    ref = sensitivity.evaluate(mcfg, params, tokens, None, "fp32")
    assert res["reference_loss"] == float(ref["loss"])
    for path in ("Block_0/MlpBlock_0/Dense_1", "Block_0/ln_2"):
        out = sensitivity.evaluate(mcfg, params, tokens, path, SENS_CFG.target)
        r = rows[path]
        # The study sums in f32 in-jit; float64 here: agree to well under 0.01 dB.
        assert r["output_sqnr_db"] == pytest.approx(_sqnr64(ref["logits"], out["logits"]),
                                                    abs=1e-2)
        assert r["grad_sqnr_db"] == pytest.approx(_sqnr64(ref["grads"], out["grads"]),
                                                  abs=1e-2)
        assert r["loss_delta"] == float(out["loss"]) - float(ref["loss"])
    # An FP8 matmul (E4M3: 3 mantissa bits, unit roundoff 2^-4) perturbs more than a bf16
    # norm (8 bits, 2^-8): 20 log10(2^4) = 24 dB of difference in quantization noise.
    assert (rows["Block_0/MlpBlock_0/Dense_1"]["output_sqnr_db"]
            < rows["Block_0/ln_2"]["output_sqnr_db"] - 6)
    # Plausible FP8 levels (torchao's blockwise bar: linear outputs >= 25 dB).
    assert 15 < rows["Block_0/MlpBlock_0/Dense_1"]["output_sqnr_db"] < 60
    assert_plots(sensitivity.plot(res, tmp_path))


def test_sensitivity_fp32_target_changes_nothing():
    # Op by op this time (the other execution path): the reference and every variant alike.
    res = sensitivity.run(dataclasses.replace(SENS_CFG, target="fp32", execution="eager",
                                              modules=r"^Block_0/(MlpBlock_0/Dense_1|ln_2)$"))
    assert res["execution"] == "eager"
    assert len(res["rows"]) == 2
    for r in res["rows"]:
        assert r["loss_delta"] == 0.0
        assert math.isinf(r["output_sqnr_db"]) and math.isinf(r["grad_sqnr_db"])


def test_sensitivity_config_validation():
    with pytest.raises(ValueError, match="target must be one of"):
        sensitivity.Config(target="fp8-nope")
    with pytest.raises(ValueError, match="valid regex"):
        sensitivity.Config(modules="(")
    with pytest.raises(ValueError, match="matches no module"):
        sensitivity.run(dataclasses.replace(SENS_CFG, modules="^nothing$"))


# router-precision ---------------------------------------------------------------------------

def _near_tie_case():
    """A bare top-1 MoE layer whose router kernel has near-ties, and one-hot tokens that pick
    a kernel row each. Row 0: 1 vs 1 + 2^-10 (bf16's spacing at 1 is 2^-7: both round to 1,
    a tie). Row 1: a clear winner. Row 2: 3 vs 3 + 2^-6 (representable in bf16: no tie).
    Row 3: 1 - 2^-9 vs 1 (halfway between bf16 neighbours 1 - 2^-8 and 1: ties to even, 1)."""
    w = np.array([[1.0, 1.0 + 2.0**-10, 0.5, 0.25],
                  [0.1, 0.2, 2.0, 0.3],
                  [3.0, 3.0 + 2.0**-6, 0.0, 0.0],
                  [-1.0, 1.0 - 2.0**-9, 1.0, 0.0]], np.float32)
    rows = np.array([0, 1, 2, 3, 0, 1, 0, 3, 2, 2, 1, 0])
    x = np.eye(4, dtype=np.float32)[rows][None]  # [1, 12, 4]: exact in bf16
    return w, rows, x


@pytest.mark.parametrize("router", ["f32", "bf16"])
def test_router_flips_on_constructed_near_ties(router):
    from studies.lib.models import MoeBlock

    w, rows, x = _near_tie_case()
    model = fmtkit.with_policy(MoeBlock(num_experts=4, d_ff=8),
                               router_precision.router_rules(router_precision.ROUTERS[router]))
    variables = model.init(jax.random.key(0), x)
    params = dict(variables["params"])
    params["router"] = {"kernel": jax.numpy.asarray(w)}
    _, routers = router_precision.route_with_shadow(model, {"params": params}, x)
    (r,) = routers
    assert r["path"] == "router"
    index, shadow = np.asarray(r["index"])[0], np.asarray(r["shadow"])[0]
    # Independent derivation: the logits of a one-hot token are its kernel row; in float64 for
    # f32 (the values are exact), rounded by ml_dtypes for bf16; NumPy's argmax takes the first
    # of equal maxima, as jnp.argmax does. (The other gaps are far above bf16's softmax
    # rounding, so the softmax keeps each argmax.)
    f32_choice = np.argmax(w.astype(np.float64), axis=1)[rows]
    bf16_choice = np.argmax(w.astype(ml_dtypes.bfloat16).astype(np.float64), axis=1)[rows]
    np.testing.assert_array_equal(shadow, f32_choice)
    if router == "f32":
        assert r["logits_dtype"] == "float32"
        np.testing.assert_array_equal(index, shadow)  # flip fraction exactly 0
    else:
        assert r["logits_dtype"] == "bfloat16"
        np.testing.assert_array_equal(index, bf16_choice)
        flips = float(np.mean(index != shadow))
        assert flips == float(np.mean(bf16_choice != f32_choice)) == 6 / 12  # rows 0 and 3


def test_the_shadow_reads_the_input_the_f32_router_reads():
    """In the LM the router's input is the f32 norm's output as the bf16 MoE block sees it
    (cast to bf16 on leaving the norm); the sown input is that value, so the f32 shadow
    recomputes the f32 router's logits (float64 here) to f32 rounding, and flips are 0."""
    cfg = router_precision.Config(d_model=32, d_ff=32, train=TrainConfig(
        num_layers=1, batch=4, seq_len=32))
    tcfg = cfg.train_config()
    setup = training.Setup("router-f32", router_precision.router_rules("p=f32,c=f32"),
                        grad_format="bfloat16", description="")
    model = training.build_model(setup, tcfg)
    tokens = jax.random.randint(jax.random.key(0), (4, 32), 0, 256)
    variables = model.init(jax.random.key(1), tokens)
    _, state = model.apply(variables, tokens, mutable=["intermediates"])
    node = state["intermediates"]["Block_0"]["MoeBlock_0"]
    x = np.asarray(node["router_input"][0])
    assert x.dtype == ml_dtypes.bfloat16
    kernel = np.asarray(variables["params"]["Block_0"]["MoeBlock_0"]["router"]["kernel"])
    want = x.astype(np.float64) @ kernel.astype(np.float64)
    np.testing.assert_allclose(np.asarray(node["router_logits"][0], np.float64), want,
                               rtol=1e-5, atol=1e-6)
    _, routers = router_precision.route_with_shadow(model, variables, tokens)
    np.testing.assert_array_equal(routers[0]["index"], routers[0]["shadow"])


RP_TRAIN = TrainConfig(steps=3, warmup=0, num_layers=1, batch=2, seq_len=16, seeds=2)
RP_CFG = router_precision.Config(d_model=32, d_ff=32, num_experts=4, train=RP_TRAIN)


def _check_gaps(cell):
    """The cell's gaps are stats.compare of the per-seed numbers (bf16 - f32, paired), and
    "hurts" lists exactly the significant positive loss / max-load / aux-loss gaps."""
    f32, bf16 = cell["variants"]["f32"], cell["variants"]["bf16"]
    hurts = []
    for key, label in router_precision.GAP_METRICS.items():
        ref = [p[key] for p in f32["per_seed"]]
        cand = [p[key] for p in bf16["per_seed"]]
        g = stats.compare(ref, cand, paired=True)
        d = cell["gaps"][key]
        assert d["reference"]["values"] == ref and d["candidate"]["values"] == cand
        assert d["paired"] and d["threshold"] == stats.THRESHOLD
        assert d["gap"] == pytest.approx(g.gap) and d["se"] == pytest.approx(g.se)
        assert d["significant"] == g.significant == (abs(g.gap) > 3 * g.se)
        if key in router_precision.HARM_METRICS and g.significant and g.gap > 0:
            hurts.append(label)
    assert cell["hurts"] == hurts


@pytest.mark.slow  # tens of seconds: trains or launches processes (make test-all runs it)
def test_router_precision_training_run(tmp_path):
    res = router_precision.run(RP_CFG)
    assert not res["grid"] and res["seeds"] == [0, 1]
    (cell,) = res["cells"]
    for name in ("f32", "bf16"):
        v = cell["variants"][name]
        assert [p["seed"] for p in v["per_seed"]] == [0, 1]
        for p in v["per_seed"]:
            assert len(p["loss"]) == 3 and all(math.isfinite(x) for x in p["loss"])
            # Fractions of tokens per expert sum to one per layer.
            assert np.allclose(np.sum(p["final_fractions"], axis=1), 1.0)
            assert all(1.0 <= m <= 4.0 for m in p["max_load"])
            assert p["final_loss"] == pytest.approx(p["loss"][-1])  # last 10% of 3 steps
        # Each seed's numbers are kept, and the seeds are different runs.
        assert v["final_loss"] == [p["final_loss"] for p in v["per_seed"]]
        assert v["per_seed"][0]["loss"] != v["per_seed"][1]["loss"]
        # The f32 router computes the shadow's arithmetic: no flips, any seed, any step.
        if name == "f32":
            for p in v["per_seed"]:
                assert p["flip_frac"] == [0.0, 0.0, 0.0]
    _check_gaps(cell)
    text = router_precision.summarize(res)
    assert "bf16 router measurably hurts: " + (", ".join(cell["hurts"]) or "none") in text
    assert_plots(router_precision.plot(res, tmp_path))

    # Reproducible, and seed 1 of the vmapped pair is seed 1 trained alone: the same
    # parameters and batch give the step-0 loss to bf16 rounding of the activations under
    # another reduction order (batched kernels, studies.training.multiseed); after two
    # bf16-mixed updates it is within multiseed's 2e-3 relative, far below the gap between
    # seeds 0 and 1.
    alone = router_precision.run(dataclasses.replace(
        RP_CFG, routers=("f32",), train=dataclasses.replace(RP_TRAIN, seed=1, seeds=1)))
    (p1,) = alone["cells"][0]["variants"]["f32"]["per_seed"]
    p_pair = cell["variants"]["f32"]["per_seed"][1]
    assert p1["seed"] == 1
    assert p1["loss"][0] == pytest.approx(p_pair["loss"][0], rel=1e-4)
    np.testing.assert_allclose(p1["loss"], p_pair["loss"], rtol=2e-3)
    seed0 = cell["variants"]["f32"]["per_seed"][0]["loss"]
    assert abs(seed0[0] - p1["loss"][0]) > 100 * abs(p1["loss"][0] - p_pair["loss"][0])
    assert p1["flip_frac"] == [0.0, 0.0, 0.0]


@pytest.mark.slow  # tens of seconds: trains or launches processes (make test-all runs it)
def test_router_precision_grid_has_one_row_per_cell(tmp_path):
    cfg = dataclasses.replace(RP_CFG, grid=True, grid_lr=(3e-3, 1e-2), grid_experts=(4,),
                              grid_steps=(2,))
    res = router_precision.run(cfg)
    assert res["grid"]
    assert [(c["lr"], c["num_experts"], c["steps"]) for c in res["cells"]] == [
        (3e-3, 4, 2), (1e-2, 4, 2)]
    for c in res["cells"]:
        for v in c["variants"].values():
            assert all(len(p["loss"]) == 2 for p in v["per_seed"])
        assert all(p["flip_frac"] == [0.0, 0.0] for p in c["variants"]["f32"]["per_seed"])
        _check_gaps(c)
    text = router_precision.summarize(res)
    rows = [line for line in text.splitlines() if line.startswith(("0.003 ", "0.01 "))]
    assert len(rows) == 2
    bad = [c for c in res["cells"] if c["hurts"]]
    line = next(x for x in text.splitlines() if x.startswith("cells where the bf16 router"))
    assert line.endswith("none") == (not bad)
    for c in bad:
        assert f"lr {c['lr']:g}, {c['num_experts']} experts" in line
    assert_plots(router_precision.plot(res, tmp_path))


def test_router_precision_config_validation():
    with pytest.raises(ValueError, match="routers must be"):
        router_precision.Config(routers=("fp16",))
    with pytest.raises(ValueError, match="num_experts must be >= 2"):
        router_precision.Config(num_experts=1)
    with pytest.raises(ValueError, match="multiple of the 4 attention heads"):
        router_precision.Config(d_model=30)
    with pytest.raises(ValueError, match="grid_experts must be a non-empty tuple of distinct "
                                         "ints >= 2"):
        router_precision.Config(grid_experts=(1, 4))
    with pytest.raises(ValueError, match="grid_lr must be"):
        router_precision.Config(grid_lr=())
    with pytest.raises(ValueError, match="grid_steps must be"):
        router_precision.Config(grid_steps=(150, 150))
    assert len(router_precision.Config(grid=True).cells()) == 8
    assert router_precision.Config().cells() == [router_precision.Config()]


def test_router_precision_cli_seeds_and_grid():
    from studies.app import runner

    inv = runner.parse_args("router-precision", ["--seeds", "2", "--grid", "--grid-lr",
                                                 "1e-3", "2e-3", "--grid-steps", "5"])
    c = inv.config
    assert c.train.seeds == 2 and c.grid and c.grid_lr == (1e-3, 2e-3)
    assert [(x.train.lr, x.num_experts, x.train.steps) for x in c.cells()] == [
        (1e-3, 4, 5), (1e-3, 8, 5), (2e-3, 4, 5), (2e-3, 8, 5)]
    assert runner.parse_args("fp8-recipes", ["--seeds", "4"]).config.train.seeds == 4


# fp8-recipes --------------------------------------------------------------------------------

# One block (d_model 128, d_ff 256) and 2 x 64 = 128 tokens per step: every recipe tiles.
# Blockwise and blockwise with 128x128 gradient blocks (each setup costs a compile of its
# train step, ~5 s here; the other recipes are covered by the default run, which trains
# every one, and by fmtkit's FP8 tests).
FP8_CFG = fp8_recipes.Config(recipes=("blockwise", "blockwise-g128"),
                             train=TrainConfig(steps=2, warmup=0, num_layers=1, batch=2,
                                               seq_len=64, seeds=2))


@pytest.mark.slow  # tens of seconds: trains or launches processes (make test-all runs it)
def test_fp8_recipes_losses_close_to_bf16(tmp_path):
    res = fp8_recipes.run(FP8_CFG)
    assert set(res["recipes"]) == {"blockwise", "blockwise-g128"}
    assert res["seeds"] == [0, 1]
    base = res["baseline"]
    assert [p["seed"] for p in base["per_seed"]] == [0, 1]
    for p in base["per_seed"]:
        assert all(math.isfinite(x) for x in p["history"]["loss"])
        # A byte-level model that knows nothing is at >= ln(256) = 5.55 nats per byte.
        assert p["history"]["loss"][0] > math.log(256)
    # The seeds are different runs (own parameters and batches).
    assert base["per_seed"][0]["history"]["loss"] != base["per_seed"][1]["history"]["loss"]
    for name, r in res["recipes"].items():
        assert len(r["per_seed"]) == 2 and len(r["final_loss"]) == 2
        for b, c in zip(base["final_loss"], r["final_loss"]):
            # Tolerance: E4M3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per
            # value, ~2-3% rms after block scaling, seed 000), but the loss averages the
            # per-token cross-entropies of 128 tokens whose logits move by that noise times
            # small weights: the sensitivity study measures ~30 dB logits SQNR per FP8 layer,
            # i.e. ~3% rms logit noise, which changes a near-uniform cross-entropy by well
            # under 1%. 2% also covers the one AdamW update made with FP8 gradients; a wrong
            # scale or a dropped block moves the loss by far more.
            assert abs(c - b) / b < 0.02, (name, b, c)
        # The gap is stats.compare of the per-seed final losses, paired.
        g = stats.compare(base["final_loss"], r["final_loss"], paired=True)
        assert r["gap"]["candidate"]["values"] == r["final_loss"]
        assert r["gap"]["reference"]["values"] == base["final_loss"]
        assert r["gap"]["gap"] == pytest.approx(g.gap) and r["gap"]["se"] == pytest.approx(g.se)
        assert r["gap"]["paired"] and r["gap"]["significant"] == g.significant
        assert r["gap"]["relative"] == pytest.approx(
            (np.mean(r["final_loss"]) - np.mean(base["final_loss"]))
            / np.mean(base["final_loss"]))
    assert res["recipes"]["blockwise-g128"]["tiles"]["grad"] == "128x128"
    g128 = stats.compare(res["recipes"]["blockwise"]["final_loss"],
                         res["recipes"]["blockwise-g128"]["final_loss"], paired=True)
    assert res["g128_vs_blockwise"]["gap"] == pytest.approx(g128.gap)
    assert res["g128_vs_blockwise"]["significant"] == g128.significant
    text = fp8_recipes.summarize(res)
    assert fp8_recipes.g128_verdict(g128) in text
    assert ("DeepSeek-V3's sign (128x128 worse) is not reproduced" in text) == (g128.gap <= 0)
    assert_plots(fp8_recipes.plot(res, tmp_path))


def test_fp8_recipe_g128_changes_only_the_gradients():
    from studies.lib.models import Mlp

    # The two setups' rules on a three-layer MLP, 2 x 64 tokens: Dense_0 and Dense_1 in FP8,
    # Dense_2 produces the output (the head, found by its role) and stays in bf16.
    kx, kt = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (2, 64, 128), jax.numpy.float32)
    target = jax.random.normal(kt, (2, 64, 128), jax.numpy.float32)
    params = Mlp((256, 128, 128)).init(jax.random.key(1), x)["params"]
    out = {}
    for name in ("blockwise", "blockwise-g128"):
        model = fmtkit.with_policy(Mlp((256, 128, 128)), fp8_recipes.setup_of(name).rules())

        def loss_fn(p, model=model):
            y = model.apply({"params": p}, x).astype(jax.numpy.float32)
            return jax.numpy.mean(jax.numpy.square(y - target))

        out[name] = jax.jit(jax.value_and_grad(loss_fn))(params)
    (l1, g1), (l2, g2) = out["blockwise"], out["blockwise-g128"]
    # Same forward pass (x 1x128, w 128x128 in both): bit-identical loss.
    assert float(l1) == float(l2)
    # The output gradient is quantized in 128x128 blocks instead of 1x128: the weight
    # gradients of both layers change (Dense_0's through Dense_1's data gradient) ...
    np.testing.assert_array_equal(np.asarray(g1["Dense_2"]["kernel"]),
                                  np.asarray(g2["Dense_2"]["kernel"]))  # the bf16 head
    for layer in ("Dense_0", "Dense_1"):
        a = np.asarray(g1[layer]["kernel"], np.float64)
        b = np.asarray(g2[layer]["kernel"], np.float64)
        assert not np.array_equal(a, b), layer
        # ... by FP8-sized amounts (E4M3 unit roundoff 2^-4), not arbitrary ones.
        assert 1e-4 < np.linalg.norm(b - a) / np.linalg.norm(a) < 0.3, layer


def test_fp8_recipes_config_validation():
    with pytest.raises(ValueError, match="unknown recipe"):
        fp8_recipes.Config(recipes=("blockwise", "nope"))
    with pytest.raises(TypeError, match=r"train must be a studies\.training\.TrainConfig"):
        fp8_recipes.Config(train={"steps": 2})

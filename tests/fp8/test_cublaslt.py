"""The per-tensor FP8 GEMMs on a GPU take the form XLA's GPU GEMM rewriter turns into
cuBLASLt's FP8 GEMM (``__cublas$lt$matmul$f8``).

What the rewriter requires, read in openxla/xla ``xla/service/gpu/transforms/gemm_rewriter.cc``
(``MatchFp8Param``, ``CreateF8CustomCall``, ``F8ScaleD``) and its tests
(``gemm_rewriter_fp8_test.cc``): each dot operand an FP8 array (E4M3FN or E5M2, never both
E5M2: cuBLASLt lacks that GEMM and the rewriter makes it an f16 dot), reached from the dot
directly or through a dequantization ``convert`` (and a multiply by a broadcast scalar) with
only layout ops between; one contracting and one free dimension per operand; an f32, bf16,
f16 or FP8 output; a multiply of the dot's output by a broadcast f32 scalar, its only user, is
folded into the call's scale operand (``F8ScaleD``; a [1, 1] array is not a scalar there).

No GPU is needed: the step is lowered for CUDA (``lowering_platforms=("cuda",)``) under an
abstract H200 mesh, and the StableHLO XLA would compile is read. Whether XLA then rewrote it
is a GPU fact: the GPU check records the compiled HLO's custom-call targets
(``tools.gpu_check``, the ``fp8-per-tensor`` item).
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_utils import dot_operand_dtypes

from fmtkit import fp8
from fmtkit._lowp import gemm
from fmtkit._switches import flipped

DN = (((1,), (0,)), ((), ()))
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
_FP8 = ("f8E4M3FN", "f8E5M2")


def _step(recipe):
    """y, dx, dw of ``x [M, K] · w [K, N]`` under ``recipe`` (a delayed one with a fresh
    state), as a function of bf16 x, w and the cotangent."""
    dg = fp8.dot_general_fn(recipe)
    kw = {"fp8_state": fp8.init_state(dg.recipe)} if dg.recipe.delayed else {}

    def f(x, w, g):
        y, vjp = jax.vjp(lambda a, b: dg(a, b, DN, **kw), x, w)
        return (y, *vjp(g))

    return f


def _lowered_for_h200(fn, *args) -> str:
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


_DEF = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = (.*)$")


def fp8_gemms(text: str) -> list[dict]:
    """Every ``dot_general`` of FP8 operands in a StableHLO module, with what the rewriter's
    patterns look at: operand and output types, contracting dims, and whether its only user
    multiplies it by a broadcast f32 scalar (``scalar_scale_user``)."""
    found = []
    for body in text.split("func.func")[1:]:  # SSA names are per function
        defs = {}
        lines = body.splitlines()
        for line in lines:
            m = _DEF.match(line)
            if m:
                defs[m.group(1)] = m.group(2)
        for name, rhs in defs.items():
            if not rhs.startswith("stablehlo.dot_general"):
                continue
            sig = re.search(r": \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>", rhs)
            lhs_t, rhs_t, out_t = (s.split("x")[-1] for s in sig.groups())
            if lhs_t not in _FP8 and rhs_t not in _FP8:
                continue
            dims = re.search(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", rhs)
            users = [(n, r) for n, r in defs.items()
                     if re.search(rf"{re.escape(name)}\b(?!:)", r) and n != name]
            scalar_user = False
            if len(users) == 1 and users[0][1].startswith("stablehlo.multiply"):
                other = [o for o in re.findall(r"(%[\w#]+)", users[0][1].split(":")[0])
                         if o != name]
                src = defs.get(other[0], "") if other else ""
                scalar_user = bool(re.match(
                    r"stablehlo\.broadcast_in_dim %[\w#]+, dims = \[\] : \(tensor<f32>\)", src))
            found.append({"lhs": lhs_t, "rhs": rhs_t, "out": out_t,
                          "contracting": (dims.group(1), dims.group(2)),
                          "users": len(users), "scalar_scale_user": scalar_user})
    return found


def rewriter_form_violations(gemms: list[dict]) -> list[str]:
    """What in these FP8 dots keeps XLA's rewriter from one cuBLASLt FP8 call each (empty:
    none)."""
    bad = []
    for i, g in enumerate(gemms):
        if g["lhs"] not in _FP8 or g["rhs"] not in _FP8:
            bad.append(f"dot {i}: an operand is not FP8 ({g['lhs']} x {g['rhs']})")
        if g["lhs"] == g["rhs"] == "f8E5M2":
            bad.append(f"dot {i}: E5M2 x E5M2 (cuBLASLt has no such GEMM)")
        if g["out"] not in ("f32", "bf16", "f16"):
            bad.append(f"dot {i}: output {g['out']}")
        if any("," in d for d in g["contracting"]):
            bad.append(f"dot {i}: more than one contracting dim")
        if not g["scalar_scale_user"]:
            bad.append(f"dot {i}: its scale is not one multiply by a broadcast f32 scalar")
    return bad


_ARGS = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 512), (512, 384),
                                                               (256, 384)))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_per_tensor_gemms_lowered_for_cuda_have_the_rewriters_form(recipe):
    text = _lowered_for_h200(_step(recipe), *_ARGS)
    gemms = fp8_gemms(text)
    # The backward GEMMs read the forward's FP8 values (x, w) and the dgrad's (g) through
    # their dimension numbers: no transpose in the program (XLA lays FP8 operands out
    # contraction-minor for cuBLASLt on Hopper, one byte per element; Blackwell reads both).
    assert not re.search(r"stablehlo\.transpose .*xf8E", text)
    assert len(gemms) == 3  # forward, dgrad, wgrad
    assert rewriter_form_violations(gemms) == []
    # E4M3 forward, E5M2 gradients against E4M3 operands in dgrad and wgrad
    assert sorted((g["lhs"], g["rhs"]) for g in gemms) == sorted(
        [("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")])


def test_the_form_check_fails_on_the_previous_form():
    """Negative control: the form this replaces (two multiplies by [1, 1] scale arrays after
    the dot) is caught, and so is a dequantize-then-dot in bf16 (FP8 widened before the dot,
    as off GPUs)."""
    with flipped(cublaslt_form=False):
        gemms = fp8_gemms(_lowered_for_h200(_step("current"), *_ARGS))
    assert len(gemms) == 3
    assert any("scale" in v for v in rewriter_form_violations(gemms))

    def widened(a, b):  # FP8 converted to bf16 before the dot: not an FP8 dot at all
        return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)

    f8 = jax.ShapeDtypeStruct((64, 64), jnp.float8_e4m3fn)
    assert fp8_gemms(_lowered_for_h200(widened, f8, f8)) == []
    e5 = jax.ShapeDtypeStruct((64, 64), jnp.float8_e5m2)
    both_e5m2 = fp8_gemms(_lowered_for_h200(
        lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32) * jnp.float32(2), e5, e5))
    assert rewriter_form_violations(both_e5m2) == ["dot 0: E5M2 x E5M2 (cuBLASLt has no such "
                                                   "GEMM)"]


def _qdq(t, dtype, fmax):
    """float64 of a per-tensor quantization as documented: scale = amax * f32(1 / max)."""
    t = np.asarray(t, np.float32)
    scale = np.float32(np.abs(t).max()) * np.float32(1.0 / fmax)
    inv = np.float32(1.0) / scale
    vals = np.clip(t * inv, -fmax, fmax).astype(dtype)
    return vals.astype(np.float64) * np.float64(scale)


@pytest.mark.slow  # a few seconds: three GEMMs compiled on CPU
def test_gpu_form_computes_the_same_gemms(monkeypatch):
    """The GPU form, run on CPU (the trace told it runs on a GPU, so FP8 operands go into
    the dot and the scales multiply its output): y, dx, dw equal float64 products of the
    recipe's quantized operands (E4M3 x and w, E5M2 gradient) up to f32 summation."""
    monkeypatch.setattr(gemm, "on_gpu", lambda: True)
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k1, (96, 160), jnp.float32)
    w = jax.random.normal(k2, (160, 48), jnp.float32) / np.sqrt(160)
    g = jax.random.normal(k3, (96, 48), jnp.float32)
    entered = dot_operand_dtypes(jax.make_jaxpr(_step("current"))(x, w, g), entered=True)
    assert len(entered) == 3 and all(  # FP8 into the dots
        jnp.finfo(d).bits == 8 for pair in entered for d in pair), entered
    y, dx, dw = jax.jit(_step("current"))(x, w, g)
    e4, e5 = (ml_dtypes.float8_e4m3fn, 448.0), (ml_dtypes.float8_e5m2, 57344.0)
    xq, wq, gq = _qdq(x, *e4), _qdq(w, *e4), _qdq(g, *e5)
    # f32 sums of at most 160 exact products, each <= the largest |output| in magnitude
    for got, ref in ((y, xq @ wq), (dx, gq @ wq.T), (dw, xq.T @ gq)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0,
                                   atol=2e-5 * np.abs(ref).max())


def _on_hopper() -> bool:
    dev = jax.devices()[0]
    return jax.default_backend() == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper (sm_90) GPU")
def test_compiled_per_tensor_step_runs_cublaslt_fp8_gemms():
    """On a Hopper GPU: XLA compiled the three GEMMs of the current recipe into cuBLASLt's
    FP8 GEMM, and they compute the products of the quantized operands (Hopper's FP8 tensor
    cores accumulate with fewer bits than f32 (DeepSeek-V3 §3.3.2: about 14): 1e-2 of the
    largest output)."""
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k1, (512, 1024), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (1024, 768), jnp.float32) / 32).astype(jnp.bfloat16)
    g = jax.random.normal(k3, (512, 768), jnp.float32).astype(jnp.bfloat16)
    step = jax.jit(_step("current"))
    hlo = step.lower(x, w, g).compile().as_text()
    assert hlo.count('custom_call_target="__cublas$lt$matmul$f8"') == 3, re.findall(
        r'custom_call_target="([^"]+)"', hlo)
    y, dx, dw = step(x, w, g)
    e4, e5 = (ml_dtypes.float8_e4m3fn, 448.0), (ml_dtypes.float8_e5m2, 57344.0)
    xq, wq, gq = (_qdq(np.asarray(t, np.float32), *f) for t, f in ((x, e4), (w, e4), (g, e5)))
    for got, ref in ((y, xq @ wq), (dx, gq @ wq.T), (dw, xq.T @ gq)):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0,
                                   atol=1e-2 * np.abs(ref).max())

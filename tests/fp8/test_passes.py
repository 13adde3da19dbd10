"""Passes over HBM that quantization adds to one linear layer's three GEMMs, per recipe,
counted in the program fmtkit emits for a GPU (lowered for CUDA, no GPU needed).

Each quantization of a tensor in one layout reads it for its amax (one reduction: over the
whole tensor, per row or per block) and reads it again to write its FP8 values (one convert).
The minimum a recipe allows: a tensor whose tile is the same along both axes (per tensor,
128x128 blocks) is quantized once and its FP8 values serve both GEMMs that read it; a tile
that follows the contraction (rows, 1x128, MX blocks) is quantized once per layout its GEMMs
contract. So x [M, K], w [K, N] and the gradient g [M, N] are quantized:

    recipe                 x   w   g
    current, delayed       1   1   1
    blockwise              2   1   2     (1x128 along K and along M; 128x128 w)
    rowwise, mxfp8         2   2   2

A delayed recipe also reads each tensor for the amax its history records (fused by XLA with
the cast: the scale comes from the history, not from that amax), and once more, under a
``lax.cond``, only on the step that bootstraps an empty history.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from test_cublaslt import DN, _lowered_for_h200

from fmtkit import DelayedScalingState, fp8

M, K, N = 256, 512, 384  # distinct sizes: each tensor is known by its element count
ROLE = {M * K: "x", K * N: "w", M * N: "g"}
ARGS = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((M, K), (K, N), (M, N)))
MINIMUM = {"current": (1, 1, 1), "delayed": (1, 1, 1), "blockwise": (2, 1, 2),
           "rowwise": (2, 2, 2), "mxfp8": (2, 2, 2)}


def _step(recipe):
    """y, dx, dw of ``x · w`` and, for a delayed recipe, the amaxes its history observes
    (the cotangent of the state, as a train step takes it), from bf16 x, w, cotangent."""
    dg = fp8.dot_general_fn(recipe)

    def f(x, w, g):
        if not dg.recipe.delayed:
            y, vjp = jax.vjp(lambda a, b: dg(a, b, DN), x, w)
            return (y, *vjp(g))
        hist = fp8.init_state(dg.recipe).amax_history
        y, vjp = jax.vjp(lambda a, b, h: dg(a, b, DN, fp8_state=DelayedScalingState(h)),
                         x, w, hist)
        return (y, *vjp(g))

    return f


def _size(dims: str) -> int:
    n = 1
    for d in dims.split("x"):
        n *= int(d)
    return n


def quantization_passes(text: str) -> dict[str, dict[str, int]]:
    """Per tensor ("x", "w", "g"): the FP8 converts (casts) and the max-reductions (amaxes,
    ``bootstrap`` excluded: those inside ``stablehlo.case`` branches) of a lowered module."""
    count = {r: {"casts": 0, "amaxes": 0, "bootstrap_amaxes": 0} for r in ("x", "w", "g")}
    depth = 0  # inside a stablehlo.case region
    for line in text.splitlines():
        if "stablehlo.case" in line:
            depth += 1
        m = re.search(r"stablehlo\.convert %\S+ : \(tensor<([\dx]+)x(?:f32|bf16)>\) -> "
                      r"tensor<[\dx]+xf8", line)
        if m and _size(m.group(1)) in ROLE:
            count[ROLE[_size(m.group(1))]]["casts"] += 1
        m = re.search(r"reduce.*stablehlo\.maximum.*: \(tensor<([\dx]+)x(?:f32|bf16)>", line)
        if m and _size(m.group(1)) in ROLE:
            key = "bootstrap_amaxes" if depth else "amaxes"
            count[ROLE[_size(m.group(1))]][key] += 1
        if depth and re.match(r"^\s*}\) : \(", line):  # the case op's closing line
            depth -= 1
    return count


@pytest.mark.parametrize("recipe", [  # per tensor in make test, the block recipes in test-all
    r if r in ("current", "delayed") else pytest.param(r, marks=pytest.mark.slow)
    for r in MINIMUM])
def test_each_tensor_is_quantized_once_per_layout(recipe):
    got = quantization_passes(_lowered_for_h200(_step(recipe), *ARGS))
    for role, want in zip("xwg", MINIMUM[recipe]):
        assert got[role]["casts"] == want, (role, got)
        # one amax per cast (its own scale), or, delayed, the history's observation
        assert got[role]["amaxes"] == want, (role, got)


def test_the_count_sees_a_second_quantization():
    """Negative control: the same weight in two dots is quantized twice, and counted so."""
    dg = fp8.dot_general_fn("current")
    x2 = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    text = _lowered_for_h200(lambda a, b, w: dg(a, w, DN) + dg(b, w, DN), x2, x2, ARGS[1])
    got = quantization_passes(text)
    assert got["w"]["casts"] == 2 and got["x"]["casts"] == 2

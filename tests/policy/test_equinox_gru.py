"""An Equinox GRU under ``lax.scan``, batched inside the policied function
(``with_policy(lambda model, x: jax.vmap(model)(x), preset)``) and trained the Equinox way
(``eqx.filter_jit``, ``eqx.filter_value_and_grad``): every FP8 preset compiles to a program
XLA:CPU runs. XLA:CPU (jax 0.11.2) rejected the data-gradient GEMM of ``fp8-current`` at run
time ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"); the emulated FP8
GEMMs now hand it their widened operands in a form it runs. Reference: the same step with
the FP8 operands fed to XLA's own FP8 dots (the ``widen_off_gpu`` switch off), which XLA:CPU
computes as f32 GEMMs of the converted operands: the same exact products, summed in f32.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import dot_operand_dtypes

from fmtkit import with_policy
from fmtkit._switches import flipped


class GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(8, 32, key=k1)
        self.out = eqx.nn.Linear(32, 4, key=k2)

    def __call__(self, xs):  # one sequence [T, 8] -> [4]
        h, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), jnp.zeros(32), xs)
        return self.out(h)


def _step(preset):
    forward = with_policy(lambda model, x: jax.vmap(model)(x), preset)

    @eqx.filter_jit
    def loss_and_grads(model, x, y):
        return eqx.filter_value_and_grad(lambda m: jnp.mean((forward(m, x) - y) ** 2))(model)

    return loss_and_grads


@pytest.mark.slow
def test_batched_equinox_gru_under_fp8_current_runs_on_cpu():
    model = GRU(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 10, 8))
    y = jnp.zeros((16, 4))
    loss, grads = _step("fp8-current")(model, x, y)
    # The GEMMs of the cell are FP8 (e4m3 x e4m3 forward; e5m2 gradients).
    params, static = eqx.partition(model, eqx.is_array)
    forward = with_policy(lambda model, x: jax.vmap(model)(x), "fp8-current")
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(forward(eqx.combine(p, static), x))))(
        params)
    formats = {jnp.dtype(d).name for pair in dot_operand_dtypes(jaxpr) for d in pair}
    assert {"float8_e4m3fn", "float8_e5m2"} <= formats, formats
    # Reference: XLA's own FP8 dots on the same quantized operands.
    with flipped(widen_off_gpu=False):
        ref_loss, ref_grads = _step("fp8-current")(model, x, y)
    # Exact FP8 products summed in f32 in another order: a few f32 ulps of the sums, which
    # the GRU's 10 recurrent steps carry on (measured: below 1e-5 relative).
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(eqx.filter(grads, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ref_grads, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                   atol=1e-5 * float(np.abs(np.asarray(b)).max()))

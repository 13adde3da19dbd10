"""``inspect_policy`` counts the GEMMs the step runs: a recurrent cell under ``lax.scan`` whose
inputs ``xs`` are not differentiated has no data gradient into them (an FP8 GEMM's backward
writes one in the scan's transposed body, which the compiled step drops as dead code).
References: a hand count of the FLOPs of each GEMM, and the dots of the compiled step's HLO.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from fmtkit import inspect_policy, with_policy

pytestmark = pytest.mark.slow  # each test compiles training steps (seconds)

T, B, NI, H, NO = 6, 4, 8, 16, 3  # steps, batch, input, hidden, output sizes


def _rnn(p, xs):  # xs [T, B, NI]
    def step(h, x):
        return jnp.tanh(x @ p["w_ih"] + h @ p["w_hh"]), None

    h, _ = lax.scan(step, jnp.zeros((B, H)), xs)
    return h @ p["w_out"]


def _inputs():
    k = jax.random.split(jax.random.key(0), 4)
    p = {"w_ih": jax.random.normal(k[0], (NI, H)), "w_hh": jax.random.normal(k[1], (H, H)),
         "w_out": jax.random.normal(k[2], (H, NO))}
    return p, jax.random.normal(k[3], (T, B, NI))


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current"])
def test_no_data_gradient_into_undifferentiated_scan_inputs(preset):
    p, xs = _inputs()
    report = inspect_policy(with_policy(_rnn, preset), p, xs, argnums=0)
    flops = {k: sum(m.flops for m in report.matmul_ops if m.kind == k)
             for k in ("forward", "dgrad", "wgrad")}
    # By hand: each step x @ w_ih (2BIH) and h @ w_hh (2BHH), then the head (2BHO); backward,
    # per step the carry's data gradient through w_hh (2BHH) and both weight gradients, the
    # head's dgrad and wgrad; no gradient into xs (it would be 2BIH per step).
    assert flops == {"forward": T * (2 * B * NI * H + 2 * B * H * H) + 2 * B * H * NO,
                     "dgrad": T * 2 * B * H * H + 2 * B * H * NO,
                     "wgrad": T * (2 * B * NI * H + 2 * B * H * H) + 2 * B * H * NO}


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp8-current"])
def test_the_compiled_step_runs_the_reported_gemms(preset):
    p, xs = _inputs()
    f = with_policy(_rnn, preset)
    report = inspect_policy(f, p, xs, argnums=0)
    c = jax.random.normal(jax.random.key(1), (B, NO))  # (a cotangent XLA cannot fold)
    step = jax.jit(jax.value_and_grad(lambda p, xs, c: jnp.sum(f(p, xs) * c)))
    hlo = step.lower(p, xs, c).compile().as_text()
    # The loop's two forward GEMMs and the head; in the backward loop the carry's dgrad and
    # the two wgrads; the head's dgrad and wgrad: 8, as many as the compiled step's dots.
    assert len(report.matmul_ops) == 8, [(m.kind, m.flops) for m in report.matmul_ops]
    assert len(re.findall(r" dot\(", hlo)) == 8

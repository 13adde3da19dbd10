"""``fmtkit bench optim``: the HLO traffic counter on hand-checked programs, and a smoke run at
toy sizes (the timings themselves are a benchmark, not a test)."""

import json

import jax
import jax.numpy as jnp

from studies.bench import optim as bench_optim

_X = jnp.ones((64, 32), jnp.float32)
_DIMS = {"64,32"}


def _traffic(fn, *args):
    return bench_optim.hlo_traffic(jax.jit(fn).lower(*args).compile().as_text(), _DIMS)


def test_hlo_traffic_counts_one_loop_per_output_and_follows_the_true_branch():
    n = 64 * 32
    # one fused loop: reads x and y (f32), writes one f32 array
    assert _traffic(lambda x, y: x * 2.0 + y, _X, _X) == {"passes": 1, "bytes": 12 * n}
    # a bf16 output of the same loop: 4 + 4 + 2 bytes per element
    assert _traffic(lambda x, y: (x + y).astype(jnp.bfloat16), _X, _X)["bytes"] == 10 * n
    # two outputs that share an input: XLA:CPU makes two loops (no multi-output fusion)
    two = _traffic(lambda x, y: (x + y, x * y), _X, _X)
    assert two == {"passes": 2, "bytes": 24 * n}

    def cond(pred, x, y):
        return jax.lax.cond(pred, lambda: x + y, lambda: x * 3.0)

    # the true branch (one loop over x and y: 12 bytes) is counted, not the false one (8)
    assert _traffic(cond, jnp.array(True), _X, _X) == {"passes": 1, "bytes": 12 * n}


def test_bench_optim_runs_and_reports_copies_and_traffic(tmp_path, capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax's adamw is not strict-promotion clean
        rc = bench_optim.main(["--params", "3000", "--width", "32", "--repeats", "1",
                               "--no-jmp", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["param_sized_copies"] == {"fmtkit": 0, "optax_f32": 0}
    per_param = res["hlo_bytes_per_param"]
    # Byte floors from the definitions: plain f32 adamw reads p, g, mu, nu and writes p, mu,
    # nu (7 x 4 bytes); the chain reads p, g (bf16) and master, mu, nu (f32) and writes p
    # (bf16), master, mu, nu: 2 + 2 + 12 + 2 + 12 = 30 bytes. XLA moves at least that.
    assert per_param["optax_f32"] >= 28 and per_param["fmtkit"] >= 30
    assert res["hlo_passes"]["fmtkit"] > res["hlo_passes"]["optax_f32"] > 0
    assert res["cpu_ratios_vs_optax_f32"]["optax_f32"] == 1.0 and res["cpu_seconds"]["fmtkit"] > 0
    assert "ratio fmtkit / optax_f32" in capsys.readouterr().out.splitlines()[-1]

"""Benchmark: a bf16-mixed policy train step, sharded over 8 devices vs unsharded.

    fmtkit bench sharding [--devices 8] [--repeats 10]

The same global batch, the same model (the small transformer LM under
``with_policy(..., "bf16-mixed")``): once on one device, once data-parallel with the batch
sharded over a ``Mesh`` axis "data" (``jax.jit`` + ``NamedSharding``). On a CPU the devices
are simulated (``--xla_force_host_platform_device_count``) and share its cores, so the ratio
measures the overhead of partitioning, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# How the command line lists this benchmark (studies.app.registry).
NAME = "sharding"
SUMMARY = "a bf16-mixed policy train step, sharded over 8 devices vs unsharded"


def _measure(devices: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from fmtkit import with_policy
    from studies.lib.models import TransformerConfig, TransformerLM, lm_loss
    from studies.lib.timing import time_interleaved

    cfg = TransformerConfig(d_model=128, num_heads=4, num_layers=2, d_ff=256, max_len=64)
    model = with_policy(TransformerLM(cfg), "bf16-mixed")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8 * devices, 64)),
                         jnp.int32)
    params = model.init(jax.random.key(0), tokens[:2])["params"]
    opt = optax.sgd(0.1)

    def step(params, opt_state, tokens):
        def loss(p):
            return lm_loss(model.apply({"params": p}, tokens).astype(jnp.float32), tokens)

        value, g = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(g, opt_state)
        return optax.apply_updates(params, updates), opt_state, value

    single = jax.jit(step)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    repl, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    sharded = jax.jit(step, in_shardings=(repl, repl, batch), out_shardings=(repl, repl, repl))
    s0 = opt.init(params)
    args1 = (params, s0, tokens)
    args8 = (jax.device_put(params, repl), jax.device_put(s0, repl),
             jax.device_put(tokens, batch))
    times = time_interleaved({"unsharded": lambda: single(*args1),
                              "sharded": lambda: sharded(*args8)}, repeats=repeats)
    return {"devices": devices, "global_batch": int(tokens.shape[0]), "seconds": times,
            "ratio": times["sharded"] / times["unsharded"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fmtkit bench sharding", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None, help="output folder (default runs/bench-sharding)")
    args = p.parse_args(argv)
    import jax

    if jax.device_count() >= args.devices:
        res = _measure(args.devices, args.repeats)
    else:  # simulate the devices in a fresh process (XLA reads the flag at start)
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
                            f" --xla_force_host_platform_device_count={args.devices}").strip()
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        code = ("import json; from studies.bench.sharding import _measure; "
                f"print(json.dumps(_measure({args.devices}, {args.repeats})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, check=False)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        res = json.loads(out.stdout.strip().splitlines()[-1])
    from studies.lib.common import write_bench_results

    print(f"bf16-mixed train step, global batch {res['global_batch']} x 64 tokens, "
          f"{res['devices']} devices")
    for k, t in res["seconds"].items():
        print(f"  {k:<10} {t * 1e3:8.1f} ms")
    print(f"ratio sharded / unsharded: {res['ratio']:.2f}x")
    print(f"wrote {write_bench_results('sharding', res, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Study ``allreduce``: data-parallel gradient reduction in bf16 vs f32 across 8 devices.

Three reductions of the same per-device gradients (``fmtkit.distributed.reduce_gradients``
inside ``shard_map``):

    f32          psum in float32
    bf16-comm    gradients sent in bfloat16 (all_gather), summed in float32
    bf16         psum in bfloat16 (every partial sum rounded to bf16)

Part 1 measures the relative error of the reduced gradient against a float64 sum, for 2, 4
and 8 devices. Part 2 trains a small MLP regression data-parallel with each reduction (same
data, same seed) and reports the loss curves.

Needs ``devices`` JAX devices; on a CPU with fewer, the study re-runs itself in a
subprocess with ``--xla_force_host_platform_device_count`` (8 simulated devices share the
CPU cores, so this measures numerics, not speed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from studies.lib.common import Progress, figure, no_progress, plot_style, save

# How the command line lists this study (studies.app.registry).
NAME = "allreduce"
SUMMARY = "gradient all-reduce in bf16 vs f32 vs bf16-comm/f32-sum across 8 devices"
ORDER = 80

MODES = ("f32", "bf16-comm", "bf16")


@dataclasses.dataclass(frozen=True)
class Config:
    """Configuration of the allreduce study.

    Attributes:
      devices: number of data-parallel devices (simulated on CPU when needed).
      size: gradient elements per device in part 1.
      spread: per-device gradient magnitudes vary as exp(uniform(-spread, spread)).
      steps: training steps in part 2.
      lr: SGD learning rate in part 2.
      seed: seed of the data and the initial parameters.
    """

    devices: int = 8
    size: int = 65536
    spread: float = 3.0
    steps: int = 60
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self):
        if self.devices < 2 or self.devices & (self.devices - 1):
            raise ValueError(f"devices must be a power of two >= 2, got {self.devices}.")
        if self.size <= 0 or self.steps <= 0:
            raise ValueError("size and steps must be positive.")


def _reduce_fn(mode: str, mesh: Any):
    import jax
    from jax.sharding import PartitionSpec as P

    from fmtkit.distributed import reduce_gradients

    kw = {"f32": {"dtype": "f32"}, "bf16-comm": {"dtype": "f32", "comm_dtype": "bf16"},
          "bf16": {"dtype": "bf16"}}[mode]

    def local(g):
        return reduce_gradients(g[0], "data", mean=False, **kw)[None]

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                 check_vma=False))


def _reduction_errors(cfg: Config) -> dict[str, list[float]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    rng = np.random.default_rng(cfg.seed)
    counts = [n for n in (2, 4, 8, 16, 32) if n <= cfg.devices]
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for n in counts:
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
        g = rng.standard_normal((n, cfg.size)) * np.exp(rng.uniform(-cfg.spread, cfg.spread,
                                                                    (n, 1)))
        exact = g.sum(axis=0)
        for mode in MODES:
            red = np.asarray(_reduce_fn(mode, mesh)(jnp.asarray(g, jnp.float32)), np.float64)[0]
            out[mode].append(float(np.linalg.norm(red - exact) / np.linalg.norm(exact)))
    return {"devices": counts, **out}


def _train(cfg: Config, mode: str, progress: Progress) -> list[float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from fmtkit.distributed import reduce_gradients

    mesh = Mesh(np.array(jax.devices()[:cfg.devices]), ("data",))
    rng = np.random.default_rng(cfg.seed)
    batch = 16 * cfg.devices
    w_true = rng.standard_normal((32, 16)) / 4
    k1, k2 = jax.random.split(jax.random.key(cfg.seed))
    params = {"w1": jax.random.normal(k1, (32, 128)) / np.sqrt(32),
              "w2": jax.random.normal(k2, (128, 16)) / np.sqrt(128)}
    kw = {"f32": {"dtype": "f32"}, "bf16-comm": {"dtype": "f32", "comm_dtype": "bf16"},
          "bf16": {"dtype": "bf16"}}[mode]

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def local(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        g = reduce_gradients(g, "data", **kw)  # mean over devices
        p = jax.tree.map(lambda a, b: a - cfg.lr * b, p, g)
        return p, jax.lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P()), check_vma=False))
    losses = []
    for i in progress(range(cfg.steps), total=cfg.steps, desc=f"train {mode}"):
        data = np.random.default_rng([cfg.seed, i])
        x = data.standard_normal((batch, 32))
        y = x @ w_true + 0.01 * data.standard_normal((batch, 16))
        params, loss = step(params, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
        losses.append(float(loss))
    return losses


def _run_here(cfg: Config, progress: Progress) -> dict[str, Any]:
    return {"reduction": _reduction_errors(cfg),
            "losses": {m: _train(cfg, m, progress) for m in MODES}}


def run(config: Config = Config(), progress: Progress = no_progress) -> dict[str, Any]:
    """Reduction errors against float64 and loss curves per reduction mode."""
    import jax

    if jax.device_count() >= config.devices:
        return _run_here(config, progress)
    # Too few devices here: simulate them in a fresh process (XLA reads the flag at start).
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={config.devices}"
                        + " --xla_allow_excess_precision=false").strip()
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import json, dataclasses; from studies.numerics import allreduce as a; "
            f"print(json.dumps(a._run_here(a.Config(**{dataclasses.asdict(config)!r}), "
            "a.no_progress)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"allreduce subprocess failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: dict[str, Any]) -> str:
    red = results["reduction"]
    lines = ["relative error of the reduced gradient vs float64",
             "devices  " + "  ".join(f"{m:>10}" for m in MODES)]
    for i, n in enumerate(red["devices"]):
        lines.append(f"{n:>7}  " + "  ".join(f"{red[m][i]:10.2e}" for m in MODES))
    lines.append("")
    lines.append("final training loss: " + ", ".join(
        f"{m} {results['losses'][m][-1]:.5f}" for m in MODES))
    return "\n".join(lines)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    red = results["reduction"]
    paths = []
    with plot_style():
        fig, ax = figure()
        for m in MODES:
            ax.plot(red["devices"], red[m], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_ylabel("relative error vs float64")
        ax.set_title("gradient all-reduce precision")
        ax.legend()
        paths.append(save(fig, out_dir, "allreduce_error"))
        fig, ax = figure()
        for m in MODES:
            ax.plot(results["losses"][m], label=m)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.set_title("data-parallel training by reduction precision")
        ax.legend()
        paths.append(save(fig, out_dir, "allreduce_loss"))
    return paths

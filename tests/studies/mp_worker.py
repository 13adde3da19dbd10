"""One process of the multi-process tests (started by ``studies.app.launch`` or alone).

``python mp_worker.py MODE OUT_DIR JSON_ARGS``; writes ``OUT_DIR/p<process>.json``.

Modes:
  train: ``studies.training.train`` with ``TrainConfig(**args["cfg"])`` and ``args["setup"]``;
    optional ``run_dir``/``resume``; ``kill_at`` = [process, step]: that process SIGKILLs
    itself when the loop reaches that step; ``kill_in_write`` = step: SIGKILL inside the
    write of that step's checkpoint. Writes the history, the final state's
    fingerprint and (``dump``) the final params/opt state as .npz.
  inf: fp16 compute, f32 masters, dynamic loss scale on the library's model; at ``args["inf_step"]``
    process 1 alone feeds an inf example weight into its rows of the batch; after every
    step the fingerprints of params and opt state of every process are gathered.
  fp8: a delayed-FP8 Dense layer; each process feeds inputs whose amax is
    ``args["amaxes"][process]``; the amax history after one update.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from studies.training import distributed

MULTI = distributed.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def run_train(args: dict, out: Path) -> dict:
    from studies.training import TrainConfig, train

    cfg = TrainConfig(**args["cfg"])
    kill = args.get("kill_at")

    if kill:  # SIGKILL when the loop asks for the batch of step kill[1]
        import studies.training.loop as T

        orig = T.batch_at

        def batch_at(data, c, i):
            if jax.process_index() == kill[0] and i == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(data, c, i)

        T.batch_at = batch_at
    if args.get("kill_in_write") is not None:
        # SIGKILL after the step's files are written, before orbax's atomic rename makes it
        # a checkpoint: the worst moment of a write (a test helper may reach into orbax).
        from orbax.checkpoint._src.path import atomicity

        orig_finalize = atomicity.AtomicRenameTemporaryPath.finalize
        victim = str(args["kill_in_write"])

        async def finalize(self):
            if Path(str(self._final_path)).name == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            return await orig_finalize(self)

        atomicity.AtomicRenameTemporaryPath.finalize = finalize
    res = train(args["setup"], cfg, run_dir=args.get("run_dir"),
                resume=args.get("resume", False))
    if args.get("dump"):
        np.savez(out / f"state{jax.process_index()}.npz", **_leaves(res.state))
    return {"history": res.history, "fingerprint": distributed.fingerprint(res.state),
            "resumed_from": res.resumed_from}


def run_inf(args: dict, out: Path) -> dict:
    import optax

    from fmtkit import optim
    from studies.lib.models import lm_loss
    from studies.training import mesh
    from studies.training.config import TrainConfig
    from studies.training.data import batch_at, load_data
    from studies.training.metrics import skipped_steps
    from studies.training.optimizer import make_optimizer
    from studies.training.setups import Setup, get_setup
    from studies.training.step import build_model, make_train_step

    setup = get_setup(Setup("fp16-master-dynamic", "fp16-mixed", update="master",
                            loss_scaling="dynamic", grad_format="float16"))
    cfg = TrainConfig(**args["cfg"])
    init_fn, _ = make_train_step(setup, cfg)
    model, opt = build_model(setup, cfg), make_optimizer(setup, cfg)
    n = cfg.data_parallel

    def step(state, tokens, weights):
        scale = optim.loss_scale(state.opt_state)

        def loss_fn(p):
            logits = model.apply({"params": p}, tokens).astype(jnp.float32)
            per = jax.vmap(lambda lg, t: lm_loss(lg[None], t[None]))(logits, tokens)
            return jnp.mean(per * weights) * scale

        grads = jax.grad(loss_fn)(state.params)
        with jax.numpy_dtype_promotion("standard"):
            upd, opt_state = opt.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, upd)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1)

    ss, bs = mesh.state_sharding(n), mesh.batch_sharding(n)
    jstep = jax.jit(step, in_shardings=(ss, bs, bs), out_shardings=ss)
    data = load_data(cfg)
    state = init_fn()
    rows = []
    for i in range(cfg.steps):
        w = np.ones(cfg.batch, np.float32)
        if i == args["inf_step"]:
            w[cfg.batch // 2:] = np.inf  # only process 1 holds these rows (2 processes)
        state = jstep(state, mesh.put_batch(batch_at(data, cfg, i), n), mesh.put_batch(w, n))
        fps = distributed.gather_from_all(
            distributed.fingerprint((state.params, state.opt_state)))
        rows.append({"fingerprints": fps, "params": distributed.fingerprint(state.params),
                     "loss_scale": float(optim.loss_scale(state.opt_state)),
                     "skipped": int(skipped_steps(state.opt_state))})
    return {"rows": rows}


def run_fp8(args: dict, out: Path) -> dict:
    import flax.linen as nn

    import fmtkit
    from studies.training import mesh

    n = jax.device_count()
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            # The last Dense is the policy's "head" (kept out of FP8): the first is FP8.
            return nn.Dense(128, use_bias=False)(nn.Dense(128, use_bias=False)(x))

    layer = fmtkit.with_policy(Net(), "fp8-delayed")
    rows_per = 4
    amaxes = args["amaxes"]
    p = jax.process_index()
    rng = np.random.default_rng(p)
    local = rng.uniform(-0.5, 0.5, (rows_per * jax.local_device_count(), 128)).astype(
        np.float32)
    local[0, 0] = amaxes[p]  # this process's amax of the input
    gshape = (rows_per * n, 128)
    x = jax.make_array_from_process_local_data(mesh.batch_sharding(n), local, gshape)
    variables = jax.jit(layer.init, out_shardings=mesh.state_sharding(n))(
        jax.random.PRNGKey(0), x)
    from fmtkit.fp8 import update_state

    def loss(params, fp8_state, x):
        return jnp.sum(layer.apply({"params": params, "fp8_state": fp8_state}, x) ** 2)

    @jax.jit
    def step(variables, x):
        _, (_, obs) = jax.value_and_grad(loss, argnums=(0, 1))(
            variables["params"], variables["fp8_state"], x)
        return update_state(variables["fp8_state"], obs)

    ss = mesh.state_sharding(n)
    new = jax.jit(step, out_shardings=ss)(variables, x)
    leaves = {k: v.tolist() for k, v in _leaves(new).items()}
    return {"fp8_state": leaves, "fingerprint": distributed.fingerprint(new)}


def main() -> None:
    mode, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    result = {"train": run_train, "inf": run_inf, "fp8": run_fp8}[mode](args, out)
    result["process"] = jax.process_index()
    result["processes"] = jax.process_count()
    (out / f"p{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

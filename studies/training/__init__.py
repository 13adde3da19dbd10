"""The LM-training library of the training studies, one concept per module.

* ``config``: ``TrainConfig`` (what to train and for how long) and its validation;
* ``setups``: ``Setup`` (policy, update rule, loss scaling) and the ``SETUPS`` registry;
* ``data``: the training bytes and the batch of each step;
* ``optimizer``: the learning-rate schedule and each setup's optax chain;
* ``mesh``: the data-parallel ``Mesh`` and shardings;
* ``metrics``: the per-step metrics (loss, loss scale, skipped, grad flush, norm, update
  frac) and a run's summary of them;
* ``step``: ``TrainState`` and ``make_train_step`` (init and jitted step, no I/O);
* ``loop``: ``train``, the training loop of one seed (``TrainResult``);
* ``multiseed``: several seeds of one setup in one vmapped step (the seeds axis:
  ``stack``, ``vmap_step``, ``run_seeds``; their training loop ``train_seeds``) and the
  late-training start;
* ``checkpoint``: orbax checkpoints of the whole ``TrainState`` (structured) and the history;
* ``distributed``: several processes (``jax.distributed`` from the environment
  ``python -m studies.app.launch`` sets), per-process batch rows, fingerprints.

The names the studies use most are imported here (``from studies.training import
TrainConfig, train``).
"""

from studies.training.config import MODEL_SIZES, TrainConfig
from studies.training.data import batch_at, load_data
from studies.training.loop import TrainResult, train
from studies.training.metrics import METRIC_KEYS
from studies.training.multiseed import SeedsResult, train_seeds
from studies.training.optimizer import lr_schedule, make_optimizer
from studies.training.setups import DEFAULT_SETUPS, SETUPS, Setup, get_setup
from studies.training.step import TrainState, build_model, init_params, make_train_step

__all__ = [
    "DEFAULT_SETUPS",
    "METRIC_KEYS",
    "MODEL_SIZES",
    "SETUPS",
    "SeedsResult",
    "Setup",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "batch_at",
    "build_model",
    "get_setup",
    "init_params",
    "load_data",
    "lr_schedule",
    "make_optimizer",
    "make_train_step",
    "train",
    "train_seeds",
]

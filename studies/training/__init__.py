"""The LM-training library of the training studies, one concept per module.

* ``config``: ``TrainConfig`` (what to train and for how long) and its validation;
* ``setups``: ``Setup`` (policy, update rule, loss scaling) and the ``SETUPS`` registry;
* ``data``: the training bytes and the batch of each step;
* ``optimizer``: the learning-rate schedule and each setup's optax chain;
* ``mesh``: the data-parallel ``Mesh`` and shardings;
* ``metrics``: the per-step metrics (loss, loss scale, skipped, grad flush, norm, update frac);
* ``step``: ``TrainState`` and ``make_train_step`` (init and jitted step, no I/O);
* ``checkpoint``: orbax checkpoints of the whole ``TrainState`` (structured) and the history.

The loop (``train``) and the public names are in ``studies.train``.
"""

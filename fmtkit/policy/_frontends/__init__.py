"""The frontends of the policy: linen modules (``linen``), NNX modules (``nnx``) and plain
functions (``functions``), each implementing ``protocol.Frontend`` on top of the engine
(``fmtkit.policy._engine``)."""

"""The language-model studies: each trains the studies' small transformer
(``studies.training``) under precision setups and compares the runs (``fmtkit study NAME``)."""

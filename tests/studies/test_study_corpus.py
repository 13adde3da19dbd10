"""The embedded corpus: exact entropy rate, sampling that matches it, text loading."""

import math

import numpy as np
import pytest

from studies.lib import corpus
from studies.lib.corpus import ALPHABET, MarkovSource


def _binary_entropy(p):
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def test_two_state_chain_textbook_entropy():
    # Cover & Thomas example 4.2.1 (two-state Markov chain): pi = (b, a) / (a + b),
    # H = pi_0 h(a) + pi_1 h(b).
    a, b = 0.1, 0.3
    src = MarkovSource(b"xy", 1, np.array([[1 - a, a], [b, 1 - b]]))
    np.testing.assert_allclose(src.stationary, [b / (a + b), a / (a + b)], rtol=0, atol=1e-14)
    expected = (b * _binary_entropy(a) + a * _binary_entropy(b)) / (a + b)
    assert src.entropy_rate_nats() == pytest.approx(expected, rel=1e-13)


def test_uniform_source_has_log_v_entropy():
    v = len(ALPHABET)
    src = MarkovSource(ALPHABET, 2, np.full((v * v, v), 1.0 / v))
    assert src.entropy_rate_nats() == pytest.approx(math.log(v), rel=1e-13)
    assert src.entropy_rate_bits() == pytest.approx(math.log2(v), rel=1e-13)


def test_stationary_distribution_solves_pi_t_equals_pi():
    src = corpus.default_source()
    v = len(ALPHABET)
    # The dense context-to-context matrix: (a, b) -> (b, c) with probability P(c | a, b).
    t = np.zeros((v * v, v * v))
    for s in range(v * v):
        for c in range(v):
            t[s, (s % v) * v + c] += src.probs[s, c]
    # pi (T - I) = 0 with sum(pi) = 1: a direct solve (one redundant equation replaced).
    a = t.T - np.eye(v * v)
    a[-1] = 1.0
    pi = np.linalg.solve(a, np.eye(v * v)[-1])
    np.testing.assert_allclose(src.stationary, pi, rtol=0, atol=1e-10)


def test_sample_entropy_matches_the_analytic_rate():
    src = corpus.default_source()
    h = corpus.entropy_rate_nats()
    assert h == src.entropy_rate_nats()
    assert corpus.entropy_rate_bits() == pytest.approx(h / math.log(2), rel=1e-15)
    data = corpus.default_corpus(300_000, seed=7)
    assert len(data) == 300_000
    # (1) The sample's mean log-loss under the true source (Shannon-McMillan-Breiman).
    idx = src.encode(data)
    ll = -np.log(src.probs[idx[:-2] * len(ALPHABET) + idx[1:-1], idx[2:]])
    batch = ll[: ll.size // 50 * 50].reshape(50, -1).mean(axis=1)
    se = batch.std(ddof=1) / math.sqrt(50)  # batch means absorb the chain's correlation
    assert abs(ll.mean() - h) < 5 * se
    assert src.cross_entropy_nats(data) == pytest.approx(ll.mean(), rel=1e-12)
    # (2) The plug-in conditional entropy from counts alone (no use of P), Miller-Madow
    # corrected; its remaining bias is about -0.01 nats at this length (measured).
    ctx = idx[:-2] * len(ALPHABET) + idx[1:-1]
    joint = np.bincount(ctx * len(ALPHABET) + idx[2:]).astype(float)
    marg = np.bincount(ctx).astype(float)
    n = joint.sum()

    def plug_in(counts):
        p = counts[counts > 0] / n
        return -(p * np.log(p)).sum()

    mm = (plug_in(joint) - plug_in(marg)
          + ((joint > 0).sum() - (marg > 0).sum()) / (2 * n))
    assert abs(mm - h) < 0.03


def test_default_language_is_structured_text():
    data = corpus.default_corpus(20_000, seed=3)
    assert set(data) <= set(ALPHABET)
    text = data.decode("ascii")
    assert "  " not in text and "\n " not in text  # no space after a space or a newline
    after_period = {text[i + 1] for i in range(len(text) - 1) if text[i] == "."}
    assert after_period <= {" ", "\n"}
    assert 1.0 < corpus.entropy_rate_bits() < math.log2(len(ALPHABET))


def test_sampling_is_deterministic_per_seed():
    a = corpus.default_corpus(5000, seed=1)
    assert a == corpus.default_corpus(5000, seed=1)
    assert a != corpus.default_corpus(5000, seed=2)
    assert corpus.default_corpus(0) == b""


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_bytes must be an int >= 0"):
        corpus.default_corpus(-1)
    with pytest.raises(ValueError, match="not in the alphabet"):
        corpus.default_source().cross_entropy_nats(b"abc!def")
    with pytest.raises(ValueError, match="probability distribution"):
        MarkovSource(b"xy", 1, np.array([[0.5, 0.6], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="shape"):
        MarkovSource(b"xy", 2, np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="fanout"):
        MarkovSource.english_like(fanout=0)


def test_load_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("héllo wörld\n", encoding="utf-8")
    assert corpus.load_text(p) == "héllo wörld\n".encode()
    with pytest.raises(FileNotFoundError, match="no such file"):
        corpus.load_text(tmp_path / "missing.txt")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        corpus.load_text(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        corpus.load_text(empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xffdef")
    with pytest.raises(ValueError, match="not UTF-8 text: invalid byte 0xff at offset 3"):
        corpus.load_text(bad)


# ------------------------------------------------------------------------ real text: stdlib


def _walk_stdlib_independently():
    """The documented file rule, re-derived here with pathlib.rglob instead of os.walk."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
            "pydoc_data"}
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if not skip & set(p.relative_to(root).parts[:-1]))
    return root, files


def test_stdlib_corpus_files_and_split_follow_the_documented_rule():
    import hashlib

    root, files = _walk_stdlib_independently()
    c = corpus.stdlib_corpus()
    assert c.root == str(root.resolve())
    assert corpus.stdlib_files() == tuple(files)
    # Disjoint, and together every file (all of them are UTF-8 on CPython).
    assert set(c.train_files).isdisjoint(c.heldout_files)
    assert sorted(c.train_files + c.heldout_files) == files
    for rel in files:
        h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
        assert (rel in c.heldout_files) == (h < 0.1 * 2.0**64)
    # Each part is its files' bytes, concatenated in sorted order.
    assert c.train_files == tuple(sorted(c.train_files))
    assert c.heldout == b"".join((root / f).read_bytes() for f in c.heldout_files)
    assert c.train == b"".join((root / f).read_bytes() for f in c.train_files)
    # A binomial(684, 0.1) count: mean 68, sd 7.8; 6 sd either side.
    assert 0.1 * len(files) - 6 * 7.9 < len(c.heldout_files) < 0.1 * len(files) + 6 * 7.9


def test_stdlib_corpus_is_real_nontrivial_text():
    c = corpus.stdlib_corpus()
    assert len(c.train) > 2_000_000 and len(c.heldout) > 200_000
    for part in (c.train, c.heldout):
        part.decode("utf-8")  # raises if not UTF-8
        b = np.frombuffer(part, np.uint8)
        assert (b < 128).mean() > 0.99  # source code: almost all ASCII
        assert b"def " in part and b"import " in part
    # Held-out files are not also in training (by content, too).
    d = c.describe()
    assert d["train_bytes"] == len(c.train) and d["heldout_files"] == len(c.heldout_files)
    assert d["train_sha256"] != d["heldout_sha256"]


def test_stdlib_corpus_is_deterministic():
    a = corpus.stdlib_corpus()
    corpus._stdlib_split.cache_clear()
    b = corpus.stdlib_corpus()
    assert a is not b
    assert a.train == b.train and a.heldout == b.heldout
    assert a.describe() == b.describe()
    other = corpus.stdlib_corpus(0.3)
    assert set(a.heldout_files) < set(other.heldout_files)  # a threshold rule nests


def test_stdlib_corpus_on_a_given_folder(tmp_path):
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text(f"x = {i}\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text("skipped\n")
    (tmp_path / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    c = corpus.stdlib_corpus(0.5, root=tmp_path)
    assert len(c.train_files) + len(c.heldout_files) == 40
    assert b"skipped" not in c.train + c.heldout and b"\xe9" not in c.train + c.heldout
    with pytest.raises(ValueError, match="heldout_fraction must be"):
        corpus.stdlib_corpus(1.0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.stdlib_corpus(root=tmp_path / "nope")
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "a.py").write_text("a = 1\n")
    with pytest.raises(ValueError, match="leaves an empty part"):
        corpus.stdlib_corpus(root=tmp_path / "only")


def test_bits_per_byte():
    assert corpus.bits_per_byte(math.log(256)) == pytest.approx(8.0, rel=1e-15)
    assert corpus.bits_per_byte(1.0) == pytest.approx(1.4426950408889634, rel=1e-15)


def test_heldout_windows():
    data = bytes(range(100))
    w = corpus.heldout_windows(data, 10, 4)
    # starts round(i * 90 / 3) = 0, 30, 60, 90
    np.testing.assert_array_equal(w[:, 0], [0, 30, 60, 90])
    np.testing.assert_array_equal(w[3], np.arange(90, 100))
    assert w.dtype == np.int32 and w.shape == (4, 10)
    np.testing.assert_array_equal(corpus.heldout_windows(data, 5, 1), [np.arange(5)])
    with pytest.raises(ValueError, match="at least seq_len"):
        corpus.heldout_windows(b"abc", 5, 2)
    with pytest.raises(ValueError, match="count must be"):
        corpus.heldout_windows(data, 5, 0)

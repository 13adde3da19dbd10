"""The embedded corpus: exact entropy rate, sampling that matches it, text loading."""

import math

import numpy as np
import pytest

from studies import corpus
from studies.corpus import ALPHABET, MarkovSource


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

"""studies.lib.stats: mean ± std over seeds, the 3-SE rule, table cells, seed-band plots.

Expected values are worked out by hand in the comments (or, for the p-value, taken from
SciPy's own Welch test, an independent implementation).
"""

import doctest
import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from studies.lib import stats
from studies.lib.stats import compare, format_gap, format_mean_std, summarize


def test_module_examples_run():
    result = doctest.testmod(stats, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_summarize_hand_computed():
    # [1, 2, 3, 6]: mean 3; squared deviations 4 + 1 + 0 + 9 = 14; var 14/3; sem = std/2.
    s = summarize([1.0, 2.0, 3.0, 6.0])
    assert s.n == 4 and s.n_nonfinite == 0
    assert s.mean == 3.0
    assert s.std == pytest.approx(math.sqrt(14 / 3), rel=1e-15)
    assert s.sem == pytest.approx(math.sqrt(14 / 3) / 2, rel=1e-15)
    assert s.values == (1.0, 2.0, 3.0, 6.0)


def test_summarize_one_seed_and_nonfinite():
    s = summarize([2.5])
    assert s.mean == 2.5 and math.isnan(s.std) and math.isnan(s.sem)
    d = summarize([2.0, float("nan"), 2.1])
    assert d.n_nonfinite == 1 and math.isnan(d.mean) and math.isnan(d.std)
    assert format_mean_std(d) == "diverged 1/3"
    assert format_mean_std(s) == "2.5000"


def test_welch_gap_hand_computed():
    # a = [1, 2, 3]: mean 2, var 1.  b = [2, 4, 6]: mean 4, var 4.
    # SE = sqrt(1/3 + 4/3) = sqrt(5/3); std = sqrt(1 + 4) = sqrt(5); z = 2 / sqrt(5/3);
    # Welch dof = (5/3)^2 / ((1/3)^2 / 2 + (4/3)^2 / 2) = (25/9) / (17/18) = 50/17.
    g = compare([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert g.gap == 2.0
    assert g.se == pytest.approx(math.sqrt(5 / 3), rel=1e-15)
    assert g.std == pytest.approx(math.sqrt(5), rel=1e-15)
    assert g.z == pytest.approx(2 / math.sqrt(5 / 3), rel=1e-15)
    assert g.dof == pytest.approx(50 / 17, rel=1e-14)
    assert not g.significant  # z = 1.55 < 3
    assert g.relative == pytest.approx(1.0, rel=1e-15)  # gap 2 over reference mean 2
    assert g.relative_se == pytest.approx(math.sqrt(5 / 3) / 2, rel=1e-15)
    # SciPy's Welch t-test is an independent implementation of t and its p-value.
    ref = sps.ttest_ind([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], equal_var=False)
    assert g.z == pytest.approx(ref.statistic, rel=1e-12)
    assert g.p_value == pytest.approx(ref.pvalue, rel=1e-10)


@pytest.mark.parametrize(("shift", "expected"), [(2.4, False), (2.5, True), (-2.5, True),
                                                  (-2.4, False)])
def test_three_se_threshold(shift, expected):
    # Both setups [-1, 0, 1] + c: var 1 each, SE = sqrt(2/3) = 0.8165, 3 SE = 2.4495.
    a = np.array([-1.0, 0.0, 1.0]) + 10.0
    g = compare(a, a + shift)
    assert g.se == pytest.approx(math.sqrt(2 / 3), rel=1e-14)
    assert g.significant is expected
    assert g.threshold == 3.0


def test_threshold_is_a_parameter():
    a = np.array([-1.0, 0.0, 1.0])
    # 2.0 > 2 * 0.8165 = 1.633 but < 3 * 0.8165.
    assert compare(a, a + 2.0, threshold=2.0).significant
    assert not compare(a, a + 2.0).significant


def test_unequal_seed_counts_welch():
    # a = [0, 2] (mean 1, var 2), b = [1, 2, 3, 4, 5] (mean 3, var 2.5).
    # SE = sqrt(2/2 + 2.5/5) = sqrt(1.5); dof = 1.5^2 / (1^2/1 + 0.5^2/4) = 2.25/1.0625.
    g = compare([0.0, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0])
    assert g.gap == 2.0
    assert g.se == pytest.approx(math.sqrt(1.5), rel=1e-15)
    assert g.dof == pytest.approx(2.25 / 1.0625, rel=1e-14)
    ref = sps.ttest_ind([1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 2.0], equal_var=False)
    assert g.p_value == pytest.approx(ref.pvalue, rel=1e-10)


def test_paired_se_hand_computed():
    # Shared per-seed offsets (seed effects) cancel in the paired differences:
    # a = [10, 12, 14], b = a + [1.0, 1.2, 0.8]; d = [1.0, 1.2, 0.8]: mean 1.0, var 0.04,
    # paired SE = 0.2 / sqrt(3) = 0.11547 -> z = 8.66, significant. Welch sees
    # var_a = var_b = 4 -> SE = sqrt(4/3 + 3.64/3) ... not significant.
    a = np.array([10.0, 12.0, 14.0])
    b = a + np.array([1.0, 1.2, 0.8])
    p = compare(a, b, paired=True)
    assert p.gap == pytest.approx(1.0, rel=1e-14)
    assert p.se == pytest.approx(0.2 / math.sqrt(3), rel=1e-12)
    assert p.std == pytest.approx(0.2, rel=1e-12)
    assert p.dof == 2.0 and p.paired and p.significant
    ref = sps.ttest_rel(b, a)
    assert p.p_value == pytest.approx(ref.pvalue, rel=1e-10)
    w = compare(a, b)
    # var(b) = var([11, 13.2, 14.8]) = ((1.333..)^2 + 0.8667^2 + 2.4667^2) / 2 = 3.6533...
    vb = np.var([11.0, 13.2, 14.8], ddof=1)
    assert w.se == pytest.approx(math.sqrt(4 / 3 + vb / 3), rel=1e-14)
    assert not w.significant
    with pytest.raises(ValueError, match="paired=True needs as many"):
        compare([1.0, 2.0], [1.0, 2.0, 3.0], paired=True)


def test_zero_spread_and_undefined_cases():
    same = compare([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert same.gap == 0.0 and same.z == 0.0 and not same.significant
    det = compare([1.0, 1.0], [1.5, 1.5])  # deterministic runs that differ: infinitely many SE
    assert det.z == math.inf and det.significant and det.p_value == 0.0
    one = compare([1.0], [3.0])  # one seed each: no spread, nothing can be significant
    assert math.isnan(one.se) and not one.significant
    nan = compare([1.0, 1.1, 0.9], [1.0, float("nan"), 1.2])
    assert math.isnan(nan.gap) and not nan.significant
    assert format_gap(nan) == "diverged"


def test_bad_arguments():
    zero = compare([-1.0, 0.0, 1.0], [0.0, 1.0, 2.0])  # reference mean 0
    assert math.isnan(zero.relative) and zero.gap == 1.0
    assert format_gap(zero, relative=False) == "+1.0 ± 1.4"
    with pytest.raises(ValueError, match="nonzero reference mean"):
        format_gap(zero)
    with pytest.raises(ValueError, match="at least one seed"):
        summarize([])
    with pytest.raises(ValueError, match="1-D"):
        compare([[1.0, 2.0]], [1.0])
    with pytest.raises(ValueError, match="threshold must be"):
        compare([1.0, 2.0], [1.0, 2.0], threshold=0.0)


def test_cells():
    # std 0.0012 -> 2 significant digits need 4 decimals.
    s = summarize([2.3444, 2.3456, 2.3468])
    assert s.std == pytest.approx(0.0012, rel=1e-9)
    assert format_mean_std(s) == "2.3456 ± 0.0012"
    assert format_mean_std([2.3444, 2.3456, 2.3468], decimals=2) == "2.35 ± 0.00"
    # reference [2, 2.02, 1.98] (mean 2, std 0.02); candidate +0.1: gap 5%,
    # std of the gap sqrt(2) * 0.02 = 0.028284 -> 1.41% of 2; SE 0.016330 -> z = 6.1.
    g = compare([2.0, 2.02, 1.98], [2.1, 2.12, 2.08])
    assert g.significant
    assert format_gap(g) == "+5.0% ± 1.4% *"  # 2 significant digits of 1.41
    assert format_gap(g, relative=False) == "+0.100 ± 0.028 *"
    small = compare([2.0, 2.02, 1.98], [2.01, 2.03, 1.99])  # 0.01 < 3 * 0.01633
    assert format_gap(small) == "+0.5% ± 1.4%"
    assert "3 standard errors" in stats.SIGNIFICANCE_NOTE


def test_gap_to_dict_keeps_every_seed():
    g = compare([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    d = g.to_dict()
    assert d["reference"]["values"] == [1.0, 2.0, 3.0]
    assert d["candidate"]["values"] == [2.0, 4.0, 6.0]
    assert d["gap"] == 2.0 and d["significant"] is False and d["relative"] == 1.0


def test_stack_runs_pads_with_nan():
    y = stats.stack_runs([[1.0, 2.0, 3.0], [4.0]])
    np.testing.assert_array_equal(y, [[1.0, 2.0, 3.0], [4.0, np.nan, np.nan]])


def test_band_draws_mean_and_std():
    from studies.lib.common import figure

    runs = np.array([[1.0, 2.0, 4.0], [3.0, 2.0, 0.0], [2.0, 5.0, 2.0]])
    # column means [2, 3, 2]; sample stds [1, sqrt(3), 2].
    _, ax = figure()
    line, poly = stats.band(ax, [0, 1, 2], runs, label="x")
    np.testing.assert_allclose(line.get_ydata(), [2.0, 3.0, 2.0], rtol=0, atol=1e-15)
    verts = poly.get_paths()[0].vertices
    upper = {(x, y) for x, y in verts}
    for x, m, s in zip([0.0, 1.0, 2.0], [2.0, 3.0, 2.0], [1.0, math.sqrt(3), 2.0]):
        assert any(abs(vx - x) < 1e-12 and abs(vy - (m + s)) < 1e-12 for vx, vy in upper)
        assert any(abs(vx - x) < 1e-12 and abs(vy - (m - s)) < 1e-12 for vx, vy in upper)
    # Trailing 2-step average of each seed first: [1, 1.5, 3], [3, 2.5, 1], [2, 3.5, 3.5].
    _, ax = figure()
    line, _ = stats.band(ax, [0, 1, 2], runs, smooth=2)
    np.testing.assert_allclose(line.get_ydata(), [2.0, 2.5, 7.5 / 3], rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="steps but x has"):
        stats.band(ax, [0, 1], runs)


def test_gap_bars_whiskers_are_three_se():
    from studies.lib.common import figure

    a = np.array([2.0, 2.02, 1.98])
    gaps = {"big": compare(a, a + 0.1), "small": compare(a, a + 0.01)}
    _, ax = figure()
    eb = stats.gap_bars(ax, gaps)
    segs = eb.lines[2][0].get_segments()
    # In % of the reference mean 2: gaps 5% and 0.5%; 3 SE = 3 * 0.016330 / 2 * 100 = 2.449%.
    se_pct = 3 * math.sqrt(2 * 0.0004 / 3) / 2 * 100
    widths = sorted((abs(s[1][0] - s[0][0]) / 2, (s[1][0] + s[0][0]) / 2) for s in segs)
    assert widths[0][0] == pytest.approx(se_pct, rel=1e-9)
    assert sorted(c for _, c in widths) == pytest.approx([0.5, 5.0], rel=1e-9)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["big *", "small"]


def test_plots_write_png(tmp_path):
    a = np.array([2.0, 2.02, 1.98])
    p1 = stats.plot_gap_bars({"x": compare(a, a + 0.1)}, tmp_path)
    rng = np.random.default_rng(0)
    p2 = stats.plot_seed_bands({"fp32": rng.normal(size=(3, 20)),
                                "bf16": [rng.normal(size=20), rng.normal(size=12)]},
                               tmp_path, smooth=3, hline=0.0)
    for p in (p1, p2):
        assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("paired", [False, True])
def test_gap_from_dict_round_trips(paired):
    g = stats.compare([2.0, 2.1, 1.9], [2.2, 2.15, 2.0], threshold=2.5, paired=paired)
    back = stats.Gap.from_dict(json.loads(json.dumps(g.to_dict())))
    assert back == g

"""A killed run's log: the torn last line of ``stats.jsonl`` loses no step on resume.

A run killed while ``StatsLogger.write`` appends a line leaves a prefix of that line on
disk, without its newline. The resumed run's logger, appending to the same file, must start
its first record on a line of its own (keeping every byte already written), and
``fmtkit debug`` must read every complete record, skipping the torn one with a warning. The
expected records are written out here by hand.
"""

from __future__ import annotations

import json

import pytest

from fmtkit.debug.log import StatsLogger
from studies.app.cli import main
from studies.app.debug_report import read_decisions, read_log

TAG = "Dense_0/dot_general_0/activation/amax"


def stats(step: int) -> dict:
    return {"Dense_0": {"dot_general_0": {"activation": {"amax": 1.5 + step}}}}


def killed_run(logdir, steps, torn_step):
    """A run that logged ``steps`` and was killed while writing ``torn_step``'s line."""
    with StatsLogger(logdir, tensorboard=False) as log:
        for s in steps:
            log.write(s, stats(s))
    line = json.dumps({"step": torn_step, "stats": {TAG: 1.5 + torn_step}}) + "\n"
    with open(logdir / "stats.jsonl", "a", encoding="utf-8") as f:
        f.write(line[:25])  # the bytes the kill left on disk: no closing brace, no newline
    return (logdir / "stats.jsonl").read_bytes()


def test_a_resumed_logger_starts_a_new_line_and_the_report_reads_every_step(tmp_path, capsys):
    before = killed_run(tmp_path, (0, 1), torn_step=2)
    with pytest.warns(UserWarning, match=r"stats.jsonl.*torn"):
        log = StatsLogger(tmp_path, tensorboard=False)  # the resumed run
    with log:
        log.write(2, stats(2))
        log.write(3, stats(3))
    assert (tmp_path / "stats.jsonl").read_bytes().startswith(before)  # nothing lost
    with pytest.warns(UserWarning, match=r"stats.jsonl line 3 .*torn.*skipped"):
        records = read_log(tmp_path)
    assert records == [(0, {TAG: 1.5}), (1, {TAG: 2.5}), (2, {TAG: 3.5}), (3, {TAG: 4.5})]
    with pytest.warns(UserWarning, match="torn"):
        assert main(["debug", str(tmp_path), "--metric", "amax", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["amax"]
    assert (row["value"], row["step"]) == (4.5, 3)


def test_a_record_glued_to_a_torn_line_is_read(tmp_path):
    """A log resumed by a writer that did not end the torn line (an older fmtkit): the
    resumed step's record follows the torn bytes on the same line and is still read."""
    killed_run(tmp_path, (0,), torn_step=1)
    with open(tmp_path / "stats.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 1, "stats": {TAG: 2.5}}) + "\n")
    with pytest.warns(UserWarning, match=r"line 2 .*torn"):
        assert read_log(tmp_path) == [(0, {TAG: 1.5}), (1, {TAG: 2.5})]


def test_a_torn_decision_is_skipped_and_the_next_one_kept(tmp_path):
    with StatsLogger(tmp_path, tensorboard=False) as log:
        log.write(0, stats(0))
        log.log_decision(0, "Dense_0", "dot_general_0", "blockwise", "activation/sqnr_db", 3.0)
    with open(tmp_path / "decisions.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 1, "module": "De')  # killed while writing a decision
    with pytest.warns(UserWarning, match=r"decisions.jsonl.*torn"), \
            StatsLogger(tmp_path, tensorboard=False) as log:
        log.log_decision(1, "Dense_0", "dot_general_0", "compute", "activation/sqnr_db", 2.0)
    with pytest.warns(UserWarning, match=r"decisions.jsonl line 2 .*torn.*skipped"):
        got = read_decisions(tmp_path)
    assert [(d["step"], d["setting"], d["value"]) for d in got] == [
        (0, "blockwise", 3.0), (1, "compute", 2.0)]


def test_a_line_that_is_no_record_is_still_refused(tmp_path):
    (tmp_path / "stats.jsonl").write_text('{"step": 0, "stats": {}}\nnot json at all\n')
    with pytest.raises(ValueError, match="line 2 is not"):
        read_log(tmp_path)

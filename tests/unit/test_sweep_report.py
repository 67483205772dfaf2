"""sweep_report.py: the table, plot and report of a sweep's rows."""

import csv
import dataclasses

from test_sweep_rows import row

from dreambooth.sweep import sweep_report
from dreambooth.sweep import sweep_rows


def test_table_plot_and_report_mark_the_chosen_trials_and_list_failed_ones(tmp_path):
    scores = {"dino": 0.5, "clip_i": 0.6, "clip_t": 0.3, "div": 0.2, "pres": 0.4}
    base = {"a": scores, "c": scores}
    rows = [row("a", 0.6, 0.29), row("a", 0.7, 0.30), dataclasses.replace(row("c", None, None, "failed: boom"), model=None)]
    best = sweep_rows.choose(rows, base, 0.02)
    written = sweep_report.write_all(str(tmp_path), rows, base, best, 0.02)
    with open(tmp_path / "trials.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["subject"], r["dino"], r["chosen"], r["status"]) for r in table] == [
        ("a", "0.7", "True", "ok"), ("a", "0.6", "False", "ok"), ("c", "", "False", "failed: boom")]
    assert "| **yes** |" in open(written["table"]).read()
    report = open(written["report"]).read()
    assert "| a | chosen | lr 0.0001, 4 steps, text encoder on | 0.700 |" in report
    assert "| c | (every trial failed) |" in report
    from PIL import Image

    assert Image.open(written["plot"]).size == (700, 500)

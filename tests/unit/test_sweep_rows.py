"""sweep_rows.py: the sweep's results as typed rows, how trials rank, each subject's choice."""

import dataclasses

from dreambooth.sweep import sweep_rows


def row(subject, dino, clip_t, status="ok", model=None):
    return sweep_rows.TrialRow(subject, 1e-4, True, rank=4, step=4, model=model or f"{subject}-{dino}-{clip_t}",
                               dino=dino, clip_i=0.5, clip_t=clip_t, div=0.1, pres=0.3, status=status)


def test_best_is_the_highest_dino_within_the_clip_t_margin_of_the_base():
    base = {"a": {"clip_t": 0.30}, "b": {"clip_t": 0.30}, "c": {"clip_t": 0.3}}
    rows = [row("a", 0.9, 0.25), row("a", 0.7, 0.29), row("a", 0.6, 0.31),
            row("b", 0.8, 0.10), row("b", 0.5, 0.20),
            dataclasses.replace(row("c", None, None, status="failed: out of memory"), model=None)]
    best = sweep_rows.choose(rows, base, margin=0.02)
    assert best["a"].row.dino == 0.7 and best["a"].within_margin  # 0.9 forgets the prompt
    assert best["b"].row.dino == 0.8 and not best["b"].within_margin  # none kept CLIP-T: flagged
    assert "c" not in best
    assert sweep_rows.choose(rows, base, margin=0.06)["a"].row.dino == 0.9
    # --holdout: ranked by DINO against the photos the trials never saw
    held = [dataclasses.replace(r, dino_holdout=h) for r, h in zip(rows[:3], (0.5, 0.6, 0.4))]
    best = sweep_rows.choose(held, {"a": base["a"]}, margin=0.06)["a"]
    assert best.row.dino == 0.7 and best.ranked_by == "dino_holdout"


def test_a_trial_stopped_early_says_where_in_the_table():
    from types import SimpleNamespace

    import pandas as pd

    def result(lr, steps, error=None):
        frame = pd.DataFrame([{"step": s, "model": f"m{lr}-{s}", **{k: 0.5 for k in sweep_rows.METRICS}} for s in steps])
        return SimpleNamespace(config={"subject": "a", "learning_rate": lr, "rank": 4, "train_text_encoder": True,
                                       "use_lora": False}, metrics_dataframe=frame, error=error)

    rows = sweep_rows.collect([result(1e-4, [2, 4]), result(1e-5, [2])], last_step=4)
    assert [r.note for r in rows] == [None, None, "stopped early at step 2 (behind the others there)"]

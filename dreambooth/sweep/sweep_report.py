"""sweep.py's outputs: the table of every trial, the DINO/CLIP-T scatter plot and the report across subjects."""

import csv
import dataclasses
import os

from dreambooth.evaluation import scores

COLUMNS = ("subject", "learning_rate", "train_text_encoder", "rank", "step", "dino", "clip_i", "clip_t", "div",
           "pres", "dino_holdout", "clip_i_holdout", "status", "note", "chosen", "model")


def _format(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:.3g}" if value < 0.01 else f"{value:.3f}"
    return str(value)


def table_rows(rows, best):
    """The table's rows ({column: value}) of sweep_rows.TrialRows: sorted by subject, then DINO
    (failed trials last), with the chosen ones marked."""
    chosen = {(c.row.subject, c.row.model) for c in best.values()}
    marked = [{**dataclasses.asdict(r), "chosen": (r.subject, r.model) in chosen} for r in rows]
    return sorted(marked, key=lambda r: (r["subject"], r["status"] != "ok", -(r["dino"] or 0)))


def write_table(folder, rows, best):
    """trials.csv (every value) and trials.md (the same, readable); returns trials.md's path."""
    rows = table_rows(rows, best)
    with open(os.path.join(folder, "trials.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(("**yes**" if r[c] else "") if c == "chosen" else _format(r.get(c))
                                for c in COLUMNS) + " |" for r in rows]
    path = os.path.join(folder, "trials.md")
    with open(path, "w") as f:
        f.write("# Sweep trials\n\nOne row per trial and step count scored; failed trials with their error.\n\n"
                + "\n".join(lines) + "\n")
    return path


def write_plot(folder, rows, base, best, margin):
    """sweep.png: DINO against CLIP-T of every scored trial, each subject's base model and the
    CLIP-T floor the choice respects; the chosen trials ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 5), dpi=100)
    for i, subject in enumerate(base):
        color = f"C{i % 10}"
        scored = [r for r in rows if r.subject == subject and r.scored]
        axis.scatter([r.clip_t for r in scored], [r.dino for r in scored], color=color, label=subject)
        axis.scatter([base[subject]["clip_t"]], [base[subject]["dino"]], color=color, marker="x", s=80)
        axis.axvline(base[subject]["clip_t"] - margin, color=color, linestyle=":", alpha=0.6)
        if subject in best:
            axis.scatter([best[subject].row.clip_t], [best[subject].row.dino], s=250, facecolors="none",
                         edgecolors=color, linewidths=2)
    axis.set_xlabel("CLIP-T (prompt fidelity)")
    axis.set_ylabel("DINO (subject fidelity)")
    axis.set_title("trials (dots), base model (x), chosen (ring), CLIP-T floor (dotted)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    fig.tight_layout()
    path = os.path.join(folder, "sweep.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(folder, base, best, margin):
    """report.md: each subject's chosen model beside its base model, and the paper's values for SD."""
    lines = ["# DreamBooth sweep", "", f"The chosen trial of each subject has the highest DINO among those with "
             f"CLIP-T at least the base model's minus {margin:g}.", "",
             "| subject | model | settings | DINO | CLIP-I | CLIP-T | DIV | PRES |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for subject, base_scores in base.items():
        cells = lambda s: " | ".join(_format(s.get(k)) for k in scores.SCORE_NAMES + ("pres",))  # noqa: E731
        lines.append(f"| {subject} | base | | {cells(base_scores)} |")
        choice = best.get(subject)
        if choice is None:
            lines.append(f"| {subject} | (every trial failed) | | | | | | |")
            continue
        row = choice.row
        settings = (f"lr {row.learning_rate:.3g}, {row.step} steps, text encoder {_format(row.train_text_encoder)}"
                    + ("" if choice.within_margin else ", **outside the margin**"))
        lines.append(f"| {subject} | chosen | {settings} | {cells(row.scores())} |")
    paper = scores.PAPER_SD
    lines.append(f"| | paper, SD DreamBooth | | {paper['dino']:.3f} | {paper['clip_i']:.3f} | {paper['clip_t']:.3f} | | |")
    path = os.path.join(folder, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def write_all(folder, rows, base, best, margin):
    """trials.csv and .md, sweep.png and report.md of sweep_rows.TrialRows, the base model's scores of
    each subject and each subject's sweep_rows.Choice."""
    return {"table": write_table(folder, rows, best), "plot": write_plot(folder, rows, base, best, margin),
            "report": write_report(folder, base, best, margin)}

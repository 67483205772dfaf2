"""The record of a training run in its folder under --storage_path: metrics.jsonl (rank 0,
a line per logging window), the --report_to trackers' runs (trackers.py), and loss.png
drawn from metrics.jsonl at the end."""

import json
import os
import time

METRICS_FILE = "metrics.jsonl"


class RunLog:
    """Rank 0's record of a run in its folder: one JSON line per logging window in
    metrics.jsonl (with the wall-clock time it ended), and the same scalars, the validation
    images and the run's settings in the --report_to trackers (trackers.py)."""

    def __init__(self, plan, continues=False):
        """continues: the run goes on from a checkpoint (its trackers' runs go on too)."""
        from dreambooth import trackers

        self.folder = plan.run_dir
        os.makedirs(self.folder, exist_ok=True)
        previous = None
        if continues:  # this run folder's own record (a restarted worker group), else the resumed run's
            previous = trackers.read_record(self.folder) or trackers.read_record(
                os.path.dirname(plan.resume_path) if plan.resume_path else None)
        self.trackers = list(trackers.open_trackers(plan, self.folder, previous).values())

    def write(self, metrics):
        with open(os.path.join(self.folder, METRICS_FILE), "a") as f:
            f.write(json.dumps({**metrics, "time": time.time()}) + "\n")
        for tracker in self.trackers:
            tracker.scalars(metrics["step"], {f"train/{name}": metrics[name] for name in ("loss", "lr", "images_per_s")})

    def write_images(self, step, timeline, images):
        """A validation round's images (name -> PIL image)."""
        for tracker in self.trackers:
            tracker.images(step, {f"validation/{name}": image for name, image in images.items()})

    def close(self):
        for tracker in self.trackers:
            tracker.close()


def plot_metrics(metrics_file):
    """loss.png beside metrics_file: the run's logged loss and learning rate against the
    step. None when there is nothing to plot."""
    if not os.path.isfile(metrics_file):
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    with open(metrics_file) as f:
        rows = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["step"])
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, loss_axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    loss_axis.plot(steps, [r["loss"] for r in rows], color="tab:blue", marker=".", label="loss")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss (mean over the logging window)", color="tab:blue")
    lr_axis = loss_axis.twinx()
    lr_axis.plot(steps, [r["lr"] for r in rows], color="tab:orange", label="learning rate")
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    lr_axis.set_ylim(bottom=0)
    loss_axis.set_title(os.path.basename(os.path.dirname(metrics_file)))
    loss_axis.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(os.path.dirname(metrics_file), "loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path

"""The record of a training run in its folder under --storage_path: metrics.jsonl (rank 0,
a line per logging window), TensorBoard events with --report_to tensorboard, and loss.png
drawn from metrics.jsonl at the end."""

import json
import os
import time

METRICS_FILE = "metrics.jsonl"


class RunLog:
    """Rank 0's record of a run in its folder: one JSON line per logging window in
    metrics.jsonl (with the wall-clock time it ended), and with --report_to tensorboard
    the same scalars and the validation images as TensorBoard events in tensorboard/."""

    def __init__(self, plan):
        self.folder = os.path.join(plan.storage_path, plan.run_name)
        os.makedirs(self.folder, exist_ok=True)
        self.writer = None
        if plan.report_to == "tensorboard":
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(os.path.join(self.folder, "tensorboard"))

    def write(self, metrics):
        with open(os.path.join(self.folder, METRICS_FILE), "a") as f:
            f.write(json.dumps({**metrics, "time": time.time()}) + "\n")
        if self.writer:
            for name in ("loss", "lr", "images_per_s"):
                self.writer.add_scalar(f"train/{name}", metrics[name], metrics["step"])
            self.writer.flush()

    def write_images(self, step, timeline, images):
        """A validation round's images (name -> PIL image) as TensorBoard images."""
        if self.writer:
            import numpy as np

            for name, image in images.items():
                self.writer.add_image(f"validation/{name}", np.asarray(image), step, dataformats="HWC")
            self.writer.flush()

    def close(self):
        if self.writer:
            self.writer.close()


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

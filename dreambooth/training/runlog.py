"""The record of a training run in its folder under --storage_path: metrics.jsonl (rank 0,
a line per logging window), the --report_to trackers' runs (trackers.py), and loss.png
drawn from metrics.jsonl at the end."""

import contextlib
import json
import os
import time

from dreambooth.storage import runfiles

METRICS_FILE = "metrics.jsonl"


class RunLog:
    """Rank 0's record of a run in its folder: one JSON line per logging window in
    metrics.jsonl (with the wall-clock time it ended), and the same scalars, the validation
    images and the run's settings in the --report_to trackers (trackers.py)."""

    def __init__(self, plan, start_step=0):
        """start_step: the step of the checkpoint the run goes on from (its trackers' runs go on too), else 0."""
        from dreambooth.training import trackers

        self.folder = plan.run_dir
        os.makedirs(self.folder, exist_ok=True)
        resumed = runfiles.run_of_checkpoint(plan.resume_path) if start_step else None
        keep_rows_until(start_step, os.path.join(self.folder, METRICS_FILE), resumed)
        previous = None
        if start_step:  # this run folder's own record (a restarted worker group), else the resumed run's
            previous = runfiles.read_record(self.folder) or runfiles.read_record(resumed)
        self.trackers = list(trackers.open_trackers(plan, self.folder, previous).values())

    def write(self, metrics):
        with open(os.path.join(self.folder, METRICS_FILE), "a") as f:
            f.write(json.dumps({**metrics, "time": time.time()}) + "\n")
        for tracker in self.trackers:
            tracker.scalars(metrics["step"], {f"train/{name}": metrics[name] for name in ("loss", "lr", "images_per_s",
                                                                                         "workers") if name in metrics})

    def write_scores(self, step, scores):
        """A scored step's scores (checkpoint_scores; None: its scoring failed): a metrics.jsonl row of their own and
        the trackers' scores/ scalars at that step."""
        if scores is None:
            return
        append_scores(os.path.join(self.folder, METRICS_FILE), step, scores)
        for tracker in self.trackers:
            tracker.scalars(step, {f"scores/{name}": value for name, value in scores.items()})

    def write_images(self, step, timeline, images):
        """A validation round's images (name -> PIL image)."""
        for tracker in self.trackers:
            tracker.images(step, {f"validation/{name}": image for name, image in images.items()})

    def close(self):
        for tracker in self.trackers:
            tracker.close()


def append_scores(metrics_file, step, scores):
    """A scored step's row of metrics.jsonl: its step, scores and the time they were logged."""
    with open(metrics_file, "a") as f:
        f.write(json.dumps({"step": step, **scores, "time": time.time()}) + "\n")


def scored_steps(metrics_file):
    """The steps metrics_file has scores of (--score_steps' rows)."""
    return {row["step"] for row in read_rows(metrics_file, "dino")}


def keep_rows_until(step, metrics_file, resumed_folder=None):
    """A run going on from its checkpoint at step (0: from the start) keeps the metrics rows up to that step,
    so that its metrics.jsonl and loss.png tell the whole run: in its own folder (a restarted worker group:
    the rows logged after the checkpoint are logged again), else, in a new one, the resumed run's
    (resumed_folder, a bucket's too), which it goes on from."""
    import tempfile

    from dreambooth import storage

    with tempfile.TemporaryDirectory() as fetched:
        source = metrics_file
        if not os.path.isfile(source) and resumed_folder:
            source = storage.fetch(resumed_folder, METRICS_FILE, fetched)
        if not os.path.isfile(source):
            return
        with open(source) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(metrics_file + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(metrics_file + ".tmp", metrics_file)


BLUE, ORANGE, INK, GRID = (31, 119, 180), (255, 127, 14), (40, 40, 40), (225, 225, 225)


def read_rows(metrics_file, key):
    """metrics_file's rows that hold key ("loss": the logging windows', "dino": the scored steps'), in step order;
    [] without the file."""
    if not os.path.isfile(metrics_file):
        return []
    with open(metrics_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted((r for r in rows if key in r), key=lambda r: r["step"])


AREA = (80, 50, 720, 400)  # left, top, right, bottom of a plot's area in its 800 x 450 px image


def scale(value, marks, low, high):
    """Where value falls between low and high (pixels) on an axis of marks (ticks)."""
    return low + (value - marks[0]) / ((marks[-1] - marks[0]) or 1) * (high - low)


def new_plot(steps, values, value_format, value_colour):
    """(image, draw) of an 800 x 450 px plot: its step axis and left value axis, with the marks steps and values
    (ticks), gridded and labelled, and its area framed."""
    from PIL import Image
    from PIL import ImageDraw

    image = Image.new("RGB", (800, 450), "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = AREA
    for value in steps:
        x = scale(value, steps, left, right)
        draw.line([(x, top), (x, bottom)], fill=GRID)
        draw.text((x, bottom + 8), f"{value:g}", fill=INK, anchor="mt")
    for value in values:
        y = scale(value, values, bottom, top)
        draw.line([(left, y), (right, y)], fill=GRID)
        draw.text((left - 8, y), f"{value:{value_format}}", fill=value_colour, anchor="rm")
    draw.rectangle(AREA, outline=INK)
    return image, draw


def save_plot(image, draw, metrics_file, name, step_label):
    """The plot titled with its run folder's name, its step axis named step_label, saved as name beside
    metrics_file; its path."""
    draw.text((400, 16), os.path.basename(os.path.dirname(metrics_file)), fill=INK, anchor="mm")
    draw.text((400, 432), step_label, fill=INK, anchor="mm")
    path = os.path.join(os.path.dirname(metrics_file), name)
    image.save(path)
    return path


def plot_metrics(metrics_file):
    """loss.png beside metrics_file: the run's logged loss (left axis) and learning rate (right axis, from 0)
    against the step, 800 x 450 px. None when there is nothing to plot. Drawn with PIL, not matplotlib: importing
    matplotlib was most of a second at the end of every run."""
    rows = read_rows(metrics_file, "loss")  # (not --score_steps' rows)
    if not rows:
        return None
    left, top, right, bottom = AREA
    axes = {"step": ticks([r["step"] for r in rows], from_zero=False),
            "loss": ticks([r["loss"] for r in rows], from_zero=False),
            "lr": ticks([r["lr"] for r in rows], from_zero=True)}
    image, draw = new_plot(axes["step"], axes["loss"], ".4g", BLUE)
    for value in axes["lr"]:
        draw.text((right + 8, scale(value, axes["lr"], bottom, top)), f"{value:.3g}", fill=ORANGE, anchor="lm")
    for key, colour in (("lr", ORANGE), ("loss", BLUE)):
        points = [(scale(r["step"], axes["step"], left, right), scale(r[key], axes[key], bottom, top)) for r in rows]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        if key == "loss":
            for x, y in points:
                draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
    draw.text((left, top - 12), "loss (mean over the logging window)", fill=BLUE, anchor="ls")
    draw.text((right, top - 12), "learning rate", fill=ORANGE, anchor="rs")
    return save_plot(image, draw, metrics_file, "loss.png", "optimizer step")


GREEN = (44, 160, 44)
PURPLE = (148, 103, 189)  # (the best step's mark: seen on the frame too, where the last step is)
SCORE_LINES = (("dino", "DINO", BLUE), ("clip_i", "CLIP-I", GREEN), ("clip_t", "CLIP-T", ORANGE))


def plot_scores(metrics_file, base_clip_t=None, margin=None, best=None):
    """scores.png beside metrics_file: DINO, CLIP-I and CLIP-T of each scored step (--score_steps' rows) against
    the step, on one axis, 800 x 450 px, with base_clip_t (the base model's CLIP-T) dashed lines at it and at
    margin below it, the floor of the best step's rule, and best ((step, "kept" or "best")) a dashed upright line at
    the best-scored step; None when no step was scored."""
    rows = read_rows(metrics_file, "dino")
    if not rows:
        return None
    left, top, right, bottom = AREA
    levels = [] if base_clip_t is None else [(base_clip_t, "base CLIP-T")] + (
        [(base_clip_t - margin, f"base CLIP-T - {margin:g}")] if margin else [])
    steps = ticks([r["step"] for r in rows], from_zero=False)
    values = ticks([r[key] for r in rows for key, _, _ in SCORE_LINES] + [level for level, _ in levels], from_zero=False)
    image, draw = new_plot(steps, values, ".3g", INK)
    for index, (level, label) in enumerate(levels):
        y = scale(level, values, bottom, top)
        for x in range(left, right, 12):
            draw.line([(x, y), (min(x + 6, right), y)], fill=SCORE_LINES[2][2], width=1)
        # (the base's label above its line, the floor's below its own: two close lines' labels never overlap)
        draw.text((right - 4, y - 3 if index == 0 else y + 3), label, fill=SCORE_LINES[2][2],
                  anchor="rs" if index == 0 else "rt")
    if best is not None:
        x = scale(best[0], steps, left, right)
        for y in range(top, bottom, 12):
            draw.line([(x, y), (x, min(y + 6, bottom))], fill=PURPLE, width=2)
        draw.text((min(x + 4, right - 90), top + 4), f"{best[1]}: step {best[0]}", fill=PURPLE, anchor="lt")
    for index, (key, label, colour) in enumerate(SCORE_LINES):
        points = [(scale(r["step"], steps, left, right), scale(r[key], values, bottom, top)) for r in rows]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.text((left + 110 * index, top - 12), label, fill=colour, anchor="ls")
    return save_plot(image, draw, metrics_file, "scores.png", "optimizer step (the checkpoint scored)")


def ticks(values, from_zero):
    """Round axis marks (1, 2, 2.5 or 5 times a power of ten apart) from below the lowest value (0 when
    from_zero) to above the highest, at least two."""
    import math

    low, high = (0.0 if from_zero else min(values)), max(values)
    if high - low <= abs(high) * 1e-9:  # one value: a span around it (or up to it, from zero)
        spread = abs(high) * 0.1 or 1.0
        low, high = (0.0, high or 1.0) if from_zero else (low - spread, high + spread)
    raw = (high - low) / 5
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [round(i * step, 12) for i in range(first, max(last, first + 1) + 1)]


IMAGE_COLUMNS = ("_pixels", "_latents")  # the batch columns that hold one image per row


class ReportWindow:
    """The steps since the last report: their losses (kept on the device until the report, the
    window's one sync point), the images they trained on, and the training time (sampling paused);
    checkpoint_s: the seconds the steps stopped for the checkpoint that began it, if one did (its save, and its
    upload unless --checkpoint_upload sends it in the background)."""

    def __init__(self, world, elastic=False):
        self.world, self.checkpoint_s, self.elastic = world, None, elastic
        self.reset()

    def reset(self):
        self.losses, self.images, self.start = [], 0, time.perf_counter()

    def add(self, loss, micro_batches):
        self.losses.append(loss)
        self.images += sum(v.shape[0] for b in micro_batches for k, v in b.items() if k.endswith(IMAGE_COLUMNS))

    @contextlib.contextmanager
    def paused(self):
        """A block whose time does not count as training time (validation samples)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began

    def metrics(self, state, steps_per_epoch):
        """The report's metrics of the window, which starts again."""
        import torch

        elapsed = time.perf_counter() - self.start
        metrics = {"step": state.step, "epoch": (state.step - 1) // steps_per_epoch,
                   "loss": torch.stack(self.losses).mean().item(),
                   "lr": state.lr_scheduler.get_last_lr()[0],
                   "images_per_s": self.images * self.world / max(elapsed, 1e-9)}
        if self.elastic:  # (how many workers trained the window: an elastic run's size as it went)
            metrics["workers"] = self.world
        if state.skipped_steps:
            metrics["skipped_steps"] = state.skipped_steps
        if self.checkpoint_s is not None:
            metrics["checkpoint_s"], self.checkpoint_s = round(self.checkpoint_s, 3), None
        self.reset()
        return metrics

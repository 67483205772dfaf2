"""The image math of training, in plain functions tested without Ray: cover-resizes, crops and flips
of each row's view, aspect-ratio buckets (--enable_bucket) and SDXL's size/crop conditioning, and
the rows of a whole run, every choice drawn from --seed; contact sheets of drawn images."""

import math
import os

import numpy as np

from dreambooth import files

# ---------------------------------------------------------------- image math


def hw(size):
    """(height, width) of a training size: an int (a square) or a (height, width) bucket."""
    return (size, size) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))


def resize_to_cover(image, size):
    """(H, W[, C]) uint8 -> uint8 just large enough to cover size (aspect kept, bicubic): a square
    size makes the shorter side that size."""
    from PIL import Image

    new_h, new_w = covering_shape(image.shape[:2], size)
    new_size = (new_w, new_h)
    if new_size == image.shape[1::-1]:
        return image
    return np.asarray(Image.fromarray(image).resize(new_size, Image.BICUBIC))


def covering_shape(shape, size):
    """(height, width) of an image of shape once resize_to_cover has fitted it to size."""
    (target_h, target_w), (height, width) = hw(size), shape
    scale = max(target_h / height, target_w / width)
    return max(target_h, round(height * scale)), max(target_w, round(width * scale))


def resize_shorter_side(image, size):
    """(H, W, 3) uint8 -> uint8 with min(H, W) == size, aspect kept (bicubic)."""
    return resize_to_cover(image, size)


def crop_offsets(height, width, size, center, rng):
    """(top, left) of a size crop (an int: square; or (height, width)) of a height x width image:
    centered or at random."""
    crop_h, crop_w = hw(size)
    if center:
        return (height - crop_h) // 2, (width - crop_w) // 2
    return int(rng.integers(0, height - crop_h + 1)), int(rng.integers(0, width - crop_w + 1))


def crop_square(image, size, center, rng):
    """(H, W, C) covering size -> the size crop (C kept): centered or at a random offset."""
    top, left = crop_offsets(*image.shape[:2], size, center, rng)
    crop_h, crop_w = hw(size)
    return image[top:top + crop_h, left:left + crop_w]


def mirrored_left(width, left, size):
    """The left edge of a crop once the image is flipped: counted from the other side."""
    return width - left - hw(size)[1]


def view_and_crop(image, size, center_crop, random_flip, rng):
    """One training view of a stored image: crop, maybe flip. (H, W, C) -> ((h, w, C) uint8 of
    size, (top, left)): where the view's top-left corner lies in the stored image as the view
    shows it (a flipped view's left is counted from the mirrored side), SDXL's crop numbers."""
    height, width = image.shape[:2]
    top, left = crop_offsets(height, width, size, center_crop, rng)
    crop_h, crop_w = hw(size)
    out = image[top:top + crop_h, left:left + crop_w]
    if random_flip and rng.random() < 0.5:
        out, left = out[:, ::-1], mirrored_left(width, left, size)
    return np.ascontiguousarray(out), (top, left)


def view(image, size, center_crop, random_flip, rng):
    """One training view of a stored image: crop, maybe flip. (H, W, 3) -> (size, size, 3) uint8."""
    return view_and_crop(image, size, center_crop, random_flip, rng)[0]


# ---------------------------------------------------------------- aspect-ratio buckets


def bucket_sizes(resolution, min_reso, max_reso, step):
    """--enable_bucket's (height, width) sizes: multiples of step within [min_reso, max_reso], each
    at most resolution x resolution pixels and as close to it as the step allows, in both
    orientations; the square resolution x resolution among them. Sorted, widest first."""
    area = resolution * resolution
    sizes = {(resolution, resolution)}
    for width in range(min_reso, max_reso + 1, step):
        height = min(max_reso, area // width // step * step)
        if height >= min_reso:
            sizes.update({(height, width), (width, height)})
    return sorted(sizes, key=lambda s: (s[0] / s[1], s[0]))


def bucket_for(height, width, buckets):
    """Index of the bucket whose aspect ratio is nearest the image's (on a log scale: 2:1 is as far
    from 1:1 as 1:2); a tie goes to the larger bucket."""
    aspect = np.log(height / width)
    return min(range(len(buckets)), key=lambda b: (abs(np.log(buckets[b][0] / buckets[b][1]) - aspect),
                                                   -buckets[b][0] * buckets[b][1]))


def plan_bucket_rows(instance_buckets, num_class, num_epochs, seed, batch_size):
    """plan_rows for --enable_bucket: every block of batch_size consecutive rows holds one bucket.

    An epoch pairs instances and class images as plan_rows does, then groups its rows by their
    instance's bucket (instance_buckets: the bucket index of each instance image); a group that does
    not fill its last block is topped up with rows of its own drawn again. Blocks are shuffled by
    (seed, epoch). Each row also carries "bucket". Returns the rows, block after block."""
    rows = []
    for epoch_rows in _epochs(plan_rows(len(instance_buckets), num_class, num_epochs, seed)):
        epoch = epoch_rows[0]["epoch"]
        rng = np.random.default_rng([seed, epoch, 1])
        groups = {}
        for row in epoch_rows:
            bucket = int(instance_buckets[row["instance"]])
            groups.setdefault(bucket, []).append({**row, "bucket": bucket})
        blocks = []
        for _, group in sorted(groups.items()):
            short = -len(group) % batch_size
            group = group + [dict(group[k], seed=int(rng.integers(0, 2**31)))
                             for k in rng.integers(0, len(group), short)]
            blocks += [group[k:k + batch_size] for k in range(0, len(group), batch_size)]
        for k in rng.permutation(len(blocks)):
            rows += blocks[k]
    return rows


def _epochs(rows):
    """plan_rows' rows cut into their epochs."""
    epochs = {}
    for row in rows:
        epochs.setdefault(row["epoch"], []).append(row)
    return [epochs[e] for e in sorted(epochs)]


def bucket_epoch_rows(instance_buckets, num_class, batch_size):
    """Rows of one epoch of plan_bucket_rows (each bucket's rows rounded up to whole blocks; the
    count does not depend on the seed)."""
    return len(plan_bucket_rows(instance_buckets, num_class, 1, 0, batch_size))


def time_ids(original_size, crop, size):
    """SDXL's six size/crop numbers of a view: the photo's original height and width (before any
    resize), the crop's top and left in the resized image, the trained height and width."""
    return np.array([*original_size, *crop, *hw(size)], dtype=np.float32)


def plan_rows(num_instance, num_class, num_epochs, seed):
    """The training rows of a whole run, epoch after epoch, as indices into the image lists.

    An epoch has max(num_instance, num_class) rows (num_instance without class images):
    row k pairs instance k % num_instance with class k % num_class, so every image of the
    larger set appears once and the smaller set repeats evenly. Each epoch's order, and each
    row's augmentation seed, come from a generator seeded by (seed, epoch): the same run
    gets the same rows, whichever worker reads them and whenever it resumes.
    Returns [{"epoch", "instance", "seed"[, "class"]}].
    """
    num_rows = max(num_instance, num_class)
    rows = []
    for epoch in range(num_epochs):
        rng = np.random.default_rng([seed, epoch])
        for k, row_seed in zip(rng.permutation(num_rows), rng.integers(0, 2**31, num_rows)):
            row = {"epoch": epoch, "instance": int(k % num_instance), "seed": int(row_seed)}
            if num_class:
                row["class"] = int(k % num_class)
            rows.append(row)
    return rows


def make_grid(images, thumb_size=128, columns=None):
    """Contact sheet: images (PIL, any size) as thumb_size squares, columns to a row
    (default: a near-square grid)."""
    from PIL import Image

    cols = columns or max(1, math.ceil(math.sqrt(len(images))))
    rows = max(1, math.ceil(len(images) / cols))
    sheet = Image.new("RGB", (cols * thumb_size, rows * thumb_size), "white")
    for k, image in enumerate(images):
        thumb = image.convert("RGB").resize((thumb_size, thumb_size))
        sheet.paste(thumb, ((k % cols) * thumb_size, (k // cols) * thumb_size))
    return sheet


LABEL_WIDTH = 64  # px of the strip left of a sheet's rows that names each


def labelled_rows(sheet, labels, row_height):
    """sheet with a white strip on its left naming each of its rows (labels, top to bottom, row_height px each)."""
    from PIL import Image
    from PIL import ImageDraw

    out = Image.new("RGB", (sheet.width + LABEL_WIDTH, sheet.height), "white")
    out.paste(sheet, (LABEL_WIDTH, 0))
    draw = ImageDraw.Draw(out)
    for row, label in enumerate(labels):
        draw.text((4, row * row_height + row_height // 2 - 5), label, fill="black")
    return out


def write_prompt_grids(output_dir, label, paths_by_prompt):
    """grids/<label>/<prompt slug>.png: the images of each prompt in one row (paths_by_prompt: {prompt: [paths]})."""
    from PIL import Image

    folder = os.path.join(output_dir, "grids", label)
    os.makedirs(folder, exist_ok=True)
    for prompt, paths in paths_by_prompt.items():
        if paths:
            images = [Image.open(p).convert("RGB") for p in paths]
            files.save_image_atomic(make_grid(images, columns=len(images)),
                                    os.path.join(folder, files.slugify(prompt) + ".png"))


def write_grid(path, image_files):
    """A contact sheet of the image files that exist among image_files (one withheld by the safety checker is
    not there), saved to path."""
    from PIL import Image

    images = []
    for name in image_files:
        if os.path.exists(name):
            with Image.open(name) as image:
                images.append(image.copy())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    files.save_image_atomic(make_grid(images), path)
    return path


def to_model_input(pixels):
    """(B, H, W, 3) uint8 in [0, 255] -> (B, 3, H, W) float32 in [-1, 1], on pixels' device.

    Pixels travel as uint8 (a quarter of float32's bytes) and are scaled on the device;
    the permuted tensor is channels-last in memory, the layout NHWC convolutions want.
    """
    return pixels.permute(0, 3, 1, 2).float() / 127.5 - 1.0

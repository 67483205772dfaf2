"""The training data pipeline on Ray Data.

    instance + class folders ─ decoded on the driver: upright, resize [─ VAE posteriors, actor pool]
        └─ object store (each image once)
    plan_rows: index rows of the whole run ─ from_pandas ─ crop + flip by each row's seed
        ─ streaming split over the Ray Train workers (uint8 pixels, scaled on the device)

An epoch has max(#instance, #class) rows, each one instance image and, with prior
preservation, one class image: instances repeat to cover every class image and, when
instances outnumber class images, class images repeat instead. Every random choice (the
order of each epoch, each row's crop and flip) is drawn from --seed, so a run, a resumed
run and a restarted worker group all see the same stream. The image math is in plain
functions, tested without Ray.
"""

import hashlib
import os
import sys

import numpy as np

import outputs
import utils


# EXIF orientation tag -> (number of 90-degree counter-clockwise turns, mirror first)
_ORIENTATIONS = {1: (0, False), 2: (0, True), 3: (2, False), 4: (2, True),
                 5: (1, True), 6: (3, False), 7: (3, True), 8: (1, False)}


# ---------------------------------------------------------------- files


SUBJECT_FILE = "subject.json"  # sweep.py --subjects_dir: a subject's class and token, beside its photos
# Files the suite writes beside images (not images, not worth a warning): the record of what drew
# generated images, generate.py's settings, sweep.py's subject file.
OWN_FILES = (SUBJECT_FILE, outputs.IMAGES_RECORD, outputs.IMAGES_CONFIG)


MASK_SUFFIX = ".mask.png"  # --masked_loss: "photo.mask.png" beside "photo.jpg" weights its loss


def is_mask(name):
    return name.lower().endswith(MASK_SUFFIX)


def list_images(folder, role, also_expected=None):
    """Sorted image files directly inside folder; other files are skipped with a warning,
    except those ending in also_expected (captions beside the images). Masks (MASK_SUFFIX) are
    never images."""
    if not os.path.isdir(folder):
        raise utils.UserError(f"{role} folder not found: {folder}")
    names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)) and not is_mask(n))
    images = [n for n in names if n.lower().endswith(utils.IMAGE_EXTENSIONS)]
    skipped = [n for n in names if n not in images and n not in OWN_FILES
               and not (also_expected and n.endswith(also_expected))]
    if skipped:
        print(f"warning: skipping {len(skipped)} non-image file(s) in {folder}: {', '.join(skipped[:10])}",
              file=sys.stderr)
    if not images:
        raise utils.UserError(f"{role} folder {folder} holds no images ({', '.join(utils.IMAGE_EXTENSIONS)})")
    return [os.path.join(folder, n) for n in images]


def normalize_image(image):
    """Any PIL image -> 8-bit RGB: transparency onto white, 16-bit scaled down, CMYK/palette/gray converted."""
    from PIL import Image

    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        high = 65535 if image.mode.startswith("I;16") else max(1, image.getextrema()[1])
        array = np.asarray(image, dtype=np.float64) * (255.0 / high)
        image = Image.fromarray(np.clip(array, 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image.convert("RGB")


def upright_rgb(image):
    """An open PIL image as training reads it: turned by its EXIF tag, then 8-bit RGB (normalize_image)."""
    from PIL import ImageOps

    return normalize_image(ImageOps.exif_transpose(image))


def needs_conversion(image):
    """True when a plain RGB conversion (load_image) would lose or garble the image."""
    return image.mode not in ("RGB", "L") or "transparency" in image.info


def inspect_images(paths, resolution, convert_dir):
    """Check every image on the driver before any worker starts; returns the paths to read.

    Corrupt or truncated files are named in a UserError. Images a plain RGB conversion cannot
    render faithfully (16-bit, transparent, CMYK, palette) are written, upright and as 8-bit RGB
    PNG, into convert_dir and read from there. Images smaller than the resolution are
    listed in a warning (they are upscaled).
    """
    from PIL import Image

    readable, small = [], []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
                if min(image.size) < resolution:
                    small.append(os.path.basename(path))
                if not needs_conversion(image):
                    readable.append(path)
                    continue
                upright = upright_rgb(image)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise utils.UserError(f"cannot read image {path}: {err}") from None
        os.makedirs(convert_dir, exist_ok=True)
        # A hash of the full path keeps copies of same-named files from different folders apart.
        digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
        stem = utils.slugify(os.path.splitext(os.path.basename(path))[0], max_len=80)
        converted = os.path.join(convert_dir, f"{stem}-{digest}{utils.IMAGE_SUFFIX}")
        utils.save_image_atomic(upright, converted)
        readable.append(converted)
    if small:
        print(f"warning: {len(small)} image(s) smaller than {resolution}px are upscaled: {', '.join(small[:10])}",
              file=sys.stderr)
    return readable


def exif_orientation(path):
    """The EXIF orientation tag of an image file (1 = upright, also when absent)."""
    from PIL import Image

    with Image.open(path) as image:
        return int(image.getexif().get(0x0112, 1) or 1)


# ---------------------------------------------------------------- masks (--masked_loss)


def has_alpha(image):
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (image.mode == "P" and "transparency" in image.info)


def mask_source(photo):
    """Where a photo's loss mask comes from: "photo.mask.png" beside it, else the photo itself when it
    has an alpha channel, else None (the photo counts everywhere)."""
    from PIL import Image

    beside = os.path.splitext(photo)[0] + MASK_SUFFIX
    if os.path.isfile(beside):
        return beside
    with Image.open(photo) as image:
        return photo if has_alpha(image) else None


def read_mask(source, photo):
    """(H, W) uint8 mask of a photo as it shows upright (white: the loss counts, black: it does not):
    the alpha channel of the photo itself, or a mask file of the photo's size (either way up)."""
    from PIL import Image

    orientation = exif_orientation(photo)
    with Image.open(photo) as image:
        raw_size = image.size[::-1]  # (height, width) as stored
    try:
        with Image.open(source) as image:
            alpha = image.convert("RGBA").getchannel("A") if has_alpha(image) else None
            # the photo's own transparency, or a mask file's: its alpha where it has one, else its gray
            use_alpha = source == photo or (alpha is not None and alpha.getextrema() != (255, 255))
            mask = np.asarray(alpha if use_alpha else image.convert("L"))
    except (OSError, SyntaxError, ValueError) as err:
        raise utils.UserError(f"cannot read mask {source}: {err}") from None
    upright = apply_orientation(np.zeros(raw_size, dtype=np.uint8), orientation).shape
    if mask.shape == raw_size and raw_size != upright:
        mask = apply_orientation(mask, orientation)  # drawn on the photo as stored: turned the same way
    if mask.shape != upright:
        raise utils.UserError(f"mask {source} is {mask.shape[1]}x{mask.shape[0]} px but its photo {photo} is "
                              f"{upright[1]}x{upright[0]}: draw the mask at the photo's size")
    return mask


def find_masks(photos):
    """Per photo, in order, (mask source, photo) or None, for --masked_loss (read_mask's arguments:
    the photo stays the original file, whose orientation the mask follows, even where training
    reads a converted copy); every mask read once to check it (UserError naming a mask that cannot
    be read or does not fit its photo)."""
    found = []
    for photo in photos:
        source = mask_source(photo)
        if source:
            read_mask(source, photo)
        found.append((source, photo) if source else None)
    return found


def masks_beside(photos):
    """The MASK_SUFFIX files beside photos (to say they are not used without --masked_loss)."""
    return [m for m in (os.path.splitext(p)[0] + MASK_SUFFIX for p in photos) if os.path.isfile(m)]


# ---------------------------------------------------------------- image math


def apply_orientation(image, orientation):
    """Turn an (H, W, C) array as its EXIF orientation says, so it displays upright."""
    turns, mirror = _ORIENTATIONS.get(orientation, (0, False))
    if mirror:
        image = image[:, ::-1]
    return np.ascontiguousarray(np.rot90(image, turns))


def resize_shorter_side(image, size):
    """(H, W, 3) uint8 -> uint8 with min(H, W) == size, aspect kept (bicubic)."""
    from PIL import Image

    height, width = image.shape[:2]
    scale = size / min(height, width)
    new_size = (max(size, round(width * scale)), max(size, round(height * scale)))
    if new_size == (width, height):
        return image
    return np.asarray(Image.fromarray(image).resize(new_size, Image.BICUBIC))


def crop_offsets(height, width, size, center, rng):
    """(top, left) of a size x size crop of a height x width image: centered or at random."""
    if center:
        return (height - size) // 2, (width - size) // 2
    return int(rng.integers(0, height - size + 1)), int(rng.integers(0, width - size + 1))


def crop_square(image, size, center, rng):
    """(H, W, C) with min(H, W) >= size -> (size, size, C): centered or at a random offset."""
    top, left = crop_offsets(*image.shape[:2], size, center, rng)
    return image[top:top + size, left:left + size]


def mirrored_left(width, left, size):
    """The left edge of a crop once the image is flipped: counted from the other side."""
    return width - left - size


def view_and_crop(image, size, center_crop, random_flip, rng):
    """One training view of a stored image: crop, maybe flip. (H, W, 3) -> ((size, size, 3)
    uint8, (top, left)): where the view's top-left corner lies in the stored image as the view
    shows it (a flipped view's left is counted from the mirrored side), SDXL's crop numbers."""
    height, width = image.shape[:2]
    top, left = crop_offsets(height, width, size, center_crop, rng)
    out = image[top:top + size, left:left + size]
    if random_flip and rng.random() < 0.5:
        out, left = out[:, ::-1], mirrored_left(width, left, size)
    return np.ascontiguousarray(out), (top, left)


def view(image, size, center_crop, random_flip, rng):
    """One training view of a stored image: crop, maybe flip. (H, W, 3) -> (size, size, 3) uint8."""
    return view_and_crop(image, size, center_crop, random_flip, rng)[0]


def time_ids(original_size, crop, size):
    """SDXL's six size/crop numbers of a view: the photo's original height and width (before any
    resize), the crop's top and left in the resized image, the trained height and width."""
    return np.array([*original_size, *crop, size, size], dtype=np.float32)


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


def _resolve(value):
    """An object-store reference (large inputs are put there once) or the value itself."""
    import ray

    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


def _per_row(batch, sources, pick):
    """{key: [pick(...) of each row]}: for each row, pick(its index, its image of sources[key],
    the row's generator), for the keys ("instance", "class") the batch has; one generator per
    row, seeded by it."""
    keys = [k for k in ("instance", "class") if k in batch]
    out = {k: [] for k in keys}
    for r, row_seed in enumerate(batch["seed"]):
        rng = np.random.default_rng(int(row_seed))
        for key in keys:
            index = int(batch[key][r])
            out[key].append(pick(index, sources[key][index], rng))
    return out


def make_views(batch, instance_images, class_images, resolution, center_crop, random_flip, sizes=None):
    """Index rows -> pixels: each row's instance (and class) image, cropped and flipped with
    the row's own seed.

    In: {"instance": (B,), "seed": (B,)[, "class": (B,)]}; the image lists hold (H, W, 3)
    uint8 arrays with min(H, W) >= resolution. Out: {"instance_pixels": (B, R, R, 3)
    [, "class_pixels": (B, R, R, 3)]} uint8 (scaled to [-1, 1] on the training device), and
    "instance_image": (B,) the instance image's index (its caption picks the row's prompt).
    With sizes ({"instance": (N, 2), "class": (M, 2)} original heights and widths, SDXL), also
    "instance_time_ids" [, "class_time_ids"]: (B, 6) float32 (time_ids of each view). Instance
    images of 4 channels (--masked_loss: RGB + mask) give "instance_mask": (B, R, R) uint8, the
    mask cropped and flipped with its pixels.
    """
    sources = {"instance": _resolve(instance_images), "class": _resolve(class_images)}
    views = _per_row(batch, sources, lambda index, image, rng: (index, *view_and_crop(
        image, resolution, center_crop, random_flip, rng)))
    out = {f"{k}_pixels": np.stack([pixels for _, pixels, _ in v]) for k, v in views.items()}
    if out["instance_pixels"].shape[-1] == 4:  # --masked_loss: the mask rode along as a 4th channel
        out["instance_mask"] = np.ascontiguousarray(out["instance_pixels"][..., 3])
        out["instance_pixels"] = np.ascontiguousarray(out["instance_pixels"][..., :3])
    if sizes is not None:
        sizes = _resolve(sizes)
        out.update({f"{k}_time_ids": np.stack([time_ids(sizes[k][index], crop, resolution)
                                               for index, _, crop in v]) for k, v in views.items()})
    return {**out, "instance_image": np.asarray(batch["instance"])}


def pick_latents(batch, instance_latents, class_latents, crops=None, instance_masks=None):
    """Index rows -> cached VAE posteriors: one flip view per row, chosen by the row's seed.

    In: as make_views; the latent arrays are (N, V, 8, h, w). Out: {"instance_latents":
    (B, 8, h, w)[, "class_latents": (B, 8, h, w)]} float32, and "instance_image" (B,). With
    crops ({"instance": (N, V, 6), "class": ...} the time_ids of each stored view, SDXL), also
    "instance_time_ids" [, "class_time_ids"]: (B, 6). With instance_masks ((N, V, R, R) uint8, the
    masks of the stored views), also "instance_mask": (B, R, R), the picked view's.
    """
    sources = {"instance": _resolve(instance_latents), "class": _resolve(class_latents)}

    def pick(index, views, rng):
        k = rng.integers(0, views.shape[0])
        return index, k, views[k]

    picked = _per_row(batch, sources, pick)
    out = {f"{key}_latents": np.stack([latents for _, _, latents in v]) for key, v in picked.items()}
    if crops is not None:
        crops = _resolve(crops)
        out.update({f"{key}_time_ids": np.stack([crops[key][index][k] for index, k, _ in v])
                    for key, v in picked.items()})
    if instance_masks is not None:
        masks = _resolve(instance_masks)
        out["instance_mask"] = np.stack([masks[index][k] for index, k, _ in picked["instance"]])
    return {**out, "instance_image": np.asarray(batch["instance"])}


def stored_mask_views(mask, resolution, views):
    """(V, R, R) uint8: a stored mask's center crop, then flipped (the cached latents' views)."""
    crop = crop_square(mask, resolution, True, None)
    return np.stack([crop, crop[:, ::-1]][:views])


def latent_view_time_ids(original_size, stored_shape, resolution, views):
    """(V, 6) time_ids of the cached latents' views (LatentEncoder): the center crop, then flipped."""
    height, width = stored_shape
    top, left = crop_offsets(height, width, resolution, True, None)
    return np.stack([time_ids(original_size, (top, left if v == 0 else mirrored_left(width, left, resolution)),
                              resolution) for v in range(views)])


# ---------------------------------------------------------------- Ray Data stages


class LatentEncoder:
    """Ray Data actor for --cache_latents: the VAE, loaded once, encodes every stored image.

    In: {"path": (B,), "image": B x (H, W, 3) uint8}. Out: {"path": (B,), "latents":
    (B, V, 8, h, w)}: VAE posterior mean and log-variance of the center crop, V = 2 views
    (plain, flipped) with random_flip, else 1.
    """

    def __init__(self, model_dir, resolution, random_flip, allow_unsafe_weights, vae_dir=None):
        import models

        self.device = utils.torch_device()
        self.vae = models.load_vae(model_dir, vae_dir, allow_unsafe_weights)
        self.vae.to(self.device).eval().requires_grad_(False)
        self.resolution, self.random_flip = resolution, random_flip

    def encode(self, images):
        """B x (H, W, 3) uint8 -> (B, V, 8, h, w) float32 posterior parameters."""
        import torch

        import steps

        crops = np.stack([crop_square(x, self.resolution, True, None) for x in images])
        views = [crops] + ([crops[:, :, ::-1]] if self.random_flip else [])
        out = []
        with torch.no_grad():
            for pixels in views:
                x = steps.to_model_input(torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device))
                out.append(self.vae.encode(x).latent_dist.parameters.float().cpu().numpy())
        return np.stack(out, axis=1)

    def __call__(self, batch):
        return {"path": batch["path"], "latents": self.encode(batch["image"])}


def load_image(path, resolution):
    """((H, W, 3) uint8 pixels of an image file, EXIF-upright, shorter side = resolution,
    (height, width) of the upright image before the resize)."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = apply_orientation(np.asarray(image.convert("RGB")), exif_orientation(path))
    return resize_shorter_side(pixels, resolution), pixels.shape[:2]


def resized_mask(found, shape):
    """A photo's mask (found: find_masks' entry) resized to its stored pixels' (height, width); all
    255 without one."""
    from PIL import Image

    if found is None:
        return np.full(shape, 255, dtype=np.uint8)
    mask = read_mask(*found)
    if mask.shape != tuple(shape):
        mask = np.asarray(Image.fromarray(mask).resize((shape[1], shape[0]), Image.BICUBIC))  # as the pixels
    return mask


def decode_images(instance_paths, class_paths, resolution, latent_cache=None, sizes=None, masks=None):
    """Decode both folders once, on the driver; with latent_cache, VAE-encode them on a
    Ray Data actor pool (one actor per GPU).

    The driver has just read every file in inspect_images: decoding here costs it a second
    or two for hundreds of images, where a Ray Data pass costs seconds of start-up.
    Returns (instance, class) lists in path order: (H, W, 3) uint8 images, or (V, 8, h, w)
    posteriors with latent_cache ({"model_dir", "num_gpus", "allow_unsafe_weights",
    "random_flip"}). sizes: a dict this fills with {path: ((original height, width),
    (stored height, width))}. masks (--masked_loss): {instance path: its find_masks entry}, a dict
    this replaces each entry of with the (H, W) uint8 mask at the stored size.
    """
    paths = list(dict.fromkeys(instance_paths + (class_paths or [])))
    by_path = {}
    for path in paths:
        by_path[path], original = load_image(path, resolution)
        if sizes is not None:
            sizes[path] = (original, by_path[path].shape[:2])
    if masks is not None:
        for path in instance_paths:
            masks[path] = resized_mask(masks[path], by_path[path].shape[:2])
    if latent_cache:
        import ray

        ds = ray.data.from_items([{"path": p, "image": by_path[p]} for p in paths]).map_batches(
            LatentEncoder,
            fn_constructor_args=(latent_cache["model_dir"], resolution, latent_cache["random_flip"],
                                 latent_cache["allow_unsafe_weights"], latent_cache.get("vae_dir")),
            compute=ray.data.ActorPoolStrategy(size=max(1, latent_cache["num_gpus"])),
            num_gpus=1 if latent_cache["num_gpus"] else 0,
            batch_size=16,
        )
        by_path = {row["path"]: row["latents"] for row in ds.take_all()}
    return [by_path[p] for p in instance_paths], [by_path[p] for p in class_paths or []]


def index_dataset(rows, block_rows):
    """Rows -> a Dataset of blocks of exactly block_rows rows (the last may be shorter).

    Train's streaming split hands each block to the worker with the fewest rows so far, so
    blocks of one batch go round-robin: worker r's k-th batch is block k x workers + r,
    whatever the stream's length (only its last blocks are rebalanced). A run resumed with
    more steps, or restarted, sees the same batches in the same places.
    """
    import pyarrow as pa
    import ray

    # from_blocks keeps the blocks as given and reads their metadata here; from_pandas would
    # start a Ray task (a new process, 2 s) to read it.
    return ray.data.from_blocks([pa.Table.from_pylist(rows[k:k + block_rows]) for k in range(0, len(rows), block_rows)])


def build_train_dataset(instance_paths, class_paths, resolution, center_crop, random_flip, latent_cache=None,
                        num_epochs=1, seed=0, batch_size=16, with_time_ids=False, mask_sources=None):
    """The training Dataset of a whole run: num_epochs epochs of plan_rows, turned into pixels
    (or cached latents) by Ray Data tasks.

    The decoded images go to the object store once; the rows that travel through the
    pipeline are indices, and every random choice comes from the row's seed, so the stream
    is the same on every run of the same command. class_paths=None trains on instance rows
    alone (no prior preservation). latent_cache: see decode_images (implies a center crop).
    batch_size: rows of one worker's batch, the stream's block (see index_dataset).
    with_time_ids: each row also carries SDXL's size/crop numbers of its views (time_ids).
    mask_sources (--masked_loss): per instance path, its find_masks entry; each instance row then
    carries its view's mask ("instance_mask").
    """
    import ray

    if latent_cache:
        latent_cache = {**latent_cache, "random_flip": random_flip}
    sizes = {}
    masks = dict(zip(instance_paths, mask_sources)) if mask_sources is not None else None
    instances, classes = decode_images(instance_paths, class_paths, resolution, latent_cache, sizes, masks)
    index = index_dataset(plan_rows(len(instances), len(classes), num_epochs, seed), batch_size)
    paths = {"instance": instance_paths, "class": class_paths or []}
    if latent_cache:
        crops = None
        if with_time_ids:
            views = 2 if random_flip else 1
            crops = ray.put({k: [latent_view_time_ids(*sizes[p], resolution, views) for p in ps]
                             for k, ps in paths.items()})
        mask_views = None
        if masks is not None:
            mask_views = ray.put(np.stack([stored_mask_views(masks[p], resolution, 2 if random_flip else 1)
                                           for p in instance_paths]))
        return index.map_batches(pick_latents, batch_size=batch_size, fn_kwargs={
            "instance_latents": ray.put(np.stack(instances)),
            "class_latents": ray.put(np.stack(classes)) if classes else None, "crops": crops,
            "instance_masks": mask_views})
    if masks is not None:  # the mask rides as a 4th channel: cropped and flipped with its pixels
        instances = [np.concatenate([image, masks[p][..., None]], axis=-1) for image, p in zip(instances, instance_paths)]
    originals = ray.put({k: [sizes[p][0] for p in ps] for k, ps in paths.items()}) if with_time_ids else None
    return index.map_batches(make_views, batch_size=batch_size, fn_kwargs={
        "instance_images": ray.put(instances), "class_images": ray.put(classes) if classes else None,
        "resolution": resolution, "center_crop": center_crop, "random_flip": random_flip, "sizes": originals})


def tokenize_prompt(tokenizer, prompt):
    """Prompt -> (L,) int64 token ids, padded to the tokenizer's model_max_length."""
    ids = tokenizer(prompt, padding="max_length", truncation=True,
                    max_length=tokenizer.model_max_length, return_tensors="np").input_ids
    return ids[0].astype(np.int64)

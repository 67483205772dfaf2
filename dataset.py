"""The training data pipeline on Ray Data.

    instance folder ─ read_images ─ upright, resize ─┐ (few: kept on the driver)
    class folder ──── read_images ─ upright, resize ─ pair with an instance ─ materialize
                                                              │ every epoch:
                                              random_shuffle ─ crop, flip, scale to [-1, 1]

Each training row holds one instance image and, with prior preservation, one class
image. There are max(#instance, #class) rows: instances repeat to cover every class
image and, when instances outnumber class images, class images repeat instead.
Without a class folder the rows are the instance images alone. The image math is in
plain functions, tested without Ray.
"""

import hashlib
import os
import sys

import numpy as np

import utils

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")

# EXIF orientation tag -> (number of 90-degree counter-clockwise turns, mirror first)
_ORIENTATIONS = {1: (0, False), 2: (0, True), 3: (2, False), 4: (2, True),
                 5: (1, True), 6: (3, False), 7: (3, True), 8: (1, False)}


# ---------------------------------------------------------------- files


def list_images(folder, role):
    """Sorted image files directly inside folder; other files are skipped with a warning."""
    if not os.path.isdir(folder):
        raise utils.UserError(f"{role} folder not found: {folder}")
    names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
    images = [n for n in names if n.lower().endswith(IMAGE_EXTENSIONS)]
    skipped = [n for n in names if n not in images]
    if skipped:
        print(f"warning: skipping {len(skipped)} non-image file(s) in {folder}: {', '.join(skipped[:10])}",
              file=sys.stderr)
    if not images:
        raise utils.UserError(f"{role} folder {folder} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
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


def needs_conversion(image):
    """True when read_images' plain RGB conversion would lose or garble the image."""
    return image.mode not in ("RGB", "L") or "transparency" in image.info


def inspect_images(paths, resolution, convert_dir):
    """Check every image on the driver before any worker starts; returns the paths to read.

    Corrupt or truncated files are named in a UserError. Images read_images cannot convert
    faithfully (16-bit, transparent, CMYK, palette) are written, upright and as 8-bit RGB
    PNG, into convert_dir and read from there. Images smaller than the resolution are
    listed in a warning (they are upscaled).
    """
    from PIL import Image, ImageOps

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
                upright = normalize_image(ImageOps.exif_transpose(image))
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


def crop_square(image, size, center, rng):
    """(H, W, C) with min(H, W) >= size -> (size, size, C): centered or at a random offset."""
    height, width = image.shape[:2]
    if center:
        top, left = (height - size) // 2, (width - size) // 2
    else:
        top, left = rng.integers(0, height - size + 1), rng.integers(0, width - size + 1)
    return image[top:top + size, left:left + size]


def to_model_input(image):
    """(H, W, 3) uint8 in [0, 255] -> (3, H, W) float32 in [-1, 1]."""
    return (image.astype(np.float32).transpose(2, 0, 1) / 127.5) - 1.0


def augment(image, size, center_crop, random_flip, rng):
    """Per-epoch view of a stored image: crop, maybe flip, scale. Returns (3, size, size) float32."""
    view = crop_square(image, size, center_crop, rng)
    if random_flip and rng.random() < 0.5:
        view = view[:, ::-1]
    return to_model_input(view)


def paired_instance_indices(class_index, num_instance, num_class):
    """Training rows that class image `class_index` appears in, as the instance index of each.

    Row k pairs instance k % num_instance with class k % num_class, for k < max(both):
    every image of the larger set appears exactly once, the smaller set repeats.
    """
    num_rows = max(num_instance, num_class)
    return [k % num_instance for k in range(class_index, num_rows, num_class)]


# ---------------------------------------------------------------- Ray Data stages


def decode_upright(row, resolution):
    """read_images row -> {"path", "image"}: EXIF-upright, shorter side = resolution."""
    image = apply_orientation(row["image"], exif_orientation(row["path"]))
    return {"path": row["path"], "image": resize_shorter_side(image, resolution)}


def pair_with_instances(row, class_index, num_instance):
    """Class row -> one row per training pair it belongs to: {"instance_index", "class_image"}.

    class_index maps each class image path to its position in the class list.
    """
    return [{"instance_index": i, "class_image": row["image"]}
            for i in paired_instance_indices(class_index[row["path"]], num_instance, len(class_index))]


def augment_batch(batch, instance_images, resolution, center_crop, random_flip):
    """Batch of stored rows -> model inputs, with fresh random crops/flips on every call.

    In: {"instance_index": (B,), "class_image": B x (H, W, 3)} or {"image": B x (H, W, 3)}.
    Out: {"instance_pixels": (B, 3, R, R)} (+ {"class_pixels": (B, 3, R, R)}), float32 in [-1, 1].
    """
    rng = np.random.default_rng()
    args = (resolution, center_crop, random_flip, rng)
    if "image" in batch:
        instances = batch["image"]
    else:
        instances = [instance_images[int(i)] for i in batch["instance_index"]]
    out = {"instance_pixels": np.stack([augment(x, *args) for x in instances])}
    if "class_image" in batch:
        out["class_pixels"] = np.stack([augment(x, *args) for x in batch["class_image"]])
    return out


class LatentEncoder:
    """Ray Data actor for --cache_latents: the VAE, loaded once, encodes every stored image.

    In: stored rows (see augment_batch). Out: {"instance_latents": (B, V, 8, h, w)
    [, "class_latents": (B, V, 8, h, w)]}: VAE posterior mean and log-variance of the
    center crop, V = 2 views (plain, flipped) with random_flip, else 1.
    """

    def __init__(self, model_dir, instance_images, resolution, random_flip, allow_unsafe_weights):
        import torch
        from diffusers import AutoencoderKL

        utils.quiet_hf_logging()
        self.device = utils.torch_device()
        self.vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae",
                                                 use_safetensors=utils.safetensors_only(allow_unsafe_weights))
        self.vae.to(self.device).eval().requires_grad_(False)
        self.resolution, self.random_flip, self.torch = resolution, random_flip, torch
        self.instance_latents = self.encode(instance_images) if instance_images else None

    def encode(self, images):
        """B x (H, W, 3) uint8 -> (B, V, 8, h, w) float32 posterior parameters."""
        views = [np.stack([to_model_input(crop_square(x, self.resolution, True, None)) for x in images])]
        if self.random_flip:
            views.append(views[0][..., ::-1].copy())
        out = []
        with self.torch.no_grad():
            for view in views:
                pixels = self.torch.from_numpy(view).to(self.device)
                out.append(self.vae.encode(pixels).latent_dist.parameters.float().cpu().numpy())
        return np.stack(out, axis=1)

    def __call__(self, batch):
        if "image" in batch:
            return {"instance_latents": self.encode(batch["image"])}
        return {"instance_latents": self.instance_latents[batch["instance_index"].astype(int)],
                "class_latents": self.encode(batch["class_image"])}


def pick_latent_view(batch):
    """(B, V, 8, h, w) cached views -> (B, 8, h, w): one view per row at random (the flip)."""
    rng = np.random.default_rng()
    out = {}
    for key, views in batch.items():
        choice = rng.integers(0, views.shape[1], size=views.shape[0])
        out[key] = views[np.arange(views.shape[0]), choice]
    return out


def read_folder(paths, resolution):
    import ray

    ds = ray.data.read_images(paths, mode="RGB", include_paths=True)
    return ds.map(decode_upright, fn_kwargs={"resolution": resolution})


def build_train_dataset(instance_paths, class_paths, resolution, center_crop, random_flip, latent_cache=None):
    """The training Dataset: stored (decoded, paired) rows, reshuffled and augmented each epoch.

    class_paths=None trains on instance rows alone (no prior preservation). latent_cache,
    a dict {"model_dir", "num_gpus", "allow_unsafe_weights"}, swaps pixels for VAE
    latents encoded once here (center crop; both flip views with random_flip).
    """
    instance_ds = read_folder(instance_paths, resolution)
    if class_paths:
        # The few instance images travel to every augment task; class rows stay distributed.
        by_path = {row["path"]: row["image"] for row in instance_ds.take_all()}
        instance_images = [by_path[p] for p in instance_paths]
        stored = read_folder(class_paths, resolution).flat_map(
            pair_with_instances, fn_kwargs={"class_index": {p: j for j, p in enumerate(class_paths)},
                                           "num_instance": len(instance_paths)})
    else:
        instance_images = None
        stored = instance_ds
    if latent_cache:
        import ray

        stored = stored.map_batches(
            LatentEncoder,
            fn_constructor_args=(latent_cache["model_dir"], instance_images, resolution, random_flip,
                                 latent_cache["allow_unsafe_weights"]),
            compute=ray.data.ActorPoolStrategy(size=max(1, latent_cache["num_gpus"])),
            num_gpus=1 if latent_cache["num_gpus"] else 0,
            batch_size=16,
        ).materialize()
        return stored.random_shuffle().map_batches(pick_latent_view, batch_size=16)
    stored = stored.materialize()
    return stored.random_shuffle().map_batches(
        augment_batch,
        fn_kwargs={"instance_images": instance_images, "resolution": resolution,
                   "center_crop": center_crop, "random_flip": random_flip},
        batch_size=16,
    )


def tokenize_prompt(tokenizer, prompt):
    """Prompt -> (L,) int64 token ids, padded to the tokenizer's model_max_length."""
    ids = tokenizer(prompt, padding="max_length", truncation=True,
                    max_length=tokenizer.model_max_length, return_tensors="np").input_ids
    return ids[0].astype(np.int64)

"""The training data pipeline on Ray Data.

    instance + class folders ─ decoded on the driver: upright, resize [─ VAE posteriors, actor pool]
        └─ object store (each image once)
    plan_rows: index rows of the whole run ─ from_pandas ─ crop + flip by each row's seed
        ─ streaming split over the Ray Train workers (uint8 pixels, scaled on the device)

An epoch has max(#instance, #class) rows, each one instance image and, with prior
preservation, one class image: instances repeat to cover every class image and, when
instances outnumber class images, class images repeat instead. Every random choice (the
order of each epoch, each row's crop and flip) is drawn from --seed, so a run, a resumed
run and a restarted worker group all see the same stream. The image math and the rows are in
imaging.py, the photos on disk in imagefiles.py; this module assembles the Ray Data stages.

Options: --enable_bucket stores each photo covering the aspect-ratio bucket nearest its own and
orders the rows so that every batch holds one bucket (imaging.plan_bucket_rows); --masked_loss
carries each photo's mask as a fourth channel through its crop and flip.
"""

import dataclasses

import numpy as np

from dreambooth import families
from dreambooth import machine
from dreambooth.generation import imagefiles
from dreambooth.generation import imaging
from dreambooth.models import networks


def _resolve(value):
    """An object-store reference (large inputs are put there once) or the value itself."""
    import ray

    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


def _per_row(batch, pick):
    """{key: [pick(key, index, r, rng) of each row]}: for each row r, its image index of key and
    its generator, for the keys ("instance", "class") the batch has; one generator per row,
    seeded by it."""
    keys = [k for k in ("instance", "class") if k in batch]
    out = {k: [] for k in keys}
    for r, row_seed in enumerate(batch["seed"]):
        rng = np.random.default_rng(int(row_seed))
        for key in keys:
            out[key].append(pick(key, int(batch[key][r]), r, rng))
    return out


def _row_buckets(batch):
    """Each row's bucket index: the "bucket" column of plan_bucket_rows' rows (None per row without
    --enable_bucket)."""
    if "bucket" not in batch:
        return [None] * len(batch["seed"])
    return [int(b) for b in batch["bucket"]]


def make_views(batch, instance_images, class_images, resolution, center_crop, random_flip, sizes=None,
               buckets=None):
    """Index rows -> pixels: each row's instance (and class) image, cropped and flipped with
    the row's own seed.

    In: {"instance": (B,), "seed": (B,)[, "class": (B,)]}; the image lists hold (H, W, 3)
    uint8 arrays with min(H, W) >= resolution. Out: {"instance_pixels": (B, R, R, 3)
    [, "class_pixels": (B, R, R, 3)]} uint8 (scaled to [-1, 1] on the training device), and
    "instance_image": (B,) the instance image's index (its caption picks the row's prompt).
    With sizes ({"instance": (N, 2), "class": (M, 2)} original heights and widths, SDXL), also
    "instance_time_ids" [, "class_time_ids"]: (B, 6) float32 (time_ids of each view). Instance
    images of 4 channels (--masked_loss: RGB + mask) give "instance_mask": (B, R, R) uint8, the
    mask cropped and flipped with its pixels. With buckets ((height, width) per bucket index) and
    a "bucket" column (one bucket per batch: plan_bucket_rows), views are of the bucket's size:
    instance images are stored covering their bucket; class images are resized to cover it here.
    """
    sources = {"instance": _resolve(instance_images), "class": _resolve(class_images)}
    row_buckets = _row_buckets(batch)

    def pick(key, index, r, rng):
        image, size = sources[key][index], resolution
        if row_buckets[r] is not None:
            size = tuple(buckets[row_buckets[r]])
            if key == "class":
                image = imaging.resize_to_cover(image, size)
        return (index, *imaging.view_and_crop(image, size, center_crop, random_flip, rng), size)

    views = _per_row(batch, pick)
    out = {f"{k}_pixels": np.stack([pixels for _, pixels, _, _ in v]) for k, v in views.items()}
    if out["instance_pixels"].shape[-1] == 4:  # --masked_loss: the mask rode along as a 4th channel
        out["instance_mask"] = np.ascontiguousarray(out["instance_pixels"][..., 3])
        out["instance_pixels"] = np.ascontiguousarray(out["instance_pixels"][..., :3])
    if sizes is not None:
        sizes = _resolve(sizes)
        out.update({f"{k}_time_ids": np.stack([imaging.time_ids(sizes[k][index], crop, size)
                                               for index, _, crop, size in v]) for k, v in views.items()})
    return {**out, "instance_image": np.asarray(batch["instance"])}


def pick_latents(batch, instance_latents, class_latents, crops=None, instance_masks=None):
    """Index rows -> cached VAE posteriors: one flip view per row, chosen by the row's seed.

    In: as make_views; the latent arrays are (N, V, 8, h, w) (or lists of (V, 8, h, w)). Out:
    {"instance_latents": (B, 8, h, w)[, "class_latents": (B, 8, h, w)]} float32, and
    "instance_image" (B,). With crops ({"instance": (N, V, 6), "class": ...} the time_ids of each
    stored view, SDXL), also "instance_time_ids" [, "class_time_ids"]: (B, 6). With
    instance_masks ((N, V, R, R) uint8, the masks of the stored views), also "instance_mask":
    (B, R, R), the picked view's. Rows with a "bucket" column (--enable_bucket): class_latents and
    crops["class"] are {bucket index: per class image}, each class image encoded at every bucket the
    photos use.
    """
    sources = {"instance": _resolve(instance_latents), "class": _resolve(class_latents)}
    crops = _resolve(crops) if crops is not None else None
    row_buckets = _row_buckets(batch)

    def stored(table, key, index, r):
        return table[key][row_buckets[r]][index] if row_buckets[r] is not None and key == "class" else table[key][index]

    def pick(key, index, r, rng):
        views = stored(sources, key, index, r)
        k = rng.integers(0, views.shape[0])
        return index, k, views[k], (stored(crops, key, index, r)[k] if crops is not None else None)

    picked = _per_row(batch, pick)
    out = {f"{key}_latents": np.stack([latents for _, _, latents, _ in v]) for key, v in picked.items()}
    if crops is not None:
        out.update({f"{key}_time_ids": np.stack([ids for _, _, _, ids in v]) for key, v in picked.items()})
    if instance_masks is not None:
        masks = _resolve(instance_masks)
        out["instance_mask"] = np.stack([masks[index][k] for index, k, _, _ in picked["instance"]])
    return {**out, "instance_image": np.asarray(batch["instance"])}


def stored_mask_views(mask, size, views):
    """(V, h, w) uint8: a stored mask's center crop of size, then flipped (the cached latents' views)."""
    crop = imaging.crop_square(mask, size, True, None)
    return np.stack([crop, crop[:, ::-1]][:views])


def latent_view_time_ids(original_size, stored_shape, size, views):
    """(V, 6) time_ids of the cached latents' views (LatentEncoder): the center crop, then flipped."""
    height, width = stored_shape
    top, left = imaging.crop_offsets(height, width, size, True, None)
    return np.stack([imaging.time_ids(original_size, (top, left if v == 0 else imaging.mirrored_left(width, left, size)), size)
                     for v in range(views)])


# ---------------------------------------------------------------- Ray Data stages


class LatentEncoder:
    """Ray Data actor for --cache_latents: the VAE, loaded once, encodes every stored image.

    In: {"key": (B,), "image": B x (H, W, 3) uint8, "size": (B, 2) crop height and width}. Out:
    {"key": (B,), "latents": (B, V, 8, h, w)}: VAE posterior mean and log-variance of the center
    crop, V = 2 views (plain, flipped) with random_flip, else 1. A batch's crops share one size.
    """

    def __init__(self, model_dir, random_flip, allow_unsafe_weights, vae_dir=None):
        self.device = machine.torch_device()
        self.family = families.family_of(model_dir)
        self.vae = networks.load_vae(model_dir, vae_dir, allow_unsafe_weights, self.family)
        self.vae.to(self.device).eval().requires_grad_(False)
        self.random_flip = random_flip

    def encode(self, images, size):
        """B x (H, W, 3) uint8 covering size -> (B, V, 8, h, w) float32 posterior parameters."""
        import torch


        crops = np.stack([imaging.crop_square(x, size, True, None) for x in images])
        views = [crops] + ([crops[:, :, ::-1]] if self.random_flip else [])
        out = []
        with torch.no_grad():
            for pixels in views:
                x = imaging.to_model_input(torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device))
                out.append(self.family.latent_posterior(self.vae, x).parameters.float().cpu().numpy())
        return np.stack(out, axis=1)

    def __call__(self, batch):
        return {"key": batch["key"], "latents": self.encode(batch["image"], tuple(batch["size"][0]))}


def load_image(path, size):
    """((H, W, 3) uint8 pixels of an image file, EXIF-upright, resized to just cover size (an int:
    the shorter side is that size; or a bucket's (height, width)), (height, width) of the upright
    image before the resize)."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = imagefiles.apply_orientation(np.asarray(image.convert("RGB")), imagefiles.exif_orientation(path))
    return imaging.resize_to_cover(pixels, size), pixels.shape[:2]


def resized_mask(found, shape):
    """A photo's mask (found: find_masks' entry) resized to its stored pixels' (height, width); all
    255 without one."""
    from PIL import Image

    if found is None:
        return np.full(shape, 255, dtype=np.uint8)
    mask = imagefiles.read_mask(*found)
    if mask.shape != tuple(shape):
        mask = np.asarray(Image.fromarray(mask).resize((shape[1], shape[0]), Image.BICUBIC))  # as the pixels
    return mask


def sizes_of(resolution, buckets, assigned):
    """The training size of each image: its bucket's (height, width) (assigned: bucket indices into
    buckets), or resolution where the bucket is None (no --enable_bucket)."""
    return [resolution if b is None else tuple(buckets[b]) for b in assigned]


@dataclasses.dataclass(frozen=True)
class LatentCache:
    """--cache_latents: the images VAE-encoded once, by this model's VAE (or vae_dir), on an actor pool
    of one actor per GPU (one on the CPU without)."""

    model_dir: str
    num_gpus: int
    allow_unsafe_weights: bool = False
    vae_dir: str | None = None


def decode_images(instance_paths, class_paths, resolution, latent_cache=None, sizes=None, masks=None,
                  buckets=None, random_flip=False):
    """Decode both folders once, on the driver; with latent_cache, VAE-encode them on a
    Ray Data actor pool (one actor per GPU).

    The driver has just read every file in inspect_images: decoding here costs it a second
    or two for hundreds of images, where a Ray Data pass costs seconds of start-up.
    Returns (instance, class) lists in path order: (H, W, 3) uint8 images, or (V, 8, h, w)
    posteriors with latent_cache (a LatentCache; random_flip: both flip views encoded). sizes: a
    dict this fills with {(role, path): ((original height, width), (stored height, width))}, role
    "instance" or "class". masks (--masked_loss): {instance path:
    its find_masks entry}, a dict this replaces each entry of with the (H, W) uint8 mask at the
    stored size. buckets (--enable_bucket): (bucket sizes, bucket index per instance path):
    instance images are stored covering their bucket, and with latent_cache every class image is
    encoded at each bucket the instances use: the class result is then {bucket: [posteriors]}.
    """
    stored = {}
    instance_sizes = sizes_of(resolution, *(buckets or (None, [None] * len(instance_paths))))
    for role, paths, targets in (("instance", instance_paths, instance_sizes),
                                 ("class", class_paths or [], [resolution] * len(class_paths or []))):
        for path, size in zip(paths, targets):
            stored[role, path], original = load_image(path, size)
            if sizes is not None:
                sizes[role, path] = (original, stored[role, path].shape[:2])
    if masks is not None:
        for path in instance_paths:
            masks[path] = resized_mask(masks[path], stored["instance", path].shape[:2])
    instances = [stored["instance", p] for p in instance_paths]
    classes = [stored["class", p] for p in class_paths or []]
    if not latent_cache:
        return instances, classes
    import ray

    # (key, image covering its crop, crop size): each photo at its own size; each class image at
    # the square, or with buckets at every bucket the photos use
    class_buckets = sorted(set(buckets[1])) if buckets is not None else [None]
    items = [(f"i{k}", image, size) for k, (image, size) in enumerate(zip(instances, instance_sizes))]
    for bucket, size in zip(class_buckets, sizes_of(resolution, buckets and buckets[0], class_buckets)):
        items += [(f"c{bucket}-{k}", imaging.resize_to_cover(image, size), size) for k, image in enumerate(classes)]
    ds = ray.data.from_items([{"key": key, "image": image, "size": np.array(imaging.hw(size))}
                              for key, image, size in items]).map_batches(
        LatentEncoder,
        fn_constructor_args=(latent_cache.model_dir, random_flip, latent_cache.allow_unsafe_weights,
                             latent_cache.vae_dir),
        compute=ray.data.ActorPoolStrategy(size=max(1, latent_cache.num_gpus)),
        num_gpus=1 if latent_cache.num_gpus else 0,
        batch_size=16 if buckets is None else 1,  # (photos of several sizes: one at a time)
    )
    encoded = {row["key"]: row["latents"] for row in ds.take_all()}
    instances = [encoded[f"i{k}"] for k in range(len(instances))]
    by_bucket = {bucket: [encoded[f"c{bucket}-{k}"] for k in range(len(classes))] for bucket in class_buckets}
    return instances, by_bucket[None] if buckets is None else by_bucket


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


def latent_crops(paths, sizes, instance_sizes, resolution, buckets, assigned, views):
    """{"instance": (N, V, 6) time_ids of each photo's cached views, "class": the same of each class
    image ({bucket: ...}: fitted to each bucket the photos use)} (SDXL's size and crop numbers)."""
    crops = {"instance": [latent_view_time_ids(*sizes["instance", p], size, views)
                          for p, size in zip(paths["instance"], instance_sizes)]}
    if buckets is None:
        crops["class"] = [latent_view_time_ids(*sizes["class", p], resolution, views) for p in paths["class"]]
    else:
        crops["class"] = {b: [latent_view_time_ids(sizes["class", p][0],
                                                   imaging.covering_shape(sizes["class", p][1], buckets[b]),
                                                   buckets[b], views) for p in paths["class"]]
                          for b in set(assigned)}
    return crops


def map_tasks(num_workers):
    """The stream's task pool: one task at a time per train worker. A task makes one batch's views from the images
    already decoded (milliseconds a row); left to itself, Ray Data runs a task per free CPU of the cluster at once,
    each in a process of its own that starts Python and Ray (3 CPU-seconds each on the test machine), for blocks
    that one process per worker keeps up with."""
    import ray.data

    return ray.data.TaskPoolStrategy(size=max(1, num_workers))


def build_train_dataset(instance_paths, class_paths, resolution, center_crop, random_flip, latent_cache=None,
                        num_epochs=1, seed=0, batch_size=16, with_time_ids=False, mask_sources=None, buckets=None,
                        num_workers=1):
    """The training Dataset of a whole run: num_epochs epochs of plan_rows, turned into pixels
    (or cached latents) by Ray Data tasks.

    The decoded images go to the object store once; the rows that travel through the
    pipeline are indices, and every random choice comes from the row's seed, so the stream
    is the same on every run of the same command. class_paths=None trains on instance rows
    alone (no prior preservation). latent_cache: see decode_images (implies a center crop).
    batch_size: rows of one worker's batch, the stream's block (see index_dataset).
    with_time_ids: each row also carries SDXL's size/crop numbers of its views (time_ids).
    mask_sources (--masked_loss): per instance path, its find_masks entry; each instance row then
    carries its view's mask ("instance_mask"). buckets (--enable_bucket): the (height, width) of
    each bucket: each photo goes to the bucket of its aspect ratio (bucket_for), every batch holds
    one bucket (plan_bucket_rows), class rows are fitted to their batch's bucket. num_workers: the run's train
    workers, as many as the stream's tasks run at once (map_tasks).
    """
    import ray

    sizes = {}
    masks = dict(zip(instance_paths, mask_sources)) if mask_sources is not None else None
    assigned = None
    if buckets is not None:
        buckets = [tuple(b) for b in buckets]
        assigned = [imaging.bucket_for(*imagefiles.upright_size(p), buckets) for p in instance_paths]
    instances, classes = decode_images(instance_paths, class_paths, resolution, latent_cache, sizes, masks,
                                       (buckets, assigned) if buckets is not None else None, random_flip)
    num_class = len(class_paths or [])
    if buckets is None:
        rows = imaging.plan_rows(len(instances), num_class, num_epochs, seed)
    else:
        rows = imaging.plan_bucket_rows(assigned, num_class, num_epochs, seed, batch_size)
    index = index_dataset(rows, batch_size)
    paths = {"instance": instance_paths, "class": class_paths or []}
    instance_sizes = sizes_of(resolution, buckets, assigned or [None] * len(instances))
    views = 2 if random_flip else 1
    if latent_cache:
        crops = ray.put(latent_crops(paths, sizes, instance_sizes, resolution, buckets, assigned, views)) \
            if with_time_ids else None
        mask_views = None
        if masks is not None:
            mask_views = ray.put([stored_mask_views(masks[p], size, views) for p, size in zip(instance_paths,
                                                                                              instance_sizes)])
        return index.map_batches(pick_latents, batch_size=batch_size, compute=map_tasks(num_workers), fn_kwargs={
            "instance_latents": ray.put(instances), "class_latents": ray.put(classes) if num_class else None,
            "crops": crops, "instance_masks": mask_views})
    if masks is not None:  # the mask rides as a 4th channel: cropped and flipped with its pixels
        instances = [np.concatenate([image, masks[p][..., None]], axis=-1)
                     for image, p in zip(instances, instance_paths)]
    originals = ray.put({k: [sizes[k, p][0] for p in ps] for k, ps in paths.items()}) if with_time_ids else None
    return index.map_batches(make_views, batch_size=batch_size, compute=map_tasks(num_workers), fn_kwargs={
        "instance_images": ray.put(instances), "class_images": ray.put(classes) if classes else None,
        "resolution": resolution, "center_crop": center_crop, "random_flip": random_flip, "sizes": originals,
        "buckets": buckets})



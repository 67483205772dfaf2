"""The files a run trains on, read and checked before anything starts: the photos (the held-out
split, captions, masks, formats converted), the class images (counted, drawn by this base model at
this size), the aspect-ratio buckets and the rows of an epoch, as one typed record (RunInputs).
"""

import dataclasses
import os
import sys

from dreambooth import errors
from dreambooth import files
from dreambooth import storage
from dreambooth.generation import image_records
from dreambooth.generation import imagefiles
from dreambooth.generation import imaging
from dreambooth.generation import prompts
from dreambooth.models import outputs
from dreambooth.storage import runfiles


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """The files a run trains on, read and checked (planning.plan_run makes the Plan of them)."""

    photos: tuple  # the instance photos as given (their content is part of the run's identity)
    instance_images: tuple  # the same, each converted when its format or orientation needs it
    masks: tuple  # each photo's mask source (--masked_loss), or None
    held_out: tuple  # the names of the photos --holdout keeps out
    captions: tuple  # each photo's prompt: its caption, or --instance_prompt
    instance_prompts: tuple  # the distinct prompts among them, in order
    class_files: tuple  # the class images as found
    class_images: tuple  # the same, converted where needed
    resolution: int
    buckets: tuple  # (height, width) of each --enable_bucket bucket, or ()
    num_rows: int  # the rows of one epoch of the stream
    stamps: tuple  # files.stamps of the photos and class images taken before they were read: a change after is said


@dataclasses.dataclass(frozen=True)
class InputFlags:
    """The flags the inputs are read by, handed over by planning (planning.flags_of)."""

    instance_data_dir: str
    class_data_dir: str | None
    instance_prompt: str
    class_prompt: str | None
    caption_extension: str
    holdout: int
    with_prior_preservation: bool
    num_class_images: int | None
    model_dir: str
    storage_path: str
    resolution: int | None
    masked_loss: bool
    train_batch_size: int
    enable_bucket: bool
    bucket_reso_steps: int | None
    min_bucket_reso: int | None
    max_bucket_reso: int | None


def fetch_from_buckets(flags, draw_class_images=None):
    """{flag: this node's folder} of the photos and class images of a bucket (s3://…: flags.instance_data_dir,
    class_data_dir) copied into this node's cache (storage.cached: once; the driver reads them and ships them to
    the workers). With draw_class_images the class folder may be empty yet (they are drawn into this copy, then
    copied to the bucket)."""
    fetched = {name: storage.cached(getattr(flags, name), allow_empty=name == "class_data_dir" and draw_class_images
                                    is not None)
               for name in ("instance_data_dir", "class_data_dir") if storage.is_remote(getattr(flags, name, None))}
    for name, folder in fetched.items():
        print(f"--{name} {getattr(flags, name)}: read from this node's copy {folder}", file=sys.stderr)
    return fetched


def read_inputs(flags, family, draw_class_images=None):
    """The RunInputs of InputFlags for a model of family (families.Family), or UserError naming the
    first problem. draw_class_images(): tops up the class folder (--num_class_images, on Ray), after
    the photos are checked."""
    photos = imagefiles.list_images(flags.instance_data_dir, "instance", also_expected=flags.caption_extension)
    held_out = imagefiles.held_out_names(photos, flags.holdout)
    photos = imagefiles.holdout_split(photos, flags.holdout)[0]
    taken = files.stamps(photos)
    if held_out:
        print(f"--holdout {flags.holdout}: training without {', '.join(held_out)} "
              f"(evaluate.py --holdout {flags.holdout} also scores against the held-out photos)", file=sys.stderr)
    captions = prompts.read_captions(photos, flags.instance_prompt, flags.caption_extension)
    instance_prompts = list(dict.fromkeys(captions))
    resolution = flags.resolution or family.native_resolution(flags.model_dir)
    masks = masks_of(photos, flags.masked_loss)
    convert_dir = runfiles.run_folder(flags.storage_path, "converted-images")  # (a bucket's: this node's cache)
    instance_images = imagefiles.inspect_images(photos, resolution, convert_dir)
    if draw_class_images is not None:
        draw_class_images()
    class_files = imagefiles.list_images(flags.class_data_dir, "class") if flags.with_prior_preservation else []
    if flags.num_class_images and len(class_files) > flags.num_class_images:  # as diffusers: at most that many
        print(f"--num_class_images {flags.num_class_images}: training on the first {flags.num_class_images} of the "
              f"{len(class_files)} class images in {flags.class_data_dir}", file=sys.stderr)
        class_files = sorted(class_files)[:flags.num_class_images]
    if class_files:
        check_class_images(flags.class_data_dir, flags.model_dir, flags.class_prompt, resolution)
    prompts.warn_without_identifier(instance_prompts, flags.instance_prompt, flags.class_prompt)
    taken += files.stamps(class_files)
    class_images = imagefiles.inspect_images(class_files, resolution, convert_dir) if class_files else []
    num_rows = max(len(instance_images), len(class_images))
    buckets = ()
    if flags.enable_bucket:
        buckets = bucket_plan(flags, family, resolution)
        assigned = [imaging.bucket_for(*imagefiles.upright_size(p), buckets) for p in instance_images]
        num_rows = imaging.bucket_epoch_rows(assigned, len(class_images), flags.train_batch_size)
        used = sorted(set(assigned))
        print(f"buckets: {len(instance_images)} photos in " + ", ".join(
            f"{buckets[b][1]}x{buckets[b][0]} ({assigned.count(b)})" for b in used) + " (width x height)",
            file=sys.stderr)
    return RunInputs(tuple(photos), tuple(instance_images), tuple(masks), held_out, tuple(captions),
                     tuple(instance_prompts), tuple(class_files), tuple(class_images), resolution, buckets, num_rows,
                     taken)


def bucket_plan(flags, family, resolution):
    """The buckets of --enable_bucket (flags: InputFlags): imaging.bucket_sizes with the flags' bounds (defaults: half
    and twice the resolution, steps of 64, fewer pixels for small models), every side a multiple of
    the model's size step; UserError when the flags leave no bucket but the square."""
    multiple = family.size_multiple(flags.model_dir)
    step = flags.bucket_reso_steps or max(multiple, min(64, resolution // 8))
    if step % multiple:
        raise errors.UserError(f"--bucket_reso_steps {step} must be a multiple of {multiple} for this model "
                               "(its VAE and UNet halve the image that often)")
    low = flags.min_bucket_reso or max(step, resolution // 2 // step * step)
    high = flags.max_bucket_reso or resolution * 2
    if not low <= resolution <= high:
        raise errors.UserError(f"--min_bucket_reso {low} and --max_bucket_reso {high} must enclose the "
                               f"resolution {resolution}")
    buckets = tuple(imaging.bucket_sizes(resolution, low, high, step))
    if len(buckets) == 1:
        raise errors.UserError(f"--enable_bucket: no bucket but the square fits sides {low}-{high} in steps of "
                               f"{step} at {resolution} px; widen them")
    return buckets


def masks_of(photos, masked_loss):
    """Each photo's mask source for --masked_loss (checked: each mask read, its size its photo's),
    with a line saying how many photos have one; without the flag, a warning when masks lie
    unused beside the photos. Returns a list as long as photos (Nones without the flag)."""
    if not masked_loss:
        unused = imagefiles.masks_beside(photos)
        if unused:
            print(f"warning: {len(unused)} mask file(s) beside the photos are not used without --masked_loss "
                  f"(e.g. {os.path.basename(unused[0])})", file=sys.stderr)
        return [None] * len(photos)
    sources = imagefiles.find_masks(photos)
    found = sum(s is not None for s in sources)
    if not found:
        print(f"warning: --masked_loss: none of the {len(photos)} photos has a mask (NAME{imagefiles.MASK_SUFFIX} "
              "beside NAME.jpg, or transparency): every photo counts everywhere", file=sys.stderr)
    else:
        print(f"--masked_loss: {found} of {len(photos)} photos have a mask", file=sys.stderr)
    return sources


def check_class_images(class_dir, model_dir, class_prompt, resolution):
    """Refuse class images that another base model, class prompt or resolution drew (their folder's
    record says so; a folder without one holds the user's own class images and is taken as it is)."""
    record = image_records.read_image_record(class_dir)
    if record is None:
        return
    differs = []
    if record.model != outputs.ModelRef(model_dir).fingerprint():
        differs.append(f"base model {record.model_dir}")
    if tuple(record.prompts) != (class_prompt,):
        differs.append("prompt " + ", ".join(repr(p) for p in record.prompts))
    if record.resolution != resolution:
        differs.append(f"{record.resolution} px")
    if differs:
        raise errors.UserError(f"--class_data_dir {class_dir} holds class images drawn with {'; '.join(differs)}, "
                               f"not with this run's {model_dir}, {class_prompt!r}, {resolution} px: use another "
                               "--class_data_dir (--num_class_images N draws into it), or redraw this one with "
                               "generate.py --force")

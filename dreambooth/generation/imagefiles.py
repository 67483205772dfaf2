"""The photos on disk: listing a folder's images (masks, captions and our own records apart), the
held-out split, opening each one upright from its EXIF tag and converting what training cannot read
as it is (16-bit, CMYK, palette, transparency), and the masks of --masked_loss beside them."""

import hashlib
import os
import sys

import numpy as np

from dreambooth import errors
from dreambooth import files
from dreambooth.generation import image_records

# EXIF orientation tag -> (number of 90-degree counter-clockwise turns, mirror first)
_ORIENTATIONS = {1: (0, False), 2: (0, True), 3: (2, False), 4: (2, True),
                 5: (1, True), 6: (3, False), 7: (3, True), 8: (1, False)}


# ---------------------------------------------------------------- files


SUBJECT_FILE = "subject.json"  # sweep.py --subjects_dir: a subject's class and token, beside its photos
# Files the suite writes beside images (not images, not worth a warning): the record of what drew
# generated images, generate.py's settings, sweep.py's subject file.
OWN_FILES = (SUBJECT_FILE, image_records.IMAGES_RECORD, image_records.IMAGES_CONFIG)


MASK_SUFFIX = ".mask.png"  # --masked_loss: "photo.mask.png" beside "photo.jpg" weights its loss


def is_mask(name):
    return name.lower().endswith(MASK_SUFFIX)


def is_image(name):
    """Whether a file name is a photo's (an image extension, not a mask)."""
    return name.lower().endswith(files.IMAGE_EXTENSIONS) and not is_mask(name)


def list_images(folder, role, also_expected=None):
    """Sorted image files directly inside folder; other files are skipped with a warning,
    except those ending in also_expected (captions beside the images). Masks (MASK_SUFFIX) are
    never images."""
    if not os.path.lexists(folder):
        raise errors.UserError(f"{role} folder not found: {folder}")
    try:
        entries = sorted(os.listdir(folder))
    except NotADirectoryError:
        raise errors.UserError(f"{role} folder {folder} is a file, not a folder") from None
    except OSError as err:  # (a folder it may not enter was 'not found')
        raise errors.UserError(f"{role} folder: {files.unreadable(folder, err)}") from None
    names = []
    for name in entries:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            names += [] if is_mask(name) else [name]
        elif name.lower().endswith(files.IMAGE_EXTENSIONS):  # (a broken link or a folder: it was passed over unsaid)
            raise errors.UserError(f"{role} folder {folder}: {files.unreadable(path, None)}")
    images = [n for n in names if is_image(n)]
    stems = {os.path.splitext(n)[0] for n in images}
    # (a caption is the text beside a photo of its name: one without that photo captions nothing)
    captions = [n for n in names if also_expected and n.endswith(also_expected) and n not in images]
    orphans = [n for n in captions if n[:-len(also_expected)] not in stems]
    skipped = [n for n in names if n not in images and n not in OWN_FILES and n not in captions]
    if skipped:
        print(f"warning: skipping {len(skipped)} non-image file(s) in {folder}: {', '.join(skipped[:10])}",
              file=sys.stderr)
    if orphans:
        print(f"warning: skipping {len(orphans)} {also_expected} file(s) in {folder} with no photo of the same name to "
              f"caption: {', '.join(orphans[:10])}", file=sys.stderr)
    if not images:
        raise errors.UserError(f"{role} folder {folder} holds no images ({', '.join(files.IMAGE_EXTENSIONS)})")
    return [os.path.join(folder, n) for n in images]


def holdout_split(photos, count):
    """(trained, held out): --holdout keeps the last count photos in name order out of training, for
    evaluate.py to score the model against photos it never saw."""
    if count and count >= len(photos):
        raise errors.UserError(f"--holdout {count} leaves none of the {len(photos)} photos to train on")
    return photos[:len(photos) - count], photos[len(photos) - count:]


def held_out_names(photos, count):
    """The file names of the photos --holdout count keeps out, as a run's record and identity hold them."""
    return tuple(os.path.basename(p) for p in holdout_split(photos, count)[1])


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
            if isinstance(err, (PermissionError, FileNotFoundError, IsADirectoryError)):
                raise errors.UserError(f"image: {files.unreadable(path, err)}") from None
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                raise errors.UserError(f"image {path} is empty (0 bytes)") from None
            raise errors.UserError(f"cannot read image {path}: {err}") from None
        os.makedirs(convert_dir, exist_ok=True)
        # A hash of the full path keeps copies of same-named files from different folders apart.
        digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
        stem = files.slugify(os.path.splitext(os.path.basename(path))[0], max_len=80)
        converted = os.path.join(convert_dir, f"{stem}-{digest}{files.IMAGE_SUFFIX}")
        files.save_image_atomic(upright, converted)
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
        raise errors.UserError(f"cannot read mask {source}: {err}") from None
    upright = upright_size(photo)
    if mask.shape == raw_size and raw_size != upright:
        mask = apply_orientation(mask, orientation)  # drawn on the photo as stored: turned the same way
    if mask.shape != upright:
        raise errors.UserError(f"mask {source} is {mask.shape[1]}x{mask.shape[0]} px but its photo {photo} is "
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


def apply_orientation(image, orientation):
    """Turn an (H, W, C) array as its EXIF orientation says, so it displays upright."""
    turns, mirror = _ORIENTATIONS.get(orientation, (0, False))
    if mirror:
        image = image[:, ::-1]
    return np.ascontiguousarray(np.rot90(image, turns))


def upright_size(path):
    """(height, width) of an image file as it shows upright."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
    return (width, height) if _ORIENTATIONS.get(exif_orientation(path), (0, False))[0] % 2 else (height, width)

"""The record beside a folder of generated images (dreambooth_images.json): the model (its fingerprint, outputs.py)
and the settings that drew them, which decides whether a later run may keep them (drawing.top_up) or take another
folder's (take_drawn), and the images of generate.py's naming in a folder."""

import dataclasses
import os
import re
import sys

from dreambooth import files
from dreambooth import storage

IMAGES_RECORD = "dreambooth_images.json"  # beside generated images: what drew them


IMAGES_CONFIG = "generate_config.toml"  # beside them too: generate.py --config FILE repeats the run


@dataclasses.dataclass(frozen=True)
class ImageRecord:
    """What drew the images of a folder: the model, the prompts and every setting that changes pixels."""

    model: str  # ModelRef.fingerprint()
    model_dir: str  # for messages only: the same weights may sit in another folder
    prompts: tuple
    resolution: int
    seed: int
    num_inference_steps: int
    guidance_scale: float
    negative_prompt: str | None

    # What class images are for training (what they show, at which size): a folder of them is kept
    # when only the other settings differ (steps, guidance, seed, negative prompt).
    CLASS_IMAGE_FIELDS = ("model", "prompts", "resolution")

    def differences(self, other):
        """Names of the settings in which other differs ('model', 'prompts', ...)."""
        return [f.name for f in dataclasses.fields(self)
                if f.name != "model_dir" and getattr(self, f.name) != getattr(other, f.name)]

    def model_words(self, folder_said=False):
        """A hub snapshot by its name and short commit (its folder is a long hub-cache path that says no more),
        any other model by its folder and fingerprint (folder_said: the folder was named just before, for the
        model that was there then)."""
        if re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", self.model):
            return self.model[:-28]
        # (a model train.py saved: its run's id; adapters on a hub model: its commit; each shortened)
        short = re.sub(r"(trained:[0-9a-f]{8})[0-9a-f]+", r"\1", re.sub(r"(@[0-9a-f]{12})[0-9a-f]{28}", r"\1", self.model))
        return f"retrained there ({short})" if folder_said else f"{self.model_dir} ({short})"

    def describe(self, fields=None, after=None):
        """The settings (or only the named fields) in words; after: the record just described, whose model folder
        is not named twice."""
        prompts = "; ".join(repr(p) for p in self.prompts[:3]) + (" ..." if len(self.prompts) > 3 else "")
        folder_said = after is not None and after.model_dir == self.model_dir
        words = {"model": f"model {self.model_words(folder_said)}", "prompts": f"prompts {prompts}",
                 "resolution": f"{self.resolution} px", "seed": f"seed {self.seed}",
                 "num_inference_steps": f"{self.num_inference_steps} steps",
                 "guidance_scale": f"guidance {self.guidance_scale:g}",
                 "negative_prompt": f"negative prompt {self.negative_prompt!r}"}
        return ", ".join(text for name, text in words.items() if fields is None or name in fields)

    @classmethod
    def from_json(cls, data, path=""):
        """The record of data (a record file's JSON); one that matches no other where it is not a record."""
        try:
            return cls(**{**data, "prompts": tuple(data["prompts"])})
        except (TypeError, KeyError):
            return cls("unreadable record", path, (), 0, 0, 0, 0.0, None)


def read_image_record(folder):
    path = os.path.join(folder, IMAGES_RECORD)
    if not os.path.isfile(path):
        return None
    return ImageRecord.from_json(files.read_json(path), path)


def write_image_record(folder, record):
    files.write_json(os.path.join(folder, IMAGES_RECORD), {**dataclasses.asdict(record),
                                                            "prompts": list(record.prompts)})


def drawn_images(folder):
    """The files generate.py's naming wrote in folder: images and the safety checker's markers."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder)
                  if re.fullmatch(r".+-\d{5}" + re.escape(files.IMAGE_SUFFIX) + r"(\.flagged)?", n))


def remove_drawn_images(folder):
    """Delete the images (and their record) generate.py drew into folder; other files stay."""
    for name in drawn_images(folder) + [IMAGES_RECORD]:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)


def take_drawn(folder, donor, wanted, missing, label):
    """The files of missing (image names) that folder lacks, copied from donor (a bucket's too) when donor's record is
    wanted: the same model (its fingerprint) drew them with the same prompts and every setting that changes pixels, so
    they are the images this run would draw. Each copy is written whole (a stop leaves no cut file). Says how many it
    took."""
    record = storage.join(donor, IMAGES_RECORD)
    if not missing or not storage.isfile(record):
        return
    try:
        have = ImageRecord.from_json(storage.read_json(record))
    except (OSError, ValueError):  # (a record cut short: its images are not taken)
        return
    if have.differences(wanted):
        return
    there = set(storage.listdir(donor))
    taken = [name for name in missing if name in there]
    for name in taken:
        files.write_bytes_atomic(storage.read_bytes(storage.join(donor, name)), os.path.join(folder, name))
    if taken:
        print(f"{label}: {len(taken)} images taken from {donor}, where the same model drew them with the same settings",
              file=sys.stderr)

"""Step 2 (example): fetch the example dog photos into a folder.

    python download_example_dataset.py ./images/dog

Downloads the `diffusers/dog-example` dataset from the Hugging Face hub (or reads it from
the hub cache when offline) and copies its photos into the folder. To use your own
subject instead, put 4-6 photos of it in a folder and pass that folder to train.py.
"""

import os
import shutil

from dreambooth import errors
from dreambooth import files
from dreambooth import hub
from dreambooth.config import flags


def fetch_dataset(repo_id, revision, cache_dir):
    """The dataset's snapshot folder (its image files only)."""
    patterns = [f"*{ext}" for ext in files.IMAGE_EXTENSIONS] + [f"*{ext.upper()}" for ext in files.IMAGE_EXTENSIONS]
    offline = ("run once with network access, or use photos of your own (dreambooth_run.sh: INSTANCE_DIR=their "
               "folder; --tiny: images/toy)")
    return hub.hub_download(f"dataset {repo_id}", offline, repo_id=repo_id, repo_type="dataset", revision=revision,
                            cache_dir=cache_dir, allow_patterns=patterns)


def copy_images(snapshot, output_dir):
    """Copy every image of the snapshot (flattened) into output_dir; returns the new paths."""
    os.makedirs(output_dir, exist_ok=True)
    copied = []
    for root, _, names in os.walk(snapshot):
        for name in sorted(names):
            if name.lower().endswith(files.IMAGE_EXTENSIONS):
                target = os.path.join(output_dir, name)
                shutil.copyfile(os.path.join(root, name), target)
                copied.append(target)
    if not copied:
        raise errors.UserError(f"no images found in {snapshot}")
    return copied


def add_output_dir(parser):
    parser.add_argument("output_dir", nargs="?", default="./images/dog", type=flags.abs_path,
                        help="Folder to put the photos in.")


def main(argv=None):
    parser = flags.make_parser(__doc__.splitlines()[0], ["dataset_repo", "dataset_revision", "hub_cache_dir"],
                               positional=add_output_dir)
    args = parser.parse_args(argv)
    snapshot = fetch_dataset(args.dataset_repo, args.dataset_revision, args.hub_cache_dir)
    copied = copy_images(snapshot, args.output_dir)
    print(f"{len(copied)} photos in {args.output_dir}")
    return copied

"""A file the user cannot read, through the scripts: one line naming it. (The read sites: tests/unit/test_user_files.py.)"""

import os
import subprocess
import sys

from dreambooth.files import REPO_DIR


def test_a_file_the_user_cannot_read_is_one_line_naming_it(toy_images, tiny_model, tmp_path):
    """A prompts file, a photo and a model's config without read permission, read as a user that is not root (nobody
    when the tests run as root)."""
    import pwd
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="unreadable-", dir="/tmp")  # (pytest's own temp folder is its user's alone)
    os.chmod(where, 0o755)
    path, photos, private = os.path.join(where, "dog.txt"), os.path.join(where, "photos"), os.path.join(where, "mine")
    with open(path, "w") as f:
        f.write("photo of unqtkn dog\n")
    shutil.copytree(toy_images, photos)
    shutil.copytree(toy_images, private)
    os.chmod(path, 0)
    os.chmod(os.path.join(photos, "toy-1.jpg"), 0)
    os.chmod(private, 0o700)  # (a folder of photos nobody else may enter)
    model = os.path.join(where, "model")
    shutil.copytree(tiny_model, model)
    os.chmod(os.path.join(model, "unet", "config.json"), 0)
    code = ("import sys; sys.path.insert(0, 'tests/unit'); from dreambooth import errors, families\n"
            "from dreambooth.generation import prompts; from test_user_files import photos_read\n"
            "reads = (prompts.read_prompt_file, photos_read, photos_read, families.check_model_dir)\n"
            "for read, what in zip(reads, sys.argv[1:]):\n"
            "    try:\n        read(what)\n    except errors.UserError as err:\n        print(err)")
    argv = [sys.executable, "-c", code, path, photos, private, model]
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_DIR)
    finally:
        shutil.rmtree(where)
    said = proc.stdout.strip().splitlines()
    assert len(said) == 4 and said[0].startswith(f"the prompts file: cannot read {path}: permission denied"), \
        proc.stdout + proc.stderr[-2000:]
    reader = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else os.getuid()
    assert said[3] == (f"cannot read {model}/unet/config.json: permission denied (as user {reader}): fetch or copy the "
                       "model again (cache_model.py)"), said
    assert said[1].startswith(f"image: cannot read {photos}/toy-1.jpg: permission denied"), said
    assert said[2].startswith(f"instance folder: cannot read {private}: permission denied"), said  # (not 'not found')



"""Every text file a user hands over (captions, prompt files, the evaluation prompts, --config) and every photo read
safely: what a user's disk really holds (another encoding, an empty file, a folder, a broken link, no permission) is
one line naming the file, from the function that reads it before Ray starts; nothing is changed on disk. (The read sites:
CONTRIBUTING.md's list. The scripts say these lines before Ray starts: test_bad_inputs.)"""

import os
import subprocess
import sys

import pytest

from dreambooth import errors
from dreambooth.evaluation import scoring
from dreambooth.generation import prompts
from dreambooth.planning import planning


def read_caption(path):
    photo = os.path.splitext(path)[0] + ".jpg"
    return prompts.read_captions([photo], "photo of unqtkn dog", ".txt")[0]


def read_prompts(path):
    return prompts.read_prompt_file(path)[0]


def read_eval_prompts(path):
    return scoring.prompt_templates("object", path)[0]


def read_config(path):  # (a bad one: argparse's line on stderr and SystemExit, as for any flag)
    return planning.parse_args(["--config", path, "--model_dir", "/m", "--output_dir", "/o",
                                "--instance_data_dir", "/p"]).instance_prompt


# site: (how it is read, good content, the words its lines begin with)
SITES = {
    "caption": (read_caption, "photo of unqtkn dog on a sofa", "caption file: "),
    "prompts file": (read_prompts, "photo of unqtkn dog on a sofa", "the prompts file: "),
    "eval prompts": (read_eval_prompts, "a {subject} on a sofa", "--eval_prompts (EVAL_PROMPTS with dreambooth_run.sh): "),
    "config": (read_config, 'instance_prompt = "photo of unqtkn dog on a sofa"', "--config: "),
}


def read(site, path, capsys):
    """What the site reads of path."""
    return SITES[site][0](str(path))


def said(site, path, capsys):
    """The one line a bad file gets."""
    how = SITES[site][0]
    if site == "config":
        with pytest.raises(SystemExit):
            how(str(path))
        return capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(errors.UserError) as caught:
        how(str(path))
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("site", SITES)
def test_a_windows_editors_utf8_with_its_mark_reads_as_the_text(site, tmp_path, capsys):
    path = tmp_path / "dog.txt"
    path.write_bytes(SITES[site][1].encode("utf-8-sig"))
    expected = SITES[site][1].split('"')[1] if site == "config" else SITES[site][1]
    assert read(site, path, capsys) == expected  # (not '\ufeffphoto of ...': the mark is not the prompt's)


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("kind, culprit", [
    ("utf-16", "is not UTF-8 text (UTF-16 (a Windows editor's 'Unicode')): save it as UTF-8"),
    ("latin-1", "is not UTF-8 text (byte 0xe9 at position "),
    ("folder", "is a folder, not a file"),
    ("broken link", "is a link to "),
])
def test_a_file_that_is_not_utf8_text_is_one_line_naming_it(site, kind, culprit, tmp_path, capsys):
    path = tmp_path / "dog.txt"
    good = SITES[site][1]
    if kind == "utf-16":
        path.write_bytes(good.encode("utf-16"))
    elif kind == "latin-1":
        path.write_bytes(good.replace("sofa", "canapé").encode("latin-1"))
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "gone.txt")
    before = sorted(os.listdir(tmp_path))
    line = said(site, path, capsys)
    assert line.startswith(SITES[site][2] if site != "config" else "") and str(path) in line and culprit in line, line
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("site", SITES)
def test_an_empty_file_is_one_line_naming_it(site, tmp_path, capsys):
    path = tmp_path / "dog.txt"
    path.write_bytes(b"")
    line = said(site, path, capsys)
    assert str(path) in line and ("empty" in line or "no prompts" in line or "no settings" in line), line


def photos_read(folder):
    """The photos of a folder as train.py's check before Ray reads them (inputs.find_inputs: list, then open each)."""
    from dreambooth.generation import imagefiles

    return imagefiles.inspect_images(imagefiles.list_images(str(folder), "instance", also_expected=".txt"), 64,
                                     str(folder) + "-converted")


@pytest.mark.parametrize("kind, culprit", [
    ("broken link", "instance folder {folder}: {folder}/dog-2.jpg is a link to "),
    ("folder", "instance folder {folder}: {folder}/dog-2.jpg is a folder, not a file"),
    ("empty", "image {folder}/dog-2.jpg is empty (0 bytes)"),
])
def test_a_photo_that_is_no_image_file_is_one_line_naming_it(kind, culprit, toy_images, tmp_path):
    """A photo's name that is a broken link or a folder was passed over without a word (the subject trained on fewer
    photos than the user gave); an empty file was 'cannot identify image file'."""
    import shutil

    folder = tmp_path / "photos"
    shutil.copytree(toy_images, folder)
    if kind == "broken link":
        (folder / "dog-2.jpg").symlink_to(tmp_path / "moved-away.jpg")
    elif kind == "folder":
        (folder / "dog-2.jpg").mkdir()
    else:
        (folder / "dog-2.jpg").write_bytes(b"")
    with pytest.raises(errors.UserError) as caught:
        photos_read(folder)
    assert str(caught.value).startswith(culprit.format(folder=folder)), caught.value
    assert not os.path.exists(str(folder) + "-converted")


@pytest.mark.slow  # (a process of its own, as another user: root reads every file)
def test_a_file_the_user_cannot_read_is_one_line_naming_it(toy_images, tmp_path):
    """A prompts file and a photo without read permission, read as a user that is not root (nobody when the tests run
    as root)."""
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
    code = ("import sys; sys.path.insert(0, 'tests'); from dreambooth import errors\n"
            "from dreambooth.generation import prompts; from test_user_files import photos_read\n"
            "for read, what in zip((prompts.read_prompt_file, photos_read, photos_read), sys.argv[1:]):\n"
            "    try:\n        read(what)\n    except errors.UserError as err:\n        print(err)")
    argv = [sys.executable, "-c", code, path, photos, private]
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    finally:
        shutil.rmtree(where)
    said = proc.stdout.strip().splitlines()
    assert len(said) == 3 and said[0].startswith(f"the prompts file: cannot read {path}: permission denied"), \
        proc.stdout + proc.stderr[-2000:]
    assert said[1].startswith(f"image: cannot read {photos}/toy-1.jpg: permission denied"), said
    assert said[2].startswith(f"instance folder: cannot read {private}: permission denied"), said  # (not 'not found')


def test_a_photo_rewritten_while_the_run_reads_it_is_one_line_naming_it(tiny_model, toy_images, tmp_path):
    """The stamps taken before the photos are read (size, modification time) tell a photo rewritten since: the driver
    says so before training on what it read (its content and the run's identity may be of two versions)."""
    import shutil

    from dreambooth import families
    from dreambooth import files
    from dreambooth.planning import inputs

    folder = tmp_path / "photos"
    shutil.copytree(toy_images, folder)
    flags = inputs.InputFlags(
        instance_data_dir=str(folder), class_data_dir=None, instance_prompt="photo of unqtkn toy", class_prompt=None,
        caption_extension=".txt", holdout=0, with_prior_preservation=False, num_class_images=None,
        model_dir=tiny_model, storage_path=str(tmp_path / "runs"), resolution=64, masked_loss=False,
        train_batch_size=1, enable_bucket=False, bucket_reso_steps=None, min_bucket_reso=None, max_bucket_reso=None)
    found = inputs.read_inputs(flags, families.family_of(tiny_model), None)
    assert [path for path, _, _ in found.stamps] == sorted(str(p) for p in folder.iterdir())
    assert files.changed_since(found.stamps) is None
    (folder / "toy-3.jpg").write_bytes((folder / "toy-3.jpg").read_bytes() + b"\0")  # (saved again, a byte longer)
    said = files.changed_since(found.stamps)
    assert said.startswith(f"{folder / 'toy-3.jpg'} changed while the run read it (written at ") and \
        said.endswith("start the run again once it is saved")
    (folder / "toy-3.jpg").unlink()
    assert files.changed_since(found.stamps).endswith("no such file (it was there when the run began)")

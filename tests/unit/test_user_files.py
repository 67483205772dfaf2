"""Every text file a user hands over (captions, prompt files, the evaluation prompts, --config) and every photo read
safely: what a user's disk really holds (another encoding, an empty file, a folder, a broken link, no permission) is
one line naming the file, from the function that reads it before Ray starts; nothing is changed on disk. (The read sites:
CONTRIBUTING.md's "Files users hand over". The scripts say these lines before Ray starts: test_bad_inputs.)"""

import os

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


class Rewriter:
    """A copy or a download going on beside a run: path saved again and again (whole each time: written beside it,
    then moved over it) until the with block ends."""

    def __init__(self, path):
        import threading

        self.path, self.stop, self.saves = path, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        data = open(self.path, "rb").read()
        while not self.stop.is_set():
            with open(f"{self.path}.part", "wb") as f:
                f.write(data)
            os.replace(f"{self.path}.part", self.path)
            self.saves += 1
            self.stop.wait(0.005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_a_model_or_checkpoint_file_rewritten_while_it_is_loaded_is_one_line_naming_it(tiny_model, make_plan, tmp_path):
    """files.unchanged_while around a load: a file of the folders rewritten or removed during it is a UserError naming
    it (its stamps taken as the load begins, in the process that loads); a load that nothing disturbs says nothing.
    A model folder counts the files a load reads (configs, weights, tokenizer files), a checkpoint every file. Then
    the real loads: generate.py's and evaluate.py's pipeline (drawing.load_pipeline) while a copy of the model is
    saved again beside it."""
    import shutil

    from dreambooth import files
    from dreambooth.generation import drawing

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    with files.unchanged_while(str(model), None):
        (model / "notes.md").write_text("not read by a load")  # (not a model file)
    config = model / "unet" / "config.json"
    with pytest.raises(errors.UserError) as said, files.unchanged_while(str(model)):
        config.write_bytes(config.read_bytes() + b" ")
    assert str(said.value).startswith(f"loading the model: {config} changed while the run read it (written at ")
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "optimizer.pt").write_bytes(b"state")
    with pytest.raises(errors.UserError) as said, files.unchanged_while(str(checkpoint), what="loading the checkpoint",
                                                                        suffixes=None):
        (checkpoint / "optimizer.pt").unlink()
    assert str(said.value) == f"loading the checkpoint: {checkpoint}/optimizer.pt: no such file (it was there when " \
                              "the run began)"
    import torch

    with Rewriter(str(model / "scheduler" / "scheduler_config.json")) as rewriter, \
            pytest.raises(errors.UserError, match=r"^loading the model: .*/scheduler/scheduler_config.json changed "
                                                  r"while the run read it"):
        drawing.load_pipeline(str(model), torch.device("cpu"))
    assert rewriter.saves > 1
    assert drawing.load_pipeline(str(model), torch.device("cpu")) is not None  # (the copy done: it loads)
    # a train worker's load (the training's networks, under its guard), which stops the run with that line rather than
    # restart it
    from dreambooth.models import networks
    from dreambooth.training import worker

    plan = make_plan(model_dir=str(model))
    with Rewriter(str(model / "text_encoder" / "config.json")), \
            pytest.raises(errors.UserError, match=r"^loading the model: .*/text_encoder/config.json changed while"):
        networks.setup_models(plan, torch.device("cpu"), torch.device("cpu"), distributed=False,
                              load_guard=worker.model_loading(plan, "fetch it again"))


def spoil(path, kind):
    """path (a file) made what a user's disk may hold instead: another encoding, empty, a folder of its name, a link
    to a file that is gone (a hub cache whose blob was deleted), or cut short."""
    data = path.read_bytes()
    path.unlink()
    if kind == "utf-16":
        path.write_bytes(data.decode().encode("utf-16"))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "folder":
        path.mkdir()
    elif kind == "broken link":
        path.symlink_to("../../blobs/0123abcd")
    elif kind == "cut short":
        path.write_bytes(data[:len(data) // 2])


def listing(folder):
    """Every entry under folder with its kind, size and modification time: what a check must leave as it was."""
    return sorted((root, name, *(lambda st: (st.st_mode, st.st_size, st.st_mtime_ns))(os.lstat(os.path.join(root, name))))
                  for root, names, found in os.walk(folder) for name in names + found)


@pytest.mark.parametrize("name", ["model_index.json", "transformer/config.json", "scheduler/scheduler_config.json",
                                  "tokenizer_2/tokenizer_config.json", "transformer/diffusion_pytorch_model.safetensors"])
def test_a_model_folders_bad_file_is_one_line_naming_it(tiny_flux_model, name, tmp_path):
    """Every file of a model folder (its index, configs, tokenizer files, weights) is checked before Ray starts, as
    the scripts check --model_dir (families.check_model_dir): each kind of bad file is one line naming it and what to
    do, and the folder is left as it was."""
    import shutil

    from dreambooth import families

    kinds = {"utf-16": "is not UTF-8 text (UTF-16 (a Windows editor's 'Unicode'))", "empty": "is empty (0 bytes)",
             "folder": "is a folder, not a file", "broken link": "is a link to ../../blobs/0123abcd, which does not exist",
             "cut short": "is not valid JSON (a cut-short copy?)"}
    if name.endswith(".safetensors"):
        kinds.pop("utf-16")
        kinds["cut short"] = "is not a whole safetensors file: "
    for kind, culprit in kinds.items():
        model = tmp_path / kind
        shutil.copytree(tiny_flux_model, model)
        spoil(model / name, kind)
        before = listing(model)
        with pytest.raises(errors.UserError) as caught:
            families.check_model_dir(str(model))
        said = str(caught.value)
        assert said.startswith(f"{model / name} {culprit}") and said.endswith("fetch or copy the model again "
                                                                             "(cache_model.py)"), (kind, said)
        assert "\n" not in said and listing(model) == before


def test_a_checkpoint_to_resume_from_that_is_not_whole_is_one_line_naming_the_file(tmp_path):
    """--resume_from_checkpoint PATH: its state file or one of the files it lists, bad in any of the ways above, is
    one line naming that file (it said only that the folder is not a complete checkpoint)."""
    import json

    import torch
    from safetensors.torch import save_file

    from dreambooth.planning import checkpoints

    def checkpoint(where):
        where.mkdir()
        save_file({"w": torch.zeros(4)}, str(where / "unet.safetensors"))
        sizes = {"unet.safetensors": os.path.getsize(where / "unet.safetensors")}
        (where / checkpoints.STATE_FILE).write_text(json.dumps({"step": 2, "sizes": sizes}))
        return where

    def said(folder):
        before = listing(folder) if folder.exists() else None
        with pytest.raises(errors.UserError) as caught:
            checkpoints.resolve_resume(str(folder), str(tmp_path), "model")
        assert "\n" not in str(caught.value) and (listing(folder) if folder.exists() else None) == before
        return str(caught.value).split(" is not a complete checkpoint of train.py: ")[1]

    assert checkpoints.resolve_resume(str(checkpoint(tmp_path / "whole")), str(tmp_path), "model") == str(
        tmp_path / "whole")
    assert said(tmp_path / "absent") == "no such folder"
    state = checkpoints.STATE_FILE
    for kind, culprit in (("utf-16", f"{state} is not UTF-8 text (UTF-16"), ("empty", f"{state} is empty (0 bytes)"),
                          ("folder", f"{state} is a folder, not a file"), ("broken link", f"{state} is a link to "),
                          ("cut short", f"{state} is not valid JSON (a cut-short copy?)")):
        folder = checkpoint(tmp_path / f"state-{kind}")
        spoil(folder / state, kind)
        assert said(folder).startswith(f"{folder}/{culprit}"), kind
    size = os.path.getsize(tmp_path / "whole" / "unet.safetensors")
    for kind, culprit in (("empty", f"unet.safetensors is 0 bytes where the checkpoint recorded {size} (cut short?)"),
                          ("folder", "unet.safetensors is a folder, not a file"),
                          ("broken link", "unet.safetensors is a link to ../../blobs/0123abcd, which does not exist"),
                          ("cut short", f"unet.safetensors is {size // 2} bytes where the checkpoint recorded {size} "
                                        "(cut short?)")):
        folder = checkpoint(tmp_path / f"weights-{kind}")
        spoil(folder / "unet.safetensors", kind)
        assert said(folder).startswith(f"{folder}/{culprit}"), kind
    folder = checkpoint(tmp_path / "unlisted")
    (folder / state).write_text(json.dumps({"step": 2}))
    assert said(folder) == f"{folder}/{state} lists no files (not a checkpoint of train.py)"


def test_a_lora_folders_cut_short_adapters_are_one_line_naming_the_file(tiny_model, tmp_path):
    """--lora_dir (generate.py, evaluate.py): its files are checked as a model folder's, before an actor loads them."""
    import torch
    from safetensors.torch import save_file

    from dreambooth import files
    from dreambooth.models import outputs

    lora = tmp_path / "lora"
    lora.mkdir()
    save_file({"unet.w.lora_A.weight": torch.zeros(4, 8)}, str(lora / files.LORA_WEIGHTS_FILE))
    spoil(lora / files.LORA_WEIGHTS_FILE, "cut short")
    with pytest.raises(errors.UserError) as caught:
        outputs.resolve_model(tiny_model, str(lora))
    assert str(caught.value).startswith(f"{lora / files.LORA_WEIGHTS_FILE} is not a whole safetensors file") and \
        str(caught.value).endswith(": train or copy the adapters again")

"""outputs.py: what made a model or an image folder, and drawing.top_up's use of it (no Ray: top_up
only plans; drawing is generate's pool)."""

import os
import shutil

import pytest

from dreambooth import errors
from dreambooth import files
from dreambooth.generation import drawing
from dreambooth.generation import image_records
from dreambooth.models import outputs

SETTINGS = drawing.ImageSettings(num_inference_steps=3, seed=1)


def test_a_retrained_output_has_a_new_fingerprint_and_a_copied_base_the_same(tiny_model, tmp_path):
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    files.write_json(tuned / files.OUTPUT_MARKER, {"base_model": tiny_model, "model_id": outputs.new_model_id()})
    first = outputs.model_fingerprint(str(tuned))
    files.write_json(tuned / files.OUTPUT_MARKER, {"base_model": tiny_model, "model_id": outputs.new_model_id()})
    assert first.startswith("trained:") and outputs.model_fingerprint(str(tuned)) != first
    # a hub snapshot is named by its commit, wherever its cache folder is
    assert outputs.model_fingerprint(tiny_model).startswith("dreambooth-ray/tiny-stable-diffusion@")
    # any other folder by its files: a copy has the same fingerprint, a changed weight another
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    same = outputs.model_fingerprint(str(copy))
    assert same.startswith("files:") and same == outputs.model_fingerprint(shutil.copytree(copy, tmp_path / "c2"))
    weights = copy / "unet" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert outputs.model_fingerprint(str(copy)) != same


def test_top_up_keeps_images_of_the_same_model_and_settings_only(tiny_model, tmp_path, capsys):
    folder = str(tmp_path / "class")
    model = outputs.ModelRef(tiny_model)
    job = drawing.top_up(folder, model, ["photo of a dog"], 3, SETTINGS, False)
    assert [r["file"] for r in job.rows] == [drawing.image_file_name("photo of a dog", i) for i in range(3)]
    record = image_records.read_image_record(folder)
    assert record.model == model.fingerprint() and record.resolution == 64 and record.prompts == ("photo of a dog",)
    for row in job.rows[:2]:  # two drawn, then the run was cut short
        open(os.path.join(folder, row["file"]), "wb").close()
    assert len(drawing.top_up(folder, model, ["photo of a dog"], 3, SETTINGS, False).rows) == 1

    # another class prompt, resolution or seed into the same folder: an error naming what differs
    for prompts, settings, differs in ((["photo of a cat"], SETTINGS, "prompts"),
                                       (["photo of a dog"], drawing.ImageSettings(3, resolution=128, seed=1),
                                        "resolution"),
                                       (["photo of a dog"], drawing.ImageSettings(3, seed=2), "seed")):
        with pytest.raises(errors.UserError, match=f"its 2 images were drawn with .*\\(different: {differs}\\).*--force"):
            drawing.top_up(folder, model, prompts, 3, settings, False)
    # --force deletes them and draws these; evaluate's "redraw" does it with a line
    job = drawing.top_up(folder, model, ["photo of a cat"], 2, SETTINGS, False, on_mismatch="force")
    assert len(job.rows) == 2 and image_records.drawn_images(folder) == []
    open(os.path.join(folder, job.rows[1]["file"]), "wb").close()  # the same model and settings: kept
    assert len(drawing.top_up(folder, model, ["photo of a cat"], 2, SETTINGS, False, on_mismatch="force").rows) == 1
    os.remove(os.path.join(folder, job.rows[1]["file"]))
    open(os.path.join(folder, job.rows[0]["file"]), "wb").close()
    other = outputs.ModelRef(tiny_model, lora_dir=None, lora_scale=0.5)  # same weights, same fingerprint
    assert len(drawing.top_up(folder, other, ["photo of a cat"], 2, SETTINGS, False).rows) == 1
    capsys.readouterr()
    retrained = tmp_path / "tuned"
    retrained.mkdir()
    files.write_json(retrained / files.OUTPUT_MARKER, {"base_model": tiny_model, "model_id": "x"})
    shutil.copytree(tiny_model, retrained, dirs_exist_ok=True)
    job = drawing.top_up(folder, outputs.ModelRef(str(retrained)), ["photo of a cat"], 2, SETTINGS, False,
                         on_mismatch="redraw", label="tuned")
    assert len(job.rows) == 2 and "(different: model); replacing them" in capsys.readouterr().err
    # retrained in the same folder: the folder named once, the two models by their ids
    open(os.path.join(folder, job.rows[0]["file"]), "wb").close()
    files.write_json(retrained / files.OUTPUT_MARKER, {"base_model": tiny_model, "model_id": "b" * 32})
    drawing.top_up(folder, outputs.ModelRef(str(retrained)), ["photo of a cat"], 2, SETTINGS, False,
                   on_mismatch="redraw", label="tuned")
    err = capsys.readouterr().err
    assert f"were drawn with model {retrained} (trained:x), not this run's model retrained there (trained:bbbbbbbb) " \
           "(different: model)" in err and err.count(str(retrained)) == 1, err


def test_top_up_takes_the_images_another_folder_holds_of_the_same_model_and_settings(tiny_model, tmp_path, capsys):
    """donors (evaluate.py: the images Step 4's scoring drew): the missing images are copied from a folder whose record is
    this one (a withheld image's marker too), whole; a folder of another seed or model gives none."""
    model, prompts = outputs.ModelRef(tiny_model), ["photo of a dog", "photo of a cat"]
    donor, other_seed, folder = (str(tmp_path / name) for name in ("donor", "seed-2", "eval"))
    for where, settings in ((donor, SETTINGS), (other_seed, drawing.ImageSettings(3, seed=2))):
        for row in drawing.top_up(where, model, prompts, 2, settings, False).rows:
            name = row["file"] + (drawing.FLAGGED_SUFFIX if row["file"].startswith("photo-of-a-cat-00001") else "")
            open(os.path.join(where, name), "wb").write(f"{where} {row['file']}".encode())
    os.remove(os.path.join(donor, drawing.image_file_name("photo of a cat", 0)))  # (one it lacks: drawn here)
    capsys.readouterr()
    job = drawing.top_up(folder, model, prompts, 2, SETTINGS, False, label="base", donors=(other_seed, donor))
    assert [row["file"] for row in job.rows] == [drawing.image_file_name("photo of a cat", 0)]
    assert open(os.path.join(folder, "photo-of-a-dog-00001.png"), "rb").read() == f"{donor} photo-of-a-dog-00001.png".encode()
    assert os.path.exists(os.path.join(folder, "photo-of-a-cat-00001.png" + drawing.FLAGGED_SUFFIX))
    err = capsys.readouterr().err
    assert f"base: 3 images taken from {donor}, where the same model drew them with the same settings" in err
    assert "base: 3 of 4 images already there; generating 1" in err and other_seed not in err
    # another model's images (the same settings) are not taken
    retrained = tmp_path / "tuned"
    shutil.copytree(tiny_model, retrained)
    files.write_json(retrained / files.OUTPUT_MARKER, {"base_model": tiny_model, "model_id": "x"})
    job = drawing.top_up(str(tmp_path / "tuned-eval"), outputs.ModelRef(str(retrained)), prompts, 2, SETTINGS, False,
                         donors=(donor,))
    assert len(job.rows) == 4 and image_records.drawn_images(str(tmp_path / "tuned-eval")) == []


def test_images_without_a_record_are_not_mixed_with_new_ones(tiny_model, tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / drawing.image_file_name("photo of a dog", 0)).write_bytes(b"")
    (folder / "mine.jpg").write_bytes(b"")  # not ours: left alone
    with pytest.raises(errors.UserError, match="have no record"):
        drawing.top_up(str(folder), outputs.ModelRef(tiny_model), ["photo of a dog"], 1, SETTINGS, False)
    drawing.top_up(str(folder), outputs.ModelRef(tiny_model), ["photo of a dog"], 1, SETTINGS, False, "force")
    assert sorted(os.listdir(folder)) == sorted(["mine.jpg", image_records.IMAGES_RECORD])


def test_output_dir_that_is_not_ours_is_refused(tmp_path):
    (tmp_path / "thesis.tex").write_text("precious")
    with pytest.raises(errors.UserError, match="--overwrite"):
        outputs.check_output_dir(str(tmp_path), overwrite=False)
    outputs.check_output_dir(str(tmp_path), overwrite=True)


def test_the_train_record_round_trips_and_reads_older_records(make_plan):
    record = outputs.TrainRecord.of_plan(make_plan(use_lora=True, lora_rank=8, lora_alpha=4.0, held_out=("c.jpg",)))
    data = record.to_json()
    assert data["lora"] == {"rank": 8, "lora_alpha": 4.0} and data["held_out"] == ["c.jpg"]  # the file's keys
    assert outputs.TrainRecord.from_json(data) == record
    assert outputs.TrainRecord.of_plan(make_plan()).model_id != record.model_id  # every save its own id
    old = outputs.TrainRecord.from_json({"base_model": "/m", "steps": 10, "retired_key": 1})
    assert (old.base_model, old.steps, old.lora, old.model_id, old.held_out) == ("/m", 10, None, None, ())


def test_a_folders_model_is_named_by_its_hub_name_and_short_commit_else_by_its_folder(tiny_model, tmp_path):
    """The line that refuses to mix images names a hub snapshot as name@commit (its hub-cache path is long and
    says no more; a Step 3 refusal was 719 characters), any other folder by its path and fingerprint."""
    hub = outputs.model_fingerprint(tiny_model)
    name, commit = hub.split("@")
    record = image_records.ImageRecord(hub, tiny_model, ("p",), 64, 0, 3, 7.5, None)
    assert record.describe(["model"]) == f"model {name}@{commit[:12]}"
    copy = str(shutil.copytree(tiny_model, tmp_path / "mine"))
    local = image_records.ImageRecord(outputs.model_fingerprint(copy), copy, ("p",), 64, 0, 3, 7.5, None)
    assert local.describe(["model"]) == f"model {copy} ({local.model})" and local.model.startswith("files:")

"""run_identity.py: what decides a run's weights, and the resumes and reuses it allows (planning and
checkpoint on files, no Ray)."""

import os
import re
import shutil

import pytest

from dreambooth import errors
from dreambooth import files
from dreambooth.planning import checkpoints
from dreambooth.planning import planning
from dreambooth.planning import run_identity


def argv(model, photos, out, *extra):
    return ["--model_dir", model, "--output_dir", str(out), "--instance_data_dir", str(photos),
            "--instance_prompt", "photo of unqtkn toy", *extra]


def identity(*args):
    return planning.plan_run(planning.parse_args(argv(*args)), lambda: (4.0, 0)).identity


def fake_checkpoint(storage, run, identity_of, step=2):
    folder = storage / run / "checkpoint_0"
    folder.mkdir(parents=True)
    (folder / "unet.safetensors").write_bytes(b"w")
    files.write_json(str(folder / checkpoints.STATE_FILE), {"step": step, "identity": identity_of,
                                                            "sizes": {"unet.safetensors": 1}})
    return str(folder)


def test_what_decides_the_weights_is_in_the_identity_and_what_does_not_is_not(tiny_model, tiny_sd2v_model,
                                                                             toy_images, tmp_path):
    out = tmp_path / "out"
    base = identity(tiny_model, toy_images, out)
    # how the run goes, not where it ends: same identity
    assert base == identity(tiny_model, toy_images, out, "--num_workers", "2", "--logging_steps", "7",
                            "--checkpointing_steps", "9", "--validation_prompt", "a toy", "--gradient_checkpointing",
                            "--max_failures", "0", "--torch_compile", "default")
    photos = shutil.copytree(toy_images, tmp_path / "photos")
    assert identity(tiny_model, photos, out) == base  # the same photos elsewhere
    from PIL import Image

    with Image.open(photos / "toy-1.jpg") as photo:  # one photo replaced by another of the same name
        photo.rotate(90).save(photos / "toy-1.jpg")
    cases = [
        (identity(tiny_model, photos, out), "the photos (their content)"),
        (identity(tiny_sd2v_model, toy_images, out), "the base model"),
        (identity(tiny_model, toy_images, out, "--learning_rate", "1e-5"), "--learning_rate 5e-06 -> 1e-05"),
        (identity(tiny_model, toy_images, out, "--holdout", "1"), 'held-out [] -> ["toy-4.jpg"]'),
        (identity(tiny_model, toy_images, out, "--resolution", "32"), "resolution 64 -> 32"),
        (identity(tiny_model, toy_images, out, "--use_lora", "--rank", "8"), "--lora_rank 4 -> 8"),
        (identity(tiny_model, toy_images, out, "--seed", "3"), "--seed 0 -> 3"),
        (identity(tiny_model, toy_images, out, "--max_train_steps", "9"), "--max_train_steps"),
        (identity(tiny_model, toy_images, out, "--use_ema"), "--use_ema False -> True"),
        (identity(tiny_model, toy_images, out, "--mixed_precision", "bf16"), "--mixed_precision"),
    ]
    from dreambooth.planning import run_identity

    for other, said in cases:
        differs = run_identity.differences(base, other)
        assert any(said in d for d in differs), (said, differs)
    assert run_identity.differences(None, base) == ["its settings (it was written before runs recorded them)"]


def test_a_rerun_with_other_photos_never_resumes_the_stopped_run(tiny_model, toy_images, tmp_path, capsys):
    """The stopped run's checkpoint is in the output's storage; a rerun with other photos and another
    prompt into the same output starts afresh saying what differs; the same command again resumes the
    newest checkpoint of its own identity, also when another run's checkpoint is newer."""
    out, storage = tmp_path / "model-tuned", tmp_path / "ray_results"
    first = identity(tiny_model, toy_images, out)
    stopped = fake_checkpoint(storage, "model-tuned-20260101-000000", first)
    photos = shutil.copytree(toy_images, tmp_path / "rex")
    os.remove(photos / "toy-0.jpg")
    args = planning.parse_args(argv(tiny_model, photos, out, "--instance_prompt", "photo of unqtkn dog",
                                    "--resume_from_checkpoint", "auto"))
    capsys.readouterr()
    plan = planning.plan_run(args, lambda: (4.0, 0))
    err = capsys.readouterr().err
    assert plan.resume_path is None and "resuming from" not in err
    assert re.search(r"not resuming \S+: it is of another run \(the photos \(their content\); captions .*; "
                     r"--instance_prompt photo of unqtkn toy -> photo of unqtkn dog\)", err)
    fake_checkpoint(storage, "model-tuned-20260102-000000", plan.identity)  # the second run, stopped too
    os.utime(os.path.join(stopped, checkpoints.STATE_FILE))  # ... and the first one's now the newest
    again = planning.parse_args(argv(tiny_model, photos, out, "--instance_prompt", "photo of unqtkn dog",
                                     "--resume_from_checkpoint", "auto"))
    assert planning.plan_run(again, lambda: (4.0, 0)).resume_path == str(
        storage / "model-tuned-20260102-000000" / "checkpoint_0")
    # an explicit checkpoint of another run is refused, naming what differs
    refused = planning.parse_args(argv(tiny_model, toy_images, out, "--resume_from_checkpoint",
                                       str(storage / "model-tuned-20260102-000000" / "checkpoint_0")))
    with pytest.raises(errors.UserError, match=r"is of another run: the photos \(their content\)"):
        planning.plan_run(refused, lambda: (4.0, 0))


def test_a_finished_model_of_the_same_run_is_kept_and_another_replaced(tiny_model, toy_images, tmp_path, capsys):
    out = tmp_path / "model-tuned"
    same = identity(tiny_model, toy_images, out)
    out.mkdir()
    files.write_json(str(out / files.OUTPUT_MARKER), {"base_model": tiny_model, "identity": same})
    auto = planning.parse_args(argv(tiny_model, toy_images, out, "--resume_from_checkpoint", "auto"))
    with pytest.raises(planning.AlreadyTrained, match="holds the finished model of this run"):
        planning.plan_run(auto, lambda: (4.0, 0))
    other = planning.parse_args(argv(tiny_model, toy_images, out, "--resume_from_checkpoint", "auto", "--seed", "5"))
    capsys.readouterr()
    planning.plan_run(other, lambda: (4.0, 0))
    assert "holds the model of another run (--seed 0 -> 5): training this one replaces it" in capsys.readouterr().err
    # without auto (a plain train.py run) nothing is kept: it trains
    planning.plan_run(planning.parse_args(argv(tiny_model, toy_images, out)), lambda: (4.0, 0))


def test_more_steps_continue_a_run_only_under_a_constant_learning_rate(tiny_model, toy_images, tmp_path, capsys):
    """A stopped (or finished) 4-step run, rerun with --max_train_steps 8: continued when the schedule
    does not depend on the length (the result is the 8-step run's), else started afresh saying why."""
    out, storage = tmp_path / "model-tuned", tmp_path / "ray_results"
    short = fake_checkpoint(storage, "model-tuned-20260101-000000",
                            identity(tiny_model, toy_images, out, "--max_train_steps", "4"), step=4)
    longer = planning.parse_args(argv(tiny_model, toy_images, out, "--max_train_steps", "8",
                                      "--resume_from_checkpoint", "auto"))
    capsys.readouterr()
    assert planning.plan_run(longer, lambda: (4.0, 0)).resume_path == short
    assert "--max_train_steps 4 -> 8: continuing that run (--lr_scheduler constant_with_warmup" in \
        capsys.readouterr().err
    cosine = planning.parse_args(argv(tiny_model, toy_images, out, "--max_train_steps", "8", "--resume_from_checkpoint",
                                      "auto"))
    cosine_short = tmp_path / "cosine"
    fake_checkpoint(cosine_short, "model-tuned-20260101-000000",
                    identity(tiny_model, toy_images, out, "--max_train_steps", "4", "--lr_scheduler", "cosine"))
    cosine.storage_path, cosine.lr_scheduler = str(cosine_short), "cosine"
    assert planning.plan_run(cosine, lambda: (4.0, 0)).resume_path is None
    assert "--max_train_steps 4 -> 8 (" \
           "--lr_scheduler cosine is planned over the whole run)" in capsys.readouterr().err
    fewer = planning.parse_args(argv(tiny_model, toy_images, out, "--max_train_steps", "2",
                                     "--resume_from_checkpoint", "auto"))
    assert planning.plan_run(fewer, lambda: (4.0, 0)).resume_path is None  # fewer steps: never a continuation
    # another learning rate too: nothing is continued, and nothing says it would be
    said = run_identity.differences({"max_train_steps": 20, "learning_rate": 1e-4, "lr_scheduler": "constant"},
                                    {"max_train_steps": 80, "learning_rate": 5e-6, "lr_scheduler": "constant"})
    assert said == ["--learning_rate 0.0001 -> 5e-06", "--max_train_steps 20 -> 80"]
    # another family: its own settings (Flux.1's guidance, the flow shift) are the family's change, not news
    said = run_identity.differences({"family": "sd1", "learning_rate": 1e-4, "snr_gamma": None},
                                    {"family": "flux", "learning_rate": 1e-4, "guidance_scale": 3.5, "flow_shift": 3.0})
    assert said == ["family sd1 -> flux"], said


def test_a_changed_flag_of_a_group_is_named_alone():
    """--keep_best's scoring settings are one entry of the identity: a change names the flag that changed (dreambooth_run.sh's
    NUM_EVAL_IMAGES is --eval_images_per_prompt), not the group's dict cut short."""
    saved = {"keep_best": {"clip_t_margin": 0.02, "eval_images_per_prompt": 1, "score_steps": 10}}
    current = {"keep_best": {"clip_t_margin": 0.02, "eval_images_per_prompt": 2, "score_steps": 10}}
    assert run_identity.differences(saved, current) == ["--eval_images_per_prompt 1 -> 2"]


def test_a_flag_recorded_only_off_its_default_is_named_by_its_value_not_none():
    """An identity holds --optimizer, --adapter and the quantisation only when they are not the default, --keep_best's
    scoring only when it is on: a change says the default's name (adamw, lora, off), never None or the group's dict,
    and not the other optimizer's own flags one by one."""
    prodigy = {"optimizer": "prodigy", "prodigy_beta3": None, "prodigy_decouple": True, "adapter": "dora",
               "keep_best": {"clip_t_margin": 0.02, "eval_images_per_prompt": 1, "score_steps": 10}}
    assert run_identity.differences(prodigy, {}) == ["--adapter dora -> lora", "--keep_best on -> off",
                                                     "--optimizer prodigy -> adamw"]
    assert run_identity.differences({}, {"base_precision": "nf4"}) == ["--base_precision none -> nf4"]


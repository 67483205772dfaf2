"""preflight.py: what dreambooth_run.sh checks before Step 1 (the script's own failures are in
test_dreambooth_run; here the worker arithmetic, the disk estimate and a real 2-node cluster whose
second node has its own DATA_PREFIX)."""

import shutil

import pytest

from dreambooth import errors
from dreambooth.commands import preflight


def args(**given):
    return preflight.parse_args(["--photos_dir", "/p", "--data_prefix", "/d", *[
        f"--{k}={v}" if v is not True else f"--{k}" for k, v in given.items()]])


def test_workers_default_to_one_per_gpu_and_too_many_name_the_variable(capsys):
    assert preflight.check_workers(args(), cpus=16, gpus=1) == 1
    assert preflight.check_workers(args(), cpus=16, gpus=8) == 8
    assert preflight.check_workers(args(gpus_per_worker=2), cpus=16, gpus=8) == 4
    with pytest.raises(errors.UserError, match=r"NUM_WORKERS=2 x GPUS_PER_WORKER=1 needs 2 GPUs; the Ray cluster "
                                              r"has 1: set NUM_WORKERS=1"):
        preflight.check_workers(args(num_workers=2), cpus=16, gpus=1)
    assert capsys.readouterr().err == ""
    assert preflight.check_workers(args(), cpus=2, gpus=0) == 1
    err = capsys.readouterr().err
    assert "no GPU" in err and "Stable Diffusion" not in err  # on CPUs: said before Step 1 (any family: no SD name)
    assert "`ray stop` stops every Ray cluster of this machine" in err  # (not advised as the fix)
    assert preflight.check_workers(args(tiny=True), cpus=2, gpus=0) == 1 and capsys.readouterr().err == ""
    with pytest.raises(errors.UserError, match="NUM_WORKERS=3: .* 2 CPUs"):
        preflight.check_workers(args(num_workers=3, tiny=True), cpus=2, gpus=0)


def test_disk_estimate_is_model_checkpoint_and_output(tiny_model, tmp_path):
    from dreambooth.models import known_models

    full, parts = preflight.disk_needed_gb(args(model_name="sd15"))
    # the checkpoint kept (--checkpoints_total_limit 1) and the next one Ray writes before removing it: 12 bytes
    # (fp32 weight, AdamW's two moments) of each trained parameter, UNet 860M + text encoder 123M
    checkpoint_gb = 12 * (859.5e6 + 123.1e6) / 1e9
    assert full == pytest.approx(4.3 + 2 * checkpoint_gb, rel=1e-3) and "1 checkpoint(s) kept of 11.8" in parts
    three, _ = preflight.disk_needed_gb(args(model_name="sd15"), limit=3)
    assert three == pytest.approx(4.3 + 4 * checkpoint_gb, rel=1e-3)
    # Flux.1 dev's files are bf16 and T5 is never trained: its checkpoint is 12 bytes of the transformer and
    # CLIP-L's parameters (11.9B + 0.12B), not three times the 33.8 GB download
    # (the tuned model: the download with the transformer and CLIP-L in fp32, 24 GB more)
    flux, parts = preflight.disk_needed_gb(args(model_name="flux-dev"))
    assert "1 checkpoint(s) kept of 144." in parts and flux == pytest.approx(33.8 + 2 * 12 * 12.02e9 / 1e9, rel=2e-3)
    assert preflight.known_full_gb(args(model_name="flux-dev"), known_models.known_model("flux-dev"))[1] == \
        pytest.approx(33.8 + 2 * 12.02, rel=2e-3)
    assert preflight.known_full_gb(args(model_name="sd15"), known_models.known_model("sd15"))[1] == 4.3
    # a 2026 family's short name is counted at its own size (Chroma1-HD: its 8.90B transformer trained, T5 frozen)
    assert preflight.known_full_gb(args(model_name="chroma"), known_models.known_model("chroma")) == \
        pytest.approx((12 * 8.90, 27.5 + 2 * 8.90), rel=2e-3)
    lora, _ = preflight.disk_needed_gb(args(model_name="sd15", use_lora=True))
    assert lora == pytest.approx(4.3 + 2 * preflight.disk.LORA_BYTES / preflight.GB)
    cached, parts = preflight.disk_needed_gb(args(model_name="sd15", model_path=tiny_model))
    assert cached < 0.1 and parts.startswith("model 0.0")  # cached already: nothing to download
    # the script knows only ORIG_MODEL_DIR before Step 1: a pinned model already cached there is found
    from dreambooth.models import modelcache

    known = known_models.known_model("sd15")
    shutil.copytree(tiny_model, modelcache.hub_snapshot_path(str(tmp_path / "cache"), known.hub_name, known.revision))
    _, parts = preflight.disk_needed_gb(args(model_name="sd15", model_cache=str(tmp_path / "cache")))
    assert parts.startswith("model 0.0")


def test_a_subject_model_of_another_family_or_mode_is_said_at_step_0(tmp_path, capsys):
    """TUNED_MODEL_DIR with the subject's LoRA of SD 1.x: a Flux.1 run, or a full fine-tune, says at Step 0 that Step 4
    replaces it and how to keep both (it was said only at Step 4, after the download and the class images); the
    same family and mode say nothing (Step 4 continues or keeps it)."""
    import json

    from dreambooth import files

    tuned = tmp_path / "subjects" / "rex" / "model-tuned"
    tuned.mkdir(parents=True)
    (tuned / files.OUTPUT_MARKER).write_text(json.dumps({"base_model": "/m", "identity": {"family": "sd1",
                                                                                          "use_lora": True}}))
    for given, said, suffix in (({"arch": "flux", "use_lora": True}, "(sd1 -> flux)", "flux"),
                                ({}, "(LoRA -> full fine-tune)", "full"), ({"use_lora": True}, None, None)):
        run = args(tiny=True, tuned_model_dir=str(tuned), **given)
        preflight.note_replaced_model(run, preflight.planned_family(run))
        err = capsys.readouterr().err
        assert (f"holds this subject's LoRA of the sd1 family {said}: Step 4 replaces it" in err) if said else not err
        assert (f"give this run its own SUBJECT (e.g. SUBJECT=rex-{suffix})\n" in err) if said else True



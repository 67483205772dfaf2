"""checkpoint.py: the format round-trips the whole training state, on any layout and any rank."""

import json
import os
import re

import pytest
import torch

from dreambooth import families
from dreambooth import filemodes
from dreambooth import files
from dreambooth.models import networks
from dreambooth.planning import checkpoints
from dreambooth.training import checkpoint
from dreambooth.training import steps

CPU = torch.device("cpu")


def trained_state(make_plan, step_prompts, channels_last=False, steps_taken=2, **settings):
    plan = make_plan(channels_last=channels_last, **settings)
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    state = steps.make_train_state(nets, plan)
    batch = {"instance_pixels": torch.randint(0, 256, (1, 64, 64, 3), dtype=torch.uint8),
             "class_pixels": torch.randint(0, 256, (1, 64, 64, 3), dtype=torch.uint8)}
    for _ in range(steps_taken):
        steps.train_step(state, [batch], step_prompts, 1.0, 1.0)
    state.step = steps_taken
    return state


def test_channels_last_weights_are_saved(make_plan, step_prompts, tmp_path):
    """The GPU default layout: safetensors refuses non-contiguous tensors unless made contiguous."""
    state = trained_state(make_plan, step_prompts, channels_last=True, steps_taken=1)
    checkpoint.save(state, str(tmp_path), 0, [checkpoint.rng_state()], train_text_encoder=True)
    assert checkpoints.is_complete(str(tmp_path))
    fresh = trained_state(make_plan, step_prompts, channels_last=True, steps_taken=0)
    checkpoint.load(fresh, str(tmp_path), rank=0)
    for k, v in networks.unwrap(state.models.denoiser).state_dict().items():
        assert torch.equal(v, fresh.models.denoiser.state_dict()[k])


def test_round_trip_restores_weights_optimizer_schedule_and_position(make_plan, step_prompts, tmp_path):
    state = trained_state(make_plan, step_prompts)
    checkpoint.save(state, str(tmp_path), 1, [checkpoint.rng_state()], train_text_encoder=True)
    rng_after_save = torch.rand(3)
    fresh = trained_state(make_plan, step_prompts, steps_taken=0)
    assert checkpoint.load(fresh, str(tmp_path), rank=0) == 1
    assert fresh.step == 2 and checkpoints.saved_step(str(tmp_path)) == 2
    assert fresh.lr_scheduler.last_epoch == state.lr_scheduler.last_epoch
    for name in ("denoiser", "text_encoder"):
        for k, v in getattr(state.models, name).state_dict().items():
            assert torch.equal(v, getattr(fresh.models, name).state_dict()[k]), (name, k)
    opt_a, opt_b = state.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"]) for k in opt_a)
    assert torch.equal(torch.rand(3), rng_after_save)


def test_the_fp16_loss_scale_round_trips(make_plan, step_prompts, tmp_path):
    """fp16's GradScaler: its scale, lowered by the overflows of the steps before (a resumed run that started again at
    the first scale would skip steps the uninterrupted one took). (The every-GPU-option resume, in fp16 over two
    workers, passed with the scale's restore removed: its few steps cannot show this.)"""
    state = trained_state(make_plan, step_prompts, steps_taken=0, mixed_precision="fp16")
    state.scaler.scale(torch.ones(1))  # (the scale is made at its first use)
    state.scaler.update(new_scale=torch.tensor(512.0))  # as after 7 overflows
    checkpoint.save(state, str(tmp_path), 0, [checkpoint.rng_state()], train_text_encoder=True)
    fresh = trained_state(make_plan, step_prompts, steps_taken=0, mixed_precision="fp16")
    checkpoint.load(fresh, str(tmp_path), rank=0)
    assert fresh.scaler.get_scale() == 512.0 and fresh.scaler.state_dict() == state.scaler.state_dict()


def test_each_rank_continues_its_own_rng_stream(make_plan, step_prompts, tmp_path):
    state = trained_state(make_plan, step_prompts, steps_taken=1)
    streams = []
    for rank in range(3):
        torch.manual_seed(100 + rank)
        streams.append(checkpoint.rng_state())
    checkpoint.save(state, str(tmp_path), 0, streams, train_text_encoder=True)
    draws = []
    for rank in range(3):
        torch.manual_seed(7)  # whatever the worker seeded before loading
        checkpoint.load(state, str(tmp_path), rank)
        draws.append(torch.rand(4))
    for rank in range(3):
        torch.manual_seed(100 + rank)
        assert torch.equal(draws[rank], torch.rand(4))
    assert not torch.equal(draws[0], draws[1])
    checkpoint.load(state, str(tmp_path), rank=5)  # a rank the saving run did not have: a stream of its own
    assert not any(torch.equal(torch.rand(4), d) for d in draws)


def test_frozen_text_encoder_is_not_written_and_the_manifest_checks_sizes(make_plan, step_prompts, tmp_path):
    state = trained_state(make_plan, step_prompts, steps_taken=1)
    checkpoint.save(state, str(tmp_path), 0, [checkpoint.rng_state()], train_text_encoder=False)
    assert sorted(os.listdir(tmp_path)) == [checkpoint.OPTIMIZER_FILE, checkpoints.STATE_FILE, "unet.safetensors"]
    assert checkpoints.is_complete(str(tmp_path))
    with open(tmp_path / "unet.safetensors", "ab") as f:
        f.write(b"x")  # a copy that differs from what was saved
    assert not checkpoints.is_complete(str(tmp_path))


def test_find_latest_picks_the_newest_complete_checkpoint_of_the_run(tmp_path, capsys):
    def fake(run, name, step, complete=True):
        folder = tmp_path / run / name
        folder.mkdir(parents=True)
        (folder / "unet.safetensors").write_bytes(b"w" * step)
        sizes = {"unet.safetensors": step if complete else step + 1}
        (folder / checkpoints.STATE_FILE).write_text(json.dumps({"step": step, "sizes": sizes}))
        os.utime(folder / checkpoints.STATE_FILE, (step, step))
        return str(folder)

    fake("model-tuned-20260101-000001", "checkpoint_a", 2)
    newest = fake("model-tuned-20260101-000002", "checkpoint_b", 4)
    fake("model-tuned-20260101-000002", "checkpoint_c", 6, complete=False)
    fake("other-1", "checkpoint_d", 8)
    fake("model-tuned-bella-20260101-000000", "checkpoint_e", 9)  # another output's run, named alike
    assert checkpoints.find_latest(str(tmp_path), "model-tuned") == newest
    assert checkpoints.resolve_resume("latest", str(tmp_path), "model-tuned") == newest
    assert capsys.readouterr().err == f"resuming from {newest} (step 4)\n"  # (which step: the line says it)
    assert checkpoints.find_latest(str(tmp_path), "absent") is None
    with pytest.raises(Exception, match="not a complete checkpoint"):
        checkpoints.resolve_resume(str(tmp_path / "model-tuned-20260101-000002" / "checkpoint_c"), str(tmp_path), "model-tuned")
    # auto (dreambooth_run.sh's): the newest run crashed before it saved a model: resume it; once the
    # output's record names that run, it finished: a rerun starts afresh
    output = tmp_path / "model-tuned"
    assert checkpoints.resolve_resume("auto", str(tmp_path), "model-tuned", str(output)) == newest
    output.mkdir()
    files.write_json(output / files.OUTPUT_MARKER, {"base_model": "/m", "run_name": "model-tuned-20260101-000001"})
    assert checkpoints.resolve_resume("auto", str(tmp_path), "model-tuned", str(output)) == newest
    files.write_json(output / files.OUTPUT_MARKER, {"base_model": "/m", "run_name": "model-tuned-20260101-000002"})
    assert checkpoints.resolve_resume("auto", str(tmp_path), "model-tuned", str(output)) is None


def test_a_run_in_one_process_keeps_its_checkpoints_in_its_run_folder_up_to_the_limit(tmp_path):
    """--num_workers 0 (Ray Train's local mode keeps no checkpoint): each saved folder's files go into the run folder
    as Ray Train names its own, complete once its state file is there, and the oldest beyond
    --checkpoints_total_limit are removed; find_latest and by_step see them as they see Ray Train's, their modes the
    user's umask's (safetensors writes its files for their owner only)."""
    run = tmp_path / "runs" / "model-tuned-20260101-000001"
    for step in (1, 2, 3):
        saved = tmp_path / f"saved-{step}"
        saved.mkdir()
        (saved / "unet.safetensors").write_bytes(b"w" * step)
        os.chmod(saved / "unet.safetensors", 0o600)
        files.write_json(saved / checkpoints.STATE_FILE, {"step": step, "sizes": {"unet.safetensors": step}})
        checkpoint.keep_in_run(str(saved), str(run), limit=2)
        assert os.listdir(saved) == []  # (moved, not copied)
    kept = sorted(os.listdir(run))
    assert len(kept) == 2 and all(re.fullmatch(r"checkpoint_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\.\d{6}", n) for n in kept)
    assert sorted(checkpoints.by_step(str(tmp_path / "runs"), "model-tuned")) == [2, 3]
    assert checkpoints.saved_step(checkpoints.find_latest(str(tmp_path / "runs"), "model-tuned")) == 3
    umask = filemodes.current_umask()
    assert {oct(os.stat(run / k / "unet.safetensors").st_mode & 0o777) for k in kept} == {oct(0o666 & ~umask)}


def test_the_earlier_attempts_of_a_run_are_the_runs_whose_checkpoints_carry_its_identity(tmp_path):
    """A run stopped twice and resumed each time: when it ends, every earlier attempt's run folder (all of its
    checkpoints written with the run's identity) is its past, whose checkpoints the driver removes; a run of other
    settings, or of another output, is not (a walk found the first attempt's checkpoint left behind)."""
    def fake(run, name, identity):
        folder = tmp_path / run / name
        folder.mkdir(parents=True)
        (folder / "unet.safetensors").write_bytes(b"w")
        (folder / checkpoints.STATE_FILE).write_text(json.dumps({"step": 1, "sizes": {"unet.safetensors": 1},
                                                                 "identity": identity}))

    ours, theirs = {"learning_rate": 1e-6}, {"learning_rate": 2e-6}
    fake("model-tuned-20260101-000001", "checkpoint_a", ours)  # the first attempt, stopped
    fake("model-tuned-20260101-000002", "checkpoint_b", ours)  # the second, resumed from it and stopped again
    fake("model-tuned-20260101-000003", "checkpoint_c", theirs)  # another run's (other settings)
    fake("model-tuned-bella-20260101-000000", "checkpoint_d", ours)  # another output's
    runs = checkpoints.runs_of_identity(str(tmp_path), "model-tuned", ours)
    assert sorted(os.path.basename(r) for r in runs) == ["model-tuned-20260101-000001", "model-tuned-20260101-000002"]
    assert checkpoints.runs_of_identity(str(tmp_path), "model-tuned", None) == []
    for run in runs:
        assert checkpoints.remove_all(run)[0] == 1
    left = sorted(os.path.basename(f) for f in checkpoints.complete_checkpoints(str(tmp_path), "model-tuned"))
    assert left == ["checkpoint_c"] and (tmp_path / "model-tuned-bella-20260101-000000" / "checkpoint_d").is_dir()


@pytest.mark.parametrize("resume", ["auto", "latest"])
def test_a_saved_model_takes_the_checkpoints_of_stopped_runs_of_other_settings_with_it_under_auto(tmp_path, capsys,
                                                                                                  resume):
    """dreambooth_run.sh's rerun after a stop and a change (another photo, another learning rate) starts afresh
    into the same output; once its model is saved, the stopped run's checkpoints go too (a walk found them left
    behind: 12 GB for a full SD 1.x run), said in a line of their own. Not with an explicit --resume_from_checkpoint
    latest (such a run may be resumed later), and never another output's runs."""
    import types

    from dreambooth.training import driver

    storage = tmp_path / "ray_results"

    def fake(run, identity):
        folder = storage / run / "checkpoint_000"
        folder.mkdir(parents=True)
        (folder / "unet.safetensors").write_bytes(b"w")
        (folder / checkpoints.STATE_FILE).write_text(json.dumps({"step": 1, "sizes": {"unet.safetensors": 1},
                                                                 "identity": identity}))
        return str(storage / run)

    ours, theirs = {"learning_rate": 1e-6}, {"learning_rate": 2e-6}
    stopped = fake("model-tuned-20260101-000001", theirs)  # stopped, then the settings changed
    this_run = fake("model-tuned-20260101-000002", ours)
    bella = fake("model-tuned-bella-20260101-000000", theirs)  # another output's, named alike
    plan = types.SimpleNamespace(output_dir=str(tmp_path / "model-tuned"), storage_path=str(storage), identity=ours,
                                 resume_path=None)
    driver.remove_checkpoints(plan, resume, this_run)
    left = {os.path.basename(os.path.dirname(f)) for f in checkpoints.complete_checkpoints(str(storage), "model-tuned")}
    err = capsys.readouterr().err
    assert "removed the run's 1 checkpoint(s)" in err and os.path.isdir(os.path.join(bella, "checkpoint_000"))
    if resume == "auto":
        assert left == set() and re.search(r"removed 1 checkpoint\(s\) \(\d+ B\) of stopped runs of other settings into ", err)
    else:
        assert left == {os.path.basename(stopped)} and "other settings" not in err


def test_lora_checkpoint_holds_only_the_adapters(make_plan, step_prompts, tmp_path):
    def lora_state(steps_taken):
        plan = make_plan(use_lora=True, lora_rank=4, lora_alpha=4.0)
        nets = networks.setup_models(plan, CPU, CPU, distributed=False)
        state = steps.make_train_state(nets, plan)
        batch = {"instance_pixels": torch.randint(0, 256, (1, 64, 64, 3), dtype=torch.uint8)}
        for _ in range(steps_taken):
            steps.train_step(state, [batch], step_prompts, 1.0, 1.0)
        state.step = steps_taken
        return plan, state

    plan, state = lora_state(2)
    checkpoint.save(state, str(tmp_path), 0, [checkpoint.rng_state()], True, {"lora_rank": 4})
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "unet.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    _, fresh = lora_state(0)
    checkpoint.load(fresh, str(tmp_path), rank=0)
    for name in ("denoiser", "text_encoder"):
        for k, v in getattr(state.models, name).state_dict().items():
            assert torch.equal(v, getattr(fresh.models, name).state_dict()[k]), (name, k)
    assert checkpoints.saved_identity(str(tmp_path)) == {"lora_rank": 4}  # what the run recorded


@pytest.mark.parametrize("optimizer, adapter", [("adamw8bit", None), ("prodigy", None), ("adamw_schedulefree", None),
                                               ("adamw", "dora"), ("adamw", "loha"), ("adamw", "lokr")])
def test_each_optimizer_and_adapter_trains_and_resumes_from_its_checkpoint_to_the_uninterrupted_weights(
        optimizer, adapter, make_plan, step_prompts, tmp_path):
    """--optimizer adamw8bit (bitsandbytes' AdamW8bit runs on CPU too), prodigy and adamw_schedulefree, and
    --adapter dora: two steps, a checkpoint, and one more step from it gives exactly the weights of the run that
    went on without one (the optimizer's state, Prodigy's step-size estimate, schedule-free's averaging point,
    DoRA's magnitudes, all saved and restored)."""
    # (Prodigy without the bias correction and warm-up safeguard of diffusers' defaults: its estimate moves at once)
    prodigy = dict(prodigy_use_bias_correction=False, prodigy_safeguard_warmup=False) if optimizer == "prodigy" else {}
    plan = make_plan(optimizer=optimizer, use_8bit_adam=optimizer == "adamw8bit", train_text_encoder=False,
                     learning_rate=1.0 if optimizer == "prodigy" else 1e-4, lr_scheduler="constant",
                     use_lora=adapter is not None, adapter=adapter, **prodigy)
    batch = {"instance_pixels": torch.randint(0, 256, (1, 64, 64, 3), dtype=torch.uint8)}

    def state_after(steps_taken):
        torch.manual_seed(0)
        state = steps.make_train_state(networks.setup_models(plan, CPU, CPU, distributed=False), plan)
        for _ in range(steps_taken):
            steps.train_step(state, [batch], step_prompts, 1.0, 1.0)
        return state

    state = state_after(2)
    assert type(state.optimizer).__name__ == {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "prodigy": "Prodigy",
                                              "adamw_schedulefree": "AdamWScheduleFree"}[optimizer]
    trained = [n for n, p in state.models.denoiser.named_parameters() if p.requires_grad]
    if adapter:  # DoRA: each adapted weight's magnitude trained beside its LoRA pair; LoHa's and LoKr's own factors
        assert all(f"{ {'dora': 'lora', 'loha': 'hada', 'lokr': 'lokr'}[adapter]}_" in n for n in trained), trained[:3]
        assert adapter != "dora" or any("lora_magnitude_vector" in n for n in trained)
    if optimizer == "adamw8bit":
        big = max(state.params, key=lambda p: p.numel())  # bitsandbytes quantises tensors of 4096+ values
        assert state.optimizer.state[big]["state1"].dtype == torch.uint8
    base = state_after(0)
    assert any(not torch.equal(a, b) for a, b in zip(state.params, base.params))  # it trained
    checkpoint.save(state, str(tmp_path), 0, [checkpoint.rng_state()], train_text_encoder=False)
    fresh = state_after(0)
    checkpoint.load(fresh, str(tmp_path), rank=0)
    for resumed in (state, fresh):  # one more step each, from the same noise
        torch.manual_seed(1)
        steps.train_step(resumed, [batch], step_prompts, 1.0, 1.0)
    for k, v in state.models.denoiser.state_dict().items():
        assert torch.equal(v, fresh.models.denoiser.state_dict()[k]), k
    if optimizer == "prodigy":  # it estimated a step size of its own (from d0 = 1e-6), the same after the resume
        assert state.optimizer.param_groups[0]["d"] == fresh.optimizer.param_groups[0]["d"] > 1e-6


def test_schedule_free_samples_and_saves_its_average_and_trains_on_unchanged(make_plan, step_prompts, tiny_model,
                                                                            tmp_path):
    """--optimizer adamw_schedulefree keeps a training point apart from the average it converges: validation
    samples and the saved model get the average (worker.averaged_weights, as the worker saves it; a checkpoint
    turned into a model too), and the training weights come back bit for bit after it."""
    from diffusers import StableDiffusionPipeline

    from dreambooth.training import worker

    state = trained_state(make_plan, step_prompts, optimizer="adamw_schedulefree", lr_scheduler="constant",
                          learning_rate=1e-3)
    training = [p.detach().clone() for p in state.params]
    with worker.averaged_weights(state):
        averaged = [p.detach().clone() for p in state.params]
        unet = {k: v.clone() for k, v in networks.unwrap(state.models.denoiser).state_dict().items()}
    assert any(not torch.equal(a, t) for a, t in zip(averaged, training))  # the average is not the training point
    assert all(torch.equal(p, t) for p, t in zip(state.params, training))  # (exactly the training weights again)
    assert all(g["train_mode"] for g in state.optimizer.param_groups)
    os.makedirs(tmp_path / "ckpt")
    checkpoint.save(state, str(tmp_path / "ckpt"), 0, [checkpoint.rng_state()], train_text_encoder=True)
    plan = make_plan(output_dir=str(tmp_path / "step-2"), total_steps=2, optimizer="adamw_schedulefree",
                     lr_scheduler="constant")
    checkpoint.save_as_model(str(tmp_path / "ckpt"), plan)
    saved = StableDiffusionPipeline.from_pretrained(str(tmp_path / "step-2"), safety_checker=None)
    assert all(torch.allclose(v, unet[k], atol=1e-7) for k, v in saved.unet.state_dict().items())


def test_a_checkpoint_becomes_the_model_the_run_would_have_saved_at_that_step(make_plan, step_prompts, tiny_model,
                                                                            tmp_path):
    """sweep.py scores intermediate checkpoints: checkpoint.save_as_model writes their weights as
    train.py's output (channels-last on, as on a GPU), recording the step."""
    from diffusers import StableDiffusionPipeline

    from dreambooth import files

    state = trained_state(make_plan, step_prompts, channels_last=True)
    os.makedirs(tmp_path / "ckpt")
    checkpoint.save(state, str(tmp_path / "ckpt"), 0, [checkpoint.rng_state()], train_text_encoder=True)
    plan = make_plan(output_dir=str(tmp_path / "step-2"), total_steps=2, channels_last=True)
    checkpoint.save_as_model(str(tmp_path / "ckpt"), plan)

    saved = StableDiffusionPipeline.from_pretrained(str(tmp_path / "step-2"), safety_checker=None)
    base = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    for part, name in (("unet", "denoiser"), ("text_encoder", "text_encoder")):
        trained = networks.unwrap(getattr(state.models, name)).state_dict()
        assert all(torch.equal(v, trained[k]) for k, v in getattr(saved, part).state_dict().items()), part
        assert any(not torch.equal(v, trained[k]) for k, v in getattr(base, part).state_dict().items()), part
    assert files.read_json(str(tmp_path / "step-2" / files.OUTPUT_MARKER))["steps"] == 2


def test_the_moving_average_round_trips_and_is_the_model_a_checkpoint_becomes(make_plan, step_prompts, tmp_path):
    """--use_ema: the average is in the checkpoint, restored on resume (a checkpoint without one
    starts it from its weights), and it is what a checkpoint turned into a model holds."""
    from diffusers import StableDiffusionPipeline


    settings = dict(use_ema=True, ema_decay=0.5, channels_last=True)
    state = trained_state(make_plan, step_prompts, **settings)
    assert any(not torch.equal(s, p) for s, p in zip(state.ema.shadow, state.params))
    os.makedirs(tmp_path / "ema"), os.makedirs(tmp_path / "plain")
    checkpoint.save(state, str(tmp_path / "ema"), 0, [checkpoint.rng_state()], train_text_encoder=True)
    assert checkpoints.is_complete(str(tmp_path / "ema"))
    fresh = trained_state(make_plan, step_prompts, steps_taken=0, **settings)
    checkpoint.load(fresh, str(tmp_path / "ema"), rank=0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.ema.shadow, state.ema.shadow))
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, state.params))

    plain = trained_state(make_plan, step_prompts)
    checkpoint.save(plain, str(tmp_path / "plain"), 0, [checkpoint.rng_state()], train_text_encoder=True)
    fresh = trained_state(make_plan, step_prompts, steps_taken=0, **settings)
    checkpoint.load(fresh, str(tmp_path / "plain"), rank=0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.ema.shadow, plain.params))

    plan = make_plan(output_dir=str(tmp_path / "model"), total_steps=2, **settings)
    checkpoint.save_as_model(str(tmp_path / "ema"), plan)
    saved = StableDiffusionPipeline.from_pretrained(str(tmp_path / "model"), safety_checker=None)
    with state.ema.applied(state.params):
        averaged = networks.unwrap(state.models.denoiser).state_dict()
        assert all(torch.equal(v, averaged[k]) for k, v in saved.unet.state_dict().items())
    assert files.read_json(str(tmp_path / "model" / files.OUTPUT_MARKER))["ema_decay"] == 0.5


@pytest.mark.parametrize("arch", sorted(families.ARCHS))
def test_each_familys_lora_checkpoint_resumes_to_the_uninterrupted_adapters(arch, tiny_model_of, make_plan, tmp_path):
    """Every family of the table, LoRA on its denoiser (and on the text encoders it trains): two steps, a checkpoint,
    and one more step from it give exactly the adapters of the run that went on without one; the saved adapters are
    named after the family's denoiser. (On Ray, with workers stopped, killed or drained and resumed: the
    integration tier's recovery tests, on SD 1.x, SDXL and Flux.1.)"""
    from dreambooth.generation import prompts
    from dreambooth.models import outputs
    from dreambooth.training import conditioning

    model_dir = tiny_model_of(arch)
    plan = make_plan(model_dir=model_dir, resolution=32, use_lora=True, output_dir=str(tmp_path / "out"))
    ids = prompts.prompt_ids(model_dir, ["photo of unqtkn toy"], "photo of a toy", plan.family)
    pixels = torch.randint(0, 255, (1, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batch = {"instance_pixels": pixels, "class_pixels": pixels.flip(1)}

    def state_after(steps_taken):
        torch.manual_seed(0)
        nets = networks.setup_models(plan, CPU, CPU, distributed=False)
        step_prompts = conditioning.step_prompts(plan.family, nets.text_encoders(), plan, ids, CPU)
        state = steps.make_train_state(nets, plan)
        for _ in range(steps_taken):
            steps.train_step(state, [batch], step_prompts, 1.0, 1.0)
        return state, step_prompts

    (state, step_prompts), (fresh, _) = state_after(2), state_after(0)
    (tmp_path / "ckpt").mkdir()
    checkpoint.save(state, str(tmp_path / "ckpt"), 0, [checkpoint.rng_state()], plan.train_text_encoder)
    checkpoint.load(fresh, str(tmp_path / "ckpt"), rank=0)
    for resumed in (state, fresh):  # one more step each, from the same noise
        torch.manual_seed(1)
        steps.train_step(resumed, [batch], step_prompts, 1.0, 1.0)
    trained = {name: p for name, p in state.models.denoiser.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained), list(trained)[:3]
    for name, model in (("denoiser", state.models.denoiser), *enumerate(state.models.text_encoders())):
        other = fresh.models.denoiser if name == "denoiser" else fresh.models.text_encoders()[name]
        theirs = other.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items()), (arch, name)
    outputs.save_pipeline(state.models, plan)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(plan.output_dir, files.LORA_WEIGHTS_FILE))
    assert any(k.startswith(plan.family.denoiser + ".") for k in saved), list(saved)[:3]

"""train.py with Ray: a run saves a changed, loadable pipeline with its record, trackers and validation images; cached
latents, a frozen text encoder and the loss options (both through Ray Train's local mode, the data on the cluster);
class images topped up on an actor pool; the trainer built without torch in the driver."""

import json
import os
import re

import pytest
import torch
from support import modes_not_as_umask

from dreambooth import errors
from dreambooth import files
from dreambooth.cluster import raycluster
from dreambooth.commands import train
from dreambooth.generation import image_records
from dreambooth.models import outputs
from dreambooth.planning import planning
from dreambooth.training import driver
from dreambooth.training import runlog


def events(folder):
    """The TensorBoard events in the event files in folder (TFRecord framing)."""
    import struct

    from tensorboardX.proto import event_pb2

    for name in sorted(os.listdir(folder)):
        data = open(os.path.join(folder, name), "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            yield event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4


def tensorboard_scalars(folder):
    """{tag: [(step, value)]} of the scalars logged in folder."""
    scalars = {}
    for event in events(folder):
        for value in event.summary.value:
            if not value.HasField("image"):
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def images_logged(folder):
    """{tag: [steps]} of the images logged in folder."""
    tags = {}
    for event in events(folder):
        for value in event.summary.value:
            if value.HasField("image"):
                tags.setdefault(value.tag, []).append(event.step)
    return tags


def weights_differ(a, b):
    return any(not torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


HUB_NAME = "CompVis/stable-diffusion-v1-4"  # (as diffusers' command lines name the model)


@pytest.fixture(scope="module")
def hub_cache(tiny_model, tmp_path_factory):
    """(hub cache folder, snapshot): the tiny model as the hub's client caches HUB_NAME at our pinned revision."""
    import shutil

    from dreambooth.models import known_models
    from dreambooth.models import modelcache

    cache = tmp_path_factory.mktemp("hub")
    snapshot = modelcache.hub_snapshot_path(str(cache), HUB_NAME, known_models.known_model("sd14").revision)
    shutil.copytree(tiny_model, snapshot)
    return str(cache), snapshot


@pytest.fixture(scope="module")
def class_images(ray_session, hub_cache, tmp_path_factory):
    """Class images of the hub cache's snapshot (the base model the tests below train)."""
    from dreambooth.commands import generate

    out = tmp_path_factory.mktemp("images-reg")
    generate.main(["--model_dir", hub_cache[1], "--output_dir", str(out), "--prompts", "photo of a toy",
                   "--num_samples_per_prompt", "6", "--num_inference_steps", "2"])
    return str(out)


def test_a_run_saves_a_changed_loadable_pipeline_with_its_record_trackers_and_validation(
        ray_session, tiny_model, hub_cache, toy_images, class_images, tmp_path, monkeypatch, capfd, webhook):
    """In this process (--num_workers 0: what a worker does with its steps, its files and its trackers is the same on
    Ray Train's workers; a full fine-tune saved by 2 DDP workers: conftest's uninterrupted run, loaded by the stopped
    and elastic runs' tests; validation drawn by 2 ranks together: test_fsdp_ray). Also the model named as
    diffusers' command lines name it, on the hub: found in the local hub cache, no download; prompts with commas (the
    validation images' file names); the UNet compiled by dynamo (--torch_compile eager; under DDP: test_dreambooth_run's
    LoRA run)."""
    import shutil
    import sys

    import numpy as np
    from diffusers import DiffusionPipeline
    from PIL import Image

    from dreambooth.models import modelcache

    cache, snapshot = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: rank 0 draws the progress bar
    # --enable_bucket: the square toy photos, a portrait and a landscape one; each batch one bucket
    photos = tmp_path / "photos"
    shutil.copytree(toy_images, photos)
    rng = np.random.default_rng(0)
    for name, size in (("tall.png", (120, 48)), ("wide.png", (40, 90))):
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(photos / name)
    out = tmp_path / "model-tuned"
    result = train.main(["--pretrained_model_name_or_path", HUB_NAME, "--output_dir", str(out),
                         "--instance_data_dir", str(photos), "--enable_bucket",
                         "--instance_prompt", "photo of unqtkn toy, on a table", "--class_images_dir", class_images,
                         "--class_prompt", "photo of a toy", "--train_batch_size", "2", "--lr", "1e-4",
                         "--num_epochs", "4", "--max_train_steps", "5", "--num_workers", "0",
                         "--logging_steps", "2", "--checkpointing_steps", "3", "--report_to", "all",
                         "--notify_url", webhook.url,
                         "--checkpoints_total_limit", "2", "--keep_checkpoints",
                         "--validation_prompt", "photo of unqtkn toy, oil painting", "--num_validation_images", "3",
                         "--validation_inference_steps", "2", "--torch_compile", "eager"])
    assert result.metrics["step"] == 5 and result.metrics["loss"] > 0
    assert result.metrics["images_per_s"] > 0
    err = capfd.readouterr().err
    assert "training:" in err
    assert re.search(r"buckets: 7 photos in \d+x\d+ \(1\), 64x64 \(5\), \d+x\d+ \(1\)", err), err[-3000:]
    tuned = DiffusionPipeline.from_pretrained(str(out))
    base = DiffusionPipeline.from_pretrained(tiny_model)
    assert weights_differ(tuned.unet, base.unet)
    assert weights_differ(tuned.text_encoder, base.text_encoder)
    assert not weights_differ(tuned.vae, base.vae)
    assert os.path.isfile(out / files.OUTPUT_MARKER) and outputs.read_output(str(out)).base_model == snapshot
    assert modelcache.resolve_model_name("sd14") == snapshot
    assert all(f.endswith((".json", ".safetensors", ".txt", ".toml")) for _, _, fs in os.walk(out) for f in fs)
    assert os.path.isfile(out / outputs.TRAIN_CONFIG)
    assert modes_not_as_umask(out) == [] and modes_not_as_umask(result.path) == []  # the model, the checkpoints
    # Checkpoints at step 3 and at the end, in the absolute storage path beside the output.
    checkpoints = [d for d in os.listdir(result.path) if d.startswith("checkpoint_") and os.path.isdir(os.path.join(result.path, d))]
    assert len(checkpoints) == 2
    assert result.path.startswith(str(tmp_path / "ray_results"))
    # Rank 0 logs every window (steps 2 and 4) and the last step, with times in order.
    with open(os.path.join(result.path, runlog.METRICS_FILE)) as f:
        lines = [json.loads(line) for line in f]
    assert [m["step"] for m in lines] == [2, 3, 4, 5]
    assert all(m["loss"] > 0 for m in lines) and lines[-1]["loss"] == result.metrics["loss"]
    assert all(a["time"] <= b["time"] for a, b in zip(lines, lines[1:]))
    assert os.path.isfile(os.path.join(result.path, "loss.png"))
    # The same windows as TensorBoard scalars.
    scalars = tensorboard_scalars(os.path.join(result.path, "tensorboard"))
    assert [step for step, _ in scalars["train/loss"]] == [2, 3, 4, 5]
    assert scalars["train/loss"][-1][1] == pytest.approx(lines[-1]["loss"], rel=1e-6)
    assert len(scalars["train/lr"]) == len(scalars["train/images_per_s"]) == 4
    # Validation at the checkpoint steps (3 and the end): 3 images each.
    samples = os.path.join(result.path, "validation")
    names = [f"photo-of-unqtkn-toy-oil-painting-{i:05d}.png" for i in range(3)]  # one prompt, commas and all
    assert sorted(os.listdir(samples)) == ["step-3", "step-5", "timeline.png"]
    assert all(sorted(os.listdir(os.path.join(samples, s))) == names for s in ("step-3", "step-5"))
    assert images_logged(os.path.join(result.path, "tensorboard")) == {f"validation/{n}": [3, 5] for n in names}
    # The same windows and images in the W&B run (offline: no key) and the MLflow run (the default store under
    # the storage path), which the model's record names for evaluate.py's scores.
    from trackerfiles import wandb_records

    record = outputs.read_output(str(out)).record.trackers
    seen = wandb_records(result.path)
    assert seen["ids"] == {record["wandb"]["id"]} and seen["config"]["max_train_steps"] == 5
    assert [(h["_step"], h["train/loss"]) for h in seen["history"] if "train/loss" in h] == [
        (m["step"], pytest.approx(m["loss"])) for m in lines]
    assert sorted(h["_step"] for h in seen["history"] if f"validation/{names[0]}/_type" in h) == [3, 5]
    import mlflow

    client = mlflow.MlflowClient(record["mlflow"]["tracking_uri"])
    assert record["mlflow"]["tracking_uri"] == f"sqlite:///{tmp_path}/ray_results/mlflow.db"
    history = client.get_metric_history(record["mlflow"]["run_id"], "train/images_per_s")
    assert [m.step for m in history] == [2, 3, 4, 5] and all(m.value > 0 for m in history)
    assert client.get_run(record["mlflow"]["run_id"]).data.params["instance_prompt"] == "photo of unqtkn toy, on a table"
    # The webhook heard the start and the end (with the final loss), and no URL reached the run's files.
    assert [body["event"] for _, body in webhook.received] == ["started", "finished"]
    assert webhook.received[1][1]["loss"] == pytest.approx(result.metrics["loss"])
    assert webhook.url not in open(out / outputs.TRAIN_CONFIG).read()


def test_cached_latents_frozen_text_encoder_and_loss_options(ray_session, tiny_model, hub_cache, toy_images,
                                                             class_images, tmp_path, capfd):
    """Also captions (half of them dropped for the empty prompt, embedded once with the others), a
    photo's mask with the cached latents, the schedule and the loss options, in this process: --num_workers 0
    (Ray Train's local mode, no worker actors; the data stream still on the cluster) trains as one worker would."""
    import shutil

    from diffusers import DiffusionPipeline

    own = tmp_path / "own"
    shutil.copytree(toy_images, own)
    (own / "toy-2.txt").write_text("photo of unqtkn toy on the moon")
    from PIL import Image

    with Image.open(own / "toy-3.jpg") as photo:  # the left half of one photo is all that counts
        mask = Image.new("L", photo.size, 0)
    mask.paste(255, (0, 0, mask.size[0] // 2, mask.size[1]))
    mask.save(own / "toy-3.mask.png")
    out = tmp_path / "model-cached"
    argv = ["--model_dir", hub_cache[1], "--output_dir", str(out), "--instance_images_dir", str(own),
            "--instance_prompt", "photo of unqtkn toy", "--class_images_dir", class_images,
            "--class_prompt", "photo of a toy", "--num_workers", "0", "--max_train_steps", "3",
            "--lr", "1e-4", "--cache_latents", "--random_flip", "--no-train_text_encoder",
            "--gradient_accumulation_steps", "2", "--gradient_checkpointing",
            "--lr_scheduler", "cosine", "--offset_noise", "--snr_gamma", "5", "--scale_lr",
            "--caption_dropout_rate", "0.5", "--masked_loss",
            # (the frozen encoders leave the device before the UNet lands: the samples' prompts first)
            "--validation_prompt", "a toy", "--num_validation_images", "1",
            "--validation_inference_steps", "2", "--validation_steps", "3"]
    result = train.main(argv)
    assert result.metrics["step"] == 3
    assert os.path.isfile(os.path.join(result.path, "validation", "step-3", "a-toy-00000.png"))
    # Not a terminal (a log file): no progress bar redrawn into it, the step lines are the progress.
    printed = "".join(capfd.readouterr())
    assert "training:" not in printed and "--masked_loss: 1 of 5 photos have a mask" in printed
    assert result.metrics["lr"] == pytest.approx(0.0, abs=1e-12)  # cosine ends at zero
    assert result.metrics["loss"] > 0
    tuned, base = DiffusionPipeline.from_pretrained(str(out)), DiffusionPipeline.from_pretrained(tiny_model)
    assert weights_differ(tuned.unet, base.unet)
    assert not weights_differ(tuned.text_encoder, base.text_encoder)

    # The config the run wrote beside its model repeats it: the same flags, worked out the same way, and the same
    # plan for the workers (the learning rate scaled once, not again; the run's name from its identity), as the
    # command line gives for a new output folder.
    config = out / outputs.TRAIN_CONFIG
    again_out = str(tmp_path / "model-again")
    repeated, typed = (planning.parse_args(a) for a in (["--config", str(config), "--output_dir", again_out],
                                                        [*argv, "--output_dir", again_out]))  # (the last one counts)
    assert {k: v for k, v in vars(repeated).items() if k != "config"} == {k: v for k, v in vars(typed).items()
                                                                          if k != "config"}
    plans = [planning.plan_run(a, cluster_resources=raycluster.cluster_resources) for a in (repeated, typed)]
    assert plans[0] == plans[1] and plans[0].learning_rate == pytest.approx(1e-4 * 1 * 2)  # (one worker x accumulation)
    assert plans[0].in_process and plans[0].num_workers == 1
    assert plans[0].settings_toml == open(config).read().replace(str(out), again_out)


def test_num_class_images_tops_up_the_class_folder_counting_what_is_there(ray_session, tiny_model, toy_images,
                                                                          tmp_path):
    from PIL import Image

    folder = tmp_path / "images-reg"
    folder.mkdir()
    Image.new("RGB", (64, 64), "gray").save(folder / "my-own-class-photo.png")
    args = (tiny_model, str(folder), "photo of a toy", 3)
    driver.top_up_class_images(*args)
    made = ["photo-of-a-toy-00000.png", "photo-of-a-toy-00001.png"]
    assert sorted(os.listdir(folder)) == sorted(["my-own-class-photo.png", image_records.IMAGES_RECORD] + made)
    before = {n: os.path.getmtime(folder / n) for n in made}
    driver.top_up_class_images(*args)  # already full: nothing is drawn again
    assert {n: os.path.getmtime(folder / n) for n in made} == before and len(os.listdir(folder)) == 4
    # another class into the same folder is an error, not a mix
    with pytest.raises(errors.UserError, match="different: prompts"):
        driver.top_up_class_images(tiny_model, str(folder), "photo of a cat", 3)


def test_the_trainer_is_built_and_its_process_group_config_read_without_torch():
    """The driver builds the trainer and Ray Train's controller unpickles its backend config (process_group) without
    importing torch (1.6 s of CPU in each, before a run's first step; TorchTrainer's config imports it); the workers
    get what TorchTrainer's give them: Ray's own worker functions, called with the arguments they take, the backend
    TorchTrainer picks, the CUDA devices shared the same way."""
    import inspect
    import subprocess
    import sys

    import cloudpickle
    from ray.train.torch import config as ray_torch

    from dreambooth.files import REPO_DIR
    from dreambooth.training import process_group

    pickled = cloudpickle.dumps(process_group.ProcessGroupConfig(timeout_s=60))
    code = ("import pickle, sys; from dreambooth.training import stopping; stopping.trainer_class(); "
            "config = pickle.loads(sys.stdin.buffer.read()); config.backend_cls(); config.framework; "
            "print(config.timeout_s, config.train_func_context.__name__, [m for m in sys.modules if m.startswith('torch')])")
    proc = subprocess.run([sys.executable, "-c", code], input=pickled, cwd=REPO_DIR, capture_output=True, timeout=120)
    assert proc.stdout.decode().split() == ["60", "DeviceContext", "[]"], proc.stderr.decode()[-2000:]
    # (the names and keywords on_start and on_shutdown call: a Ray upgrade that changes them fails here, not in a run)
    inspect.signature(ray_torch._setup_torch_process_group).bind(backend="gloo", world_rank=0, world_size=1,
                                                                 init_method="env://", timeout_s=60)
    inspect.signature(ray_torch._set_torch_distributed_env_vars).bind()
    inspect.signature(ray_torch._shutdown_torch).bind(destroy_process_group=True)
    assert hasattr(ray_torch, "TorchConfigContextManager") and ray_torch.TorchConfig().init_method == "env"
    assert process_group.ProcessGroupBackend.share_cuda_visible_devices == ray_torch._TorchBackend.share_cuda_visible_devices
    assert set(process_group.ProcessGroupConfig().to_dict()) == set(ray_torch.TorchConfig().to_dict())
    assert [process_group.backend_name(None, {"CPU": 1, "GPU": 1}), process_group.backend_name(None, {"CPU": 2}),
            process_group.backend_name("gloo", {"GPU": 1})] == ["nccl", "gloo", "gloo"]

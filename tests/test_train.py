import json
import os

import pytest
import torch

import train
import utils


def weights_differ(a, b):
    return any(not torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


@pytest.fixture(scope="module")
def class_images(ray_session, tiny_model, tmp_path_factory):
    import generate

    out = tmp_path_factory.mktemp("images-reg")
    generate.main(["--model_dir", tiny_model, "--output_dir", str(out), "--prompts", "photo of a toy",
                   "--num_samples_per_prompt", "6", "--num_inference_steps", "2"])
    return str(out)


def test_train_two_workers_saves_a_changed_loadable_pipeline(ray_session, tiny_model, toy_images, class_images,
                                                             tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / "model-tuned"
    result = train.main(["--model_dir", tiny_model, "--output_dir", str(out), "--instance_images_dir", toy_images,
                         "--instance_prompt", "photo of unqtkn toy", "--class_images_dir", class_images,
                         "--class_prompt", "photo of a toy", "--train_batch_size", "2", "--lr", "1e-4",
                         "--num_epochs", "4", "--max_train_steps", "5", "--num_workers", "2",
                         "--logging_steps", "2", "--checkpointing_steps", "3"])
    assert result.metrics["step"] == 5 and result.metrics["loss"] > 0
    assert result.metrics["images_per_s"] > 0
    tuned = DiffusionPipeline.from_pretrained(str(out))
    base = DiffusionPipeline.from_pretrained(tiny_model)
    assert weights_differ(tuned.unet, base.unet)
    assert weights_differ(tuned.text_encoder, base.text_encoder)
    assert not weights_differ(tuned.vae, base.vae)
    assert os.path.isfile(out / utils.OUTPUT_MARKER)
    assert all(f.endswith((".json", ".safetensors", ".txt")) for _, _, fs in os.walk(out) for f in fs)
    # Checkpoints at step 3 and at the end, in the absolute storage path beside the output.
    checkpoints = [d for d in os.listdir(result.path) if d.startswith("checkpoint_") and os.path.isdir(os.path.join(result.path, d))]
    assert len(checkpoints) == 2
    assert result.path.startswith(str(tmp_path / "ray_results"))
    # Rank 0 logs every window (steps 2 and 4) and the last step, with times in order.
    with open(os.path.join(result.path, train.METRICS_FILE)) as f:
        lines = [json.loads(line) for line in f]
    assert [m["step"] for m in lines] == [2, 3, 4, 5]
    assert all(m["loss"] > 0 for m in lines) and lines[-1]["loss"] == result.metrics["loss"]
    assert all(a["time"] <= b["time"] for a, b in zip(lines, lines[1:]))


def test_output_dir_that_is_not_ours_is_refused(tmp_path):
    (tmp_path / "thesis.tex").write_text("precious")
    with pytest.raises(utils.UserError, match="--overwrite"):
        train.check_output_dir(str(tmp_path), overwrite=False)
    train.check_output_dir(str(tmp_path), overwrite=True)


def test_plan_steps_never_exceeds_max_steps_or_starves_a_worker():
    class Args:
        num_workers, train_batch_size, max_train_steps, num_train_epochs = 2, 2, 800, 4
        gradient_accumulation_steps = 1

    assert train.plan_steps(200, Args) == (50, 200)
    assert train.plan_steps(5, Args) == (1, 4)
    Args.max_train_steps = 3
    assert train.plan_steps(200, Args) == (50, 3)
    with pytest.raises(utils.UserError, match="cannot feed"):
        train.plan_steps(1, Args)


def test_cached_latents_with_frozen_text_encoder(ray_session, tiny_model, toy_images, class_images, tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / "model-cached"
    result = train.main(["--model_dir", tiny_model, "--output_dir", str(out), "--instance_images_dir", toy_images,
                         "--instance_prompt", "photo of unqtkn toy", "--class_images_dir", class_images,
                         "--class_prompt", "photo of a toy", "--num_workers", "2", "--max_train_steps", "3",
                         "--lr", "1e-4", "--cache_latents", "--random_flip", "--no-train_text_encoder",
                         "--gradient_accumulation_steps", "2", "--gradient_checkpointing"])
    assert result.metrics["step"] == 3
    tuned, base = DiffusionPipeline.from_pretrained(str(out)), DiffusionPipeline.from_pretrained(tiny_model)
    assert weights_differ(tuned.unet, base.unet)
    assert not weights_differ(tuned.text_encoder, base.text_encoder)


def test_plan_steps_with_gradient_accumulation():
    class Args:
        num_workers, train_batch_size, max_train_steps, num_train_epochs = 2, 1, 800, 4
        gradient_accumulation_steps = 3

    assert train.plan_steps(200, Args) == (33, 132)
    Args.gradient_accumulation_steps = 4
    with pytest.raises(utils.UserError, match="gradient_accumulation_steps"):
        train.plan_steps(6, Args)


def test_explicit_max_train_steps_wins_and_epochs_cap_only_when_given(capsys):
    class Args:
        num_workers, train_batch_size, gradient_accumulation_steps = 2, 1, 1
        max_train_steps, num_train_epochs = 60, None

    # 5 instance + 8 class images: 8 rows, 4 steps an epoch per worker.
    assert train.plan_steps(8, Args) == (4, 60)
    assert "stopping" not in capsys.readouterr().err
    Args.max_train_steps = None
    assert train.plan_steps(8, Args) == (4, train.DEFAULT_MAX_TRAIN_STEPS)
    Args.num_train_epochs = 3
    assert train.plan_steps(8, Args) == (4, 12)
    Args.max_train_steps = 60
    assert train.plan_steps(8, Args) == (4, 12)
    assert "stopping after 12 steps, before --max_train_steps 60" in capsys.readouterr().err
    # The seeds' command: --num_epochs=4 --max_train_steps=200, 200 class images, 2 workers, batch 2.
    Args.train_batch_size, Args.num_train_epochs, Args.max_train_steps = 2, 4, 200
    assert train.plan_steps(200, Args) == (50, 200)


def test_the_stream_holds_enough_rows_for_every_step():
    class Args:
        num_workers, train_batch_size, gradient_accumulation_steps = 2, 2, 3

    epochs = train.stream_epochs(13, 40, Args)
    rows_per_worker = epochs * 13 // 2
    assert rows_per_worker >= 40 * 2 * 3


def test_worker_resources_leave_a_cpu_for_ray_data_and_refuse_impossible():
    class Args:
        use_gpu = None
        num_workers = 2
        gpus_per_worker = 1

    assert train.worker_resources(Args, cpus=2, gpus=0) == (False, 0.5)
    assert train.worker_resources(Args, cpus=16, gpus=2) == (True, 1.0)
    with pytest.raises(Exception, match="needs 2 GPUs"):
        train.worker_resources(Args, cpus=16, gpus=1)
    Args.gpus_per_worker = 2
    with pytest.raises(Exception, match="--gpus_per_worker 2 needs 4 GPUs; the Ray cluster has 2"):
        train.worker_resources(Args, cpus=16, gpus=2)
    Args.num_workers = 1
    assert train.worker_resources(Args, cpus=16, gpus=2) == (True, 1.0)
    Args.gpus_per_worker, Args.num_workers = 1, 2
    with pytest.raises(Exception, match="needs 2 GPUs"):
        Args.use_gpu = True
        train.worker_resources(Args, cpus=16, gpus=0)
    Args.use_gpu, Args.num_workers = None, 1
    with pytest.raises(Exception, match="one for the data pipeline"):
        train.worker_resources(Args, cpus=1, gpus=0)
    Args.num_workers = 3
    with pytest.raises(Exception, match="more than the Ray cluster's 2 CPUs"):
        train.worker_resources(Args, cpus=2, gpus=0)

"""Flux.1 on Ray Train: a LoRA run resumed from the uninterrupted run's checkpoint ends on its weights and draws its
samples; a full fine-tune sharded across two workers (FSDP) resumes to the same weights."""


import pytest
import torch

from dreambooth.training import validation

CPU = torch.device("cpu")


def test_lora_on_ray_resumed_ends_on_the_uninterrupted_weights_and_draws(ray_session, tiny_flux_model,
                                                                                 toy_images, tmp_path, capfd):
    """train.py on Ray: with 2 workers the uninterrupted 4-step LoRA run, drawing validation samples at every step,
    keeps its checkpoint of step 2; that checkpoint resumed into a new output without samples ends on exactly the
    uninterrupted run's adapters (the samples drawn on the way changed nothing). (1 worker, and generate.py drawing
    with the adapters: test_dreambooth_run's Flux run; evaluate.py: test_sweep's Flux sweep.)"""
    from safetensors.torch import load_file

    from dreambooth import errors
    from dreambooth import files
    from dreambooth.commands import generate
    from dreambooth.commands import train
    from dreambooth.planning import checkpoints

    def argv(name):
        return ["--model_dir", tiny_flux_model, "--instance_images_dir", toy_images, "--instance_prompt",
                "photo of unqtkn toy", "--num_workers", "2", "--use_lora", "--max_train_steps", "4",
                "--checkpointing_steps", "2", "--output_dir", str(tmp_path / name),
                "--storage_path", str(tmp_path / f"runs-{name}")]

    sampling = ["--validation_prompt", "a toy", "--num_validation_images", "1", "--validation_inference_steps", "2",
                "--validation_steps", "1"]
    whole = train.main([*argv("whole"), *sampling, "--keep_checkpoints", "--checkpoints_total_limit", "2"])
    assert whole.metrics["step"] == 4
    timelines = list((tmp_path / "runs-whole").glob(f"*/{validation.FOLDER}/{validation.TIMELINE}"))
    assert len(timelines) == 1 and len(list(timelines[0].parent.glob("step-*/a-toy-00000.png"))) == 4
    step_2 = checkpoints.by_step(str(tmp_path / "runs-whole"), "whole")[2]
    capfd.readouterr()
    resumed = train.main([*argv("cut"), "--resume_from_checkpoint", step_2])
    assert resumed.metrics["step"] == 4 and "resuming from" in capfd.readouterr().err  # steps 3 and 4 only
    a = load_file(str(tmp_path / "whole" / files.LORA_WEIGHTS_FILE))
    b = load_file(str(tmp_path / "cut" / files.LORA_WEIGHTS_FILE))
    assert a.keys() == b.keys() and any(k.startswith("transformer.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)  # (the validation samples drawn on the way changed nothing)
    with pytest.raises(errors.UserError, match="Flux.1 draws without a negative prompt"):
        generate.main(["--model_dir", str(tmp_path / "whole"), "--output_dir", str(tmp_path / "neg"), "--prompts",
                       "a toy", "--negative_prompt", "blurry"])
    assert not (tmp_path / "neg").exists()


def test_a_full_fine_tune_sharded_across_two_workers_resumes_to_the_same_weights(ray_session, tiny_flux_model,
                                                                                 toy_images, tmp_path):
    """--fsdp on Ray with 2 workers (gloo on CPU, the code NCCL runs on GPUs): the transformer sharded per block,
    checkpoints written whole by rank 0 and spread again on resume; the run's checkpoint of step 2 resumed into a
    new output ends on exactly the uninterrupted run's weights; validation samples drawn by both ranks together;
    the output is a FluxPipeline whose transformer moved and whose text encoders did not. (The same resume of LoRA
    adapters: the LoRA tests on Ray, Flux.1's and SD 3.5's.)"""
    from diffusers import FluxPipeline
    from safetensors.torch import load_file
    from test_recovery import logged_losses

    from dreambooth.commands import train
    from dreambooth.planning import checkpoints

    def argv(name):
        return ["--model_dir", tiny_flux_model, "--instance_images_dir", toy_images, "--instance_prompt",
                "photo of unqtkn toy", "--num_workers", "2", "--fsdp", "--no-train_text_encoder",
                "--max_train_steps", "4", "--checkpointing_steps", "2", "--learning_rate", "1e-3",
                "--output_dir", str(tmp_path / name), "--storage_path", str(tmp_path / f"runs-{name}"),
                "--validation_prompt", "a toy", "--num_validation_images", "1", "--validation_inference_steps", "2",
                "--validation_steps", "4", "--logging_steps", "1",
                "--keep_checkpoints", "--checkpoints_total_limit", "2"]  # (the checkpoint of step 2 is resumed below)

    whole = train.main(argv("whole"))
    assert whole.metrics["step"] == 4
    assert list((tmp_path / "runs-whole").glob("*/validation/step-4/a-toy-00000.png"))
    step_2 = checkpoints.by_step(str(tmp_path / "runs-whole"), "whole")[2]
    resumed = train.main([*argv("cut"), "--resume_from_checkpoint", step_2])
    assert resumed.metrics["step"] == 4 and logged_losses(resumed) == logged_losses(whole)  # (1-2: the rows of the run it goes on from)
    a = load_file(str(tmp_path / "whole" / "transformer" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tuned, base = FluxPipeline.from_pretrained(str(tmp_path / "whole")), FluxPipeline.from_pretrained(tiny_flux_model)
    assert any(not torch.equal(p, q) for p, q in zip(tuned.transformer.parameters(), base.transformer.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(tuned.text_encoder.parameters(), base.text_encoder.parameters()))

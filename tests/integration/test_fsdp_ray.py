"""A full fine-tune sharded across two workers (--fsdp) on Ray Train draws its validation samples at every step and
resumes to the same weights: the sharded path, proven once, on Flux.1's tiny model (a transformer sharded per block;
what differs per family is tests/unit/test_family_contract.py's)."""


import torch

from dreambooth.training import validation

CPU = torch.device("cpu")


def test_a_full_fine_tune_sharded_across_two_workers_resumes_to_the_same_weights(ray_session, tiny_flux_model,
                                                                                 toy_images, tmp_path):
    """--fsdp on Ray with 2 workers (gloo on CPU, the code NCCL runs on GPUs): the transformer sharded per block,
    checkpoints written whole by rank 0 and spread again on resume; the run's checkpoint of step 2 resumed into a
    new output ends on exactly the uninterrupted run's weights; validation samples drawn by both ranks together at
    every step, one timeline of them; the output is a FluxPipeline whose transformer moved and whose text encoders
    did not. (Each family's LoRA checkpoint resumed to the same adapters: tests/unit/test_checkpoint.py.)"""
    from diffusers import FluxPipeline
    from safetensors.torch import load_file
    from support import logged_losses

    from dreambooth.commands import train
    from dreambooth.planning import checkpoints

    def argv(name):
        return ["--model_dir", tiny_flux_model, "--instance_images_dir", toy_images, "--instance_prompt",
                "photo of unqtkn toy", "--num_workers", "2", "--fsdp", "--no-train_text_encoder",
                "--max_train_steps", "4", "--checkpointing_steps", "2", "--learning_rate", "1e-3",
                "--output_dir", str(tmp_path / name), "--storage_path", str(tmp_path / f"runs-{name}"),
                "--validation_prompt", "a toy", "--num_validation_images", "1", "--validation_inference_steps", "2",
                "--validation_steps", "1", "--logging_steps", "1",
                "--keep_checkpoints", "--checkpoints_total_limit", "2"]  # (the checkpoint of step 2 is resumed below)

    whole = train.main(argv("whole"))
    assert whole.metrics["step"] == 4
    timelines = list((tmp_path / "runs-whole").glob(f"*/{validation.FOLDER}/{validation.TIMELINE}"))
    assert len(timelines) == 1 and len(list(timelines[0].parent.glob("step-*/a-toy-00000.png"))) == 4
    step_2 = checkpoints.by_step(str(tmp_path / "runs-whole"), "whole")[2]
    resumed = train.main([*argv("cut"), "--resume_from_checkpoint", step_2])
    assert resumed.metrics["step"] == 4 and logged_losses(resumed) == logged_losses(whole)  # (1-2: the rows of the run it goes on from)
    a = load_file(str(tmp_path / "whole" / "transformer" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tuned, base = FluxPipeline.from_pretrained(str(tmp_path / "whole")), FluxPipeline.from_pretrained(tiny_flux_model)
    assert any(not torch.equal(p, q) for p, q in zip(tuned.transformer.parameters(), base.transformer.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(tuned.text_encoder.parameters(), base.text_encoder.parameters()))

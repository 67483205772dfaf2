"""SD 3.5 on two Ray Train workers: a LoRA run resumed from the uninterrupted run's checkpoint ends on its adapters."""


import torch


def test_lora_on_two_workers_resumed_ends_on_the_uninterrupted_weights_and_draws(ray_session, tiny_sd3_model,
                                                                                  toy_images, tmp_path, capfd):
    """train.py on Ray with 2 workers: the uninterrupted 4-step LoRA run's checkpoint of step 2, resumed into a new
    output, ends on exactly that run's adapters. (With validation samples drawn on the way: Flux.1's LoRA test on
    Ray; a run stopped by a signal, then resumed: test_recovery; generate.py drawing with SD 3.5 adapters: test_sweep's
    SD 3.5 sweep, whose scores draw each trial's adapters on generate's actor pool.)"""
    from safetensors.torch import load_file

    from dreambooth import files
    from dreambooth.commands import train
    from dreambooth.planning import checkpoints

    def argv(name):
        return ["--model_dir", tiny_sd3_model, "--instance_images_dir", toy_images, "--instance_prompt",
                "photo of unqtkn toy", "--num_workers", "2", "--use_lora", "--max_train_steps", "4",
                "--checkpointing_steps", "2", "--output_dir", str(tmp_path / name),
                "--storage_path", str(tmp_path / f"runs-{name}")]

    whole = train.main([*argv("whole"), "--keep_checkpoints", "--checkpoints_total_limit", "2"])
    assert whole.metrics["step"] == 4
    step_2 = checkpoints.by_step(str(tmp_path / "runs-whole"), "whole")[2]
    capfd.readouterr()
    resumed = train.main([*argv("cut"), "--resume_from_checkpoint", step_2])
    assert resumed.metrics["step"] == 4 and "resuming from" in capfd.readouterr().err  # steps 3 and 4 only
    a = load_file(str(tmp_path / "whole" / files.LORA_WEIGHTS_FILE))
    b = load_file(str(tmp_path / "cut" / files.LORA_WEIGHTS_FILE))
    assert a.keys() == b.keys() and any(k.startswith("transformer.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)



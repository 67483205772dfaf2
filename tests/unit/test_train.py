"""train.py end to end: Ray Train runs of train_fn on the tiny model (Ray)."""

import json
import os

import pytest
import torch
from support import adapters_saved

from dreambooth import errors
from dreambooth import files
from dreambooth.training import driver
from dreambooth.training import runlog


def test_plot_metrics_draws_loss_and_lr_against_step(tmp_path):
    import numpy as np
    from PIL import Image

    metrics = tmp_path / runlog.METRICS_FILE
    assert runlog.plot_metrics(str(metrics)) is None
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1 / s, "lr": 1e-5 * min(1, s / 20)}) + "\n"
                               for s in (30, 10, 20, 40)))
    path = runlog.plot_metrics(str(metrics))
    assert path == str(tmp_path / "loss.png")
    pixels = np.asarray(Image.open(path).convert("RGB")).astype(int)
    assert pixels.shape == (450, 800, 3)
    blue = (pixels[..., 2] > 150) & (pixels[..., 0] < 100)  # the loss curve
    orange = (pixels[..., 0] > 200) & (pixels[..., 1] > 100) & (pixels[..., 1] < 180) & (pixels[..., 2] < 80)
    assert blue.sum() > 200 and orange.sum() > 200


def test_lora_output_is_what_diffusers_load_lora_weights_reads(lora_output, tiny_model):
    """rank 4 with alpha 8: the loaded adapters must carry their scale (2), not assume 1."""
    from diffusers import StableDiffusionPipeline

    folder, nets = lora_output
    assert sorted(os.listdir(folder)) == sorted([files.LORA_WEIGHTS_FILE, files.OUTPUT_MARKER])
    loaded = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    loaded.load_lora_weights(folder)
    predicts_as(nets, loaded, StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None))
    assert json.load(open(os.path.join(folder, files.OUTPUT_MARKER)))["lora"] == {"rank": 4, "lora_alpha": 8.0}


def predicts_as(nets, loaded, base):
    """Our networks' UNet prediction (random prompt ids, latents and step) is loaded's, and not base's."""
    torch.manual_seed(1)
    ids, latents, t = torch.randint(0, 100, (1, 77)), torch.randn(1, 4, 32, 32), torch.tensor([500])

    def predict(unet, text_encoder):
        with torch.no_grad():
            return unet(latents, t, text_encoder(ids)[0]).sample

    ours = predict(nets.denoiser.eval(), nets.text_encoder.eval())
    assert torch.allclose(predict(loaded.unet, loaded.text_encoder), ours, atol=1e-5)
    assert not torch.allclose(predict(base.unet, base.text_encoder), ours, atol=1e-3)


@pytest.mark.parametrize("adapter", ["dora", "loha", "lokr"])
def test_dora_loha_and_lokr_outputs_load_back_to_the_same_predictions_and_export_as_lycoris_reads_them(
        adapter, make_plan, tiny_model, tmp_path, monkeypatch):
    """--adapter dora (diffusers' --use_dora): the file diffusers' load_lora_weights reads back, magnitudes and all;
    --adapter loha|lokr: the file generate.py's pipeline loading fuses through peft (drawing.load_pipeline). Each
    gives our predictions, changed from the base model's; the record names the adapter. export.py writes LoHa and
    LoKr in LyCORIS' layout, which LyCORIS' own loader merges to the same weights, and says in one line that it
    writes no kohya layout of DoRA yet."""
    from diffusers import StableDiffusionPipeline

    from dreambooth.commands import export
    from dreambooth.generation import drawing

    # (LoHa at alpha = rank: LyCORIS' own loader, the check below, scales LoHa by (alpha / rank) squared, ComfyUI and
    # kohya's by alpha / rank, as peft: they agree at 1)
    alpha = 4.0 if adapter == "loha" else 8.0
    plan = make_plan(use_lora=True, adapter=adapter, lora_rank=4, lora_alpha=alpha, output_dir=str(tmp_path / adapter))
    nets = adapters_saved(plan)
    if adapter == "dora":
        loaded = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
        loaded.load_lora_weights(plan.output_dir)
    else:
        loaded = drawing.load_pipeline(tiny_model, torch.device("cpu"), lora_dir=plan.output_dir)
        assert not any("hada_" in n or "lokr_" in n for n, _ in loaded.unet.named_parameters())  # (fused)
    base = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    predicts_as(nets, loaded, base)
    assert json.load(open(os.path.join(plan.output_dir, files.OUTPUT_MARKER)))["lora"] == {
        "rank": 4, "lora_alpha": alpha, "adapter": adapter}
    exported = str(tmp_path / "out.safetensors")
    assert export.writes_file_of(plan.output_dir, tiny_model) == (adapter != "dora")  # (dreambooth_run.sh's hint)
    if adapter == "dora":
        with pytest.raises(errors.UserError, match="holds DoRA adapters"):
            export.main(["--model_dir", plan.output_dir, "--output_file", exported])
        # (the script's last lines say why there is no command)
        assert export.why_no_file(plan.output_dir, tiny_model).startswith("the model holds DoRA adapters (--adapter dora)")
        return
    # LoHa, LoKr: LyCORIS' layout in kohya's names, read by LyCORIS' own loader (lycoris-lora, as sd-scripts loads
    # it) into the base model's UNet: merged, the weights generate.py fused through peft. (The text encoder's modules
    # in kohya's names of CLIP's, text_model_encoder_..., as the LoRA export's, which ComfyUI maps; this loader looks
    # for transformers 5's names, without text_model.)
    from lycoris import kohya
    from safetensors.torch import load_file

    for default in ("UNET_TARGET_REPLACE_MODULE", "UNET_TARGET_REPLACE_NAME", "TEXT_ENCODER_TARGET_REPLACE_MODULE",
                    "TEXT_ENCODER_TARGET_REPLACE_NAME"):  # (its network of the file's modules alone, none of its own)
        monkeypatch.setattr(kohya.LycorisNetworkKohya, default, [])

    export.main(["--model_dir", plan.output_dir, "--output_file", exported, "--save_precision", "fp32"])
    tensors = load_file(exported)
    suffixes = {key.split(".", 1)[1] for key in tensors}
    assert {key.split(".")[0][:len("lora_unet")] for key in tensors} == {"lora_unet", "lora_te_t"}
    assert suffixes <= {"alpha", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w2",
                        "lokr_w2_a", "lokr_w2_b"} and "alpha" in suffixes
    network, _ = kohya.create_network_from_weights(1.0, exported, None, base.text_encoder, base.unet, weights_sd=tensors)
    assert len(network.unet_loras) == sum(key.endswith(".alpha") and key.startswith("lora_unet") for key in tensors)
    network.merge_to(base.text_encoder, base.unet, tensors, torch.float32, "cpu")
    theirs = base.unet.state_dict()
    assert all(torch.allclose(theirs[k], v, atol=1e-6) for k, v in loaded.unet.state_dict().items())
    assert any(key.startswith("lora_te_text_model_encoder_layers_0_self_attn_k_proj.") for key in tensors)


def test_a_failed_run_names_its_cause_in_one_line():
    from ray.train import ControllerError
    from ray.train import WorkerGroupError

    error = WorkerGroupError("rank 1 failed", {1: RuntimeError("Traceback (most recent call last):\n  File x\n"
                                                             "RuntimeError: CUDA out of memory"),
                                               0: ValueError("a bad pixel")})
    assert driver.failure_cause(error) == "worker 0: a bad pixel"
    assert driver.failure_cause(ControllerError(OSError("disk full"))).endswith("disk full")


def test_one_worker_never_resized_reads_the_whole_stream_without_a_splits_coordinator(make_plan):
    """Ray Data's split hands each block out through a coordinator actor: only runs of several workers (or an elastic
    one, which may grow) need it. Every stream stays in order (a resume relies on the same rows at the same step)."""
    configs = [driver.data_config(make_plan(**fields))
               for fields in (dict(num_workers=1), dict(num_workers=2), dict(num_workers=2, min_workers=1))]
    assert [config._datasets_to_split for config in configs] == [[], "all", "all"]
    assert all(config._resolve_execution_options("train").preserve_order for config in configs)

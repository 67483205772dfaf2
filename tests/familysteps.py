"""What the flow families' tests share: one seeded training step of ours beside a reference loss written from a
diffusers DreamBooth script's own steps, on the same batch, prompts and draws."""

import torch

CPU = torch.device("cpu")
TEXTS = ("photo of unqtkn toy, on a beach", "photo of a toy")


def losses(model_dir, make_plan, reference, pipe, prior_loss_weight=0.5):
    """(our batch loss, reference(models, pixels in [-1, 1], instance prompt, class prompt, pipe, prior_loss_weight))
    of one photo and one class image at 64 px, each from torch's seed 7."""
    from dreambooth.generation import imaging
    from dreambooth.generation import prompts
    from dreambooth.models import networks
    from dreambooth.training import conditioning
    from dreambooth.training import steps

    plan = make_plan(model_dir=model_dir, resolution=64)
    models = networks.setup_models(plan, CPU, CPU, distributed=False)
    ids = prompts.prompt_ids(model_dir, [TEXTS[0]], TEXTS[1], plan.family)
    step_prompts = conditioning.step_prompts(plan.family, models.text_encoders(), plan, ids, CPU)
    pixels = torch.randint(0, 255, (2, 64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batch = {"instance_pixels": pixels[:1], "class_pixels": pixels[1:]}
    with torch.no_grad():
        torch.manual_seed(7)
        ours, _, _ = steps.batch_loss(models, batch, step_prompts, prior_loss_weight, steps.loss_options(plan))
        torch.manual_seed(7)
        expected = reference(models, imaging.to_model_input(pixels), *TEXTS, pipe, prior_loss_weight)
    return ours, expected


ADAPTERS = ("lora", "dora", "loha", "lokr", None)  # train.py's --adapter values, then a full fine-tune (None)


def lora_changes_the_transformer(pipeline_class, model_dir, adapters_dir):
    """Whether the LoRA adapters in adapters_dir, loaded into the family's pipeline by load_lora_weights as a user
    loads them and fused, change its transformer's weights (names and shapes unchanged)."""
    pipe = pipeline_class.from_pretrained(model_dir)
    base = {name: tensor.clone() for name, tensor in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(adapters_dir)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # (the fused weights stay, under the base model's names)
    fused = pipe.transformer.state_dict()
    assert fused.keys() == base.keys()
    return any(not torch.equal(fused[k], base[k]) for k in base)


def output_loaded(pipeline_class, model_dir, output_dir, adapter):
    """The family's pipeline with a run's output, as a user loads it: LoRA and DoRA through load_lora_weights, LoHa
    and LoKr fused through peft by generate.py's loading (drawing.load_pipeline), a full model by from_pretrained."""
    from dreambooth.generation import drawing

    if adapter in ("lora", "dora"):
        pipe = pipeline_class.from_pretrained(model_dir)
        pipe.load_lora_weights(output_dir)
    elif adapter:
        pipe = drawing.load_pipeline(model_dir, CPU, lora_dir=output_dir)
        assert isinstance(pipe, pipeline_class)
    else:
        pipe = pipeline_class.from_pretrained(output_dir)
    return pipe


def comfyui_merged(transformer, tensors):
    """The transformer's weights ({name: tensor}) with a LyCORIS file's LoHa/LoKr modules (tensors) merged as ComfyUI
    merges them (comfy/lora.py model_lora_keys_unet; comfy/weight_adapter/loha.py, lokr.py, read on 2026-11-28): a
    module lycoris_<diffusers' module name, "_" for "."> (the name ComfyUI maps, onto a slice of its fused weight
    where its model fuses them, as Flux.1's qkv), w1 = hada_w1_a @ hada_w1_b, w2 likewise and their product (LoHa) or
    kron(lokr_w1 (or lokr_w1_a @ lokr_w1_b), lokr_w2 (or its pair)) (LoKr), at alpha / rank: the rank is hada_w1_b's
    rows (LoHa), lokr_w2_b's, else lokr_w1_b's (LoKr), and with neither split there is no alpha / rank."""
    weights = {name: tensor.clone() for name, tensor in transformer.state_dict().items()}
    named = {"lycoris_" + name.replace(".", "_"): name for name, module in transformer.named_modules()
             if isinstance(module, torch.nn.Linear)}
    modules = {key.split(".")[0] for key in tensors}
    assert modules <= set(named), sorted(modules - set(named))[:3]  # every key a module ComfyUI maps
    for module in modules:
        t = {key.split(".", 1)[1]: value.float() for key, value in tensors.items() if key.startswith(module + ".")}
        weight = weights[named[module] + ".weight"]
        if "hada_w1_a" in t:
            diff, rank = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]), t["hada_w1_b"].shape[0]
        else:
            w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
            w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
            diff = torch.kron(w1, w2)
            rank = t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None
            # (neither split: ComfyUI's older code applies no alpha, its newer alpha / (w2's rows / w1's): the two
            # agree where the alpha is that ratio)
            assert rank or t["alpha"].item() == w2.shape[0] // w1.shape[0], module
        scale = t["alpha"].item() / rank if "alpha" in t and rank else 1.0
        weight += scale * diff.reshape(weight.shape)
    return weights


def lycoris_export_read_as_comfyui_reads_it(pipe, model_dir, output_dir, folder):
    """export.py's LyCORIS file of LoHa/LoKr adapters (output_dir) merged into the base model's transformer as ComfyUI
    merges it (comfyui_merged): every weight the adapters changed is the weight peft fused (pipe's transformer)."""
    from safetensors.torch import load_file

    from dreambooth.commands import export

    base = pipe.__class__.from_pretrained(model_dir).transformer
    path = export.main(["--model_dir", output_dir, "--output_file", str(folder / "lycoris.safetensors"),
                        "--save_precision", "fp32"])
    merged, fused = comfyui_merged(base, load_file(path)), pipe.transformer.state_dict()
    changed = [name for name, tensor in base.state_dict().items() if not torch.equal(tensor, fused[name])]
    assert changed and all(torch.allclose(merged[name], fused[name], atol=1e-6) for name in fused), changed[:3]


def lycoris_exported(pipe, model_dir, plan, adapter, folder):
    """For LoHa and LoKr adapters of a family export.py writes: lycoris_export_read_as_comfyui_reads_it; with adapters
    on a text encoder too, which it does not write yet, its one line and the way out."""
    import pytest

    from dreambooth import errors
    from dreambooth.commands import export

    if adapter not in ("loha", "lokr") or "export_lora" not in plan.family.supports:
        return
    (folder / f"{adapter}-export").mkdir()
    where = folder / f"{adapter}-export"
    if plan.train_text_encoder:
        with pytest.raises(errors.UserError, match="--no-train_text_encoder"):
            export.main(["--model_dir", plan.output_dir, "--output_file", str(where / "x.safetensors")])
        assert not export.writes_file_of(plan.output_dir, model_dir)
        # (its transformer's adapters alone, as a --no-train_text_encoder run's file holds them: exported and merged)
        pipe, output_dir = transformer_alone(pipe, model_dir, plan.output_dir, adapter, where)
    else:
        output_dir = plan.output_dir
    lycoris_export_read_as_comfyui_reads_it(pipe, model_dir, output_dir, where)


def transformer_alone(pipe, model_dir, output_dir, adapter, folder):
    """(pipe with them, folder) of a copy of an adapter output without its text encoders' adapters (their tensors and
    their entries in the file's peft settings, lora_adapter_metadata)."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from dreambooth import files

    alone = folder / "transformer-alone"
    shutil.copytree(output_dir, alone)
    path = str(alone / files.LORA_WEIGHTS_FILE)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("text_encoder")}
    settings = {k: v for k, v in json.loads(metadata["lora_adapter_metadata"]).items() if not k.startswith("text_encoder")}
    save_file(tensors, path, metadata={**metadata, "lora_adapter_metadata": json.dumps(settings)})
    return output_loaded(type(pipe), model_dir, str(alone), adapter), str(alone)


def adapter_fields(adapter):
    """train.py's settings of an output of ADAPTERS, 2 steps of which change its predictions visibly."""
    # (LoHa's and LoKr's change is a product of factors, one of them starting at zero: a larger step shows it)
    return dict(use_lora=adapter is not None, adapter=adapter, learning_rate=1e-2 if adapter in ("loha", "lokr") else 1e-3)


def outputs_load_in_the_pipeline(pipeline_class, model_dir, train_tiny, folder, inputs):
    """Trains the tiny model 2 steps as LoRA, as each other adapter (--adapter dora|loha|lokr) and as a full
    fine-tune, saves each as train.py does, loads it in the family's pipeline (LoRA, DoRA: load_lora_weights; LoHa,
    LoKr: fused through peft by generate.py's loading, drawing.load_pipeline; full: from_pretrained): its transformer
    predicts as the trained one does, unlike the base's; LoHa's and LoKr's LyCORIS files (lycoris_exported). inputs: (latents, states, encode_text's second value) for
    family.denoise. Returns the LoRA transformer trained (for the layers it adapts)."""
    from dreambooth.models import networks
    from dreambooth.models import outputs

    base = pipeline_class.from_pretrained(model_dir)
    x, states, side = inputs
    trained = {}
    for adapter in ADAPTERS:
        plan, state, losses = train_tiny(model_dir, 2, output_dir=str(folder / f"{adapter}"), **adapter_fields(adapter))
        assert not plan.train_text_encoder and all(torch.isfinite(torch.tensor(losses)))  # (its encoder is frozen)
        outputs.save_pipeline(state.models, plan)
        trained[adapter] = ours = networks.unwrap(state.models.denoiser)
        pipe = output_loaded(pipeline_class, model_dir, plan.output_dir, adapter)
        lycoris_exported(pipe, model_dir, plan, adapter, folder)

        def predict(model):
            with torch.no_grad():
                return plan.family.denoise(model, x, torch.tensor([500.0]), states, side, None)

        assert not torch.allclose(predict(pipe.transformer), predict(base.transformer), atol=1e-4)
        torch.testing.assert_close(predict(pipe.transformer), predict(ours.eval()), rtol=1e-4, atol=1e-4, msg=adapter)
    return trained["lora"]


def validation_draws_what_generate_draws(model_dir, make_plan, folder, prompt="a toy, on a beach",
                                         name="a-toy-on-a-beach-00000.png"):
    """A validation round of the tiny model (3 steps, 64 px) beside generate.py's drawing of the same prompt and
    seed with the same weights: the same image (the round's file name), to within 1 of 255, nothing flagged.
    Returns what drew them (plan, sampler, pipe, settings, seed) for a test's own checks of its family's guidance."""
    import types

    import numpy as np

    from dreambooth.generation import drawing
    from dreambooth.models import networks
    from dreambooth.training import validation

    plan = make_plan(model_dir=model_dir, resolution=64, validation_prompts=(prompt,), num_validation_images=1,
                     validation_inference_steps=3)
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    sampler = validation.Sampler(nets, plan, amp_dtype=None)
    _, images = validation.run_round(sampler, 1, 0, 1, str(folder))
    pipe = drawing.load_pipeline(model_dir, CPU)
    settings = drawing.settings_for(drawing.ImageSettings(num_inference_steps=3), plan.family, plan.model_dir)
    seed = drawing.image_seed(plan.seed, prompt, 0)
    drawn, flagged = drawing.generate_batch(pipe, [prompt], [seed], settings, plan.family.pipeline_kwargs(),
                                            plan.family.guidance_argument)
    assert flagged == [False] and drawn[0].size == (64, 64)
    sample = images[name]
    assert np.abs(np.asarray(drawn[0], dtype=int) - np.asarray(sample, dtype=int)).max() <= 1
    return types.SimpleNamespace(plan=plan, sampler=sampler, pipe=pipe, settings=settings, seed=seed)


def flux2_lora_on_the_scripts_layers(pipeline_class, model_dir, singles, train_tiny, folder):
    """FLUX.2 ([klein], [dev]): outputs_load_in_the_pipeline, and the LoRA adapters sit on the layers diffusers'
    script names (its target list, up to its `singles` single blocks, given to peft on the same transformer)."""
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    scripts = Flux2Transformer2DModel.from_pretrained(model_dir, subfolder="transformer")
    scripts.add_adapter(LoraConfig(r=4, target_modules=["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
                                                        *[f"single_transformer_blocks.{i}.attn.to_out"
                                                          for i in range(singles)]]))
    ours = outputs_load_in_the_pipeline(pipeline_class, model_dir, train_tiny, folder, (
        torch.randn(1, 32, 4, 4, generator=torch.Generator().manual_seed(2)), torch.randn(1, 6, 3 * 32), None))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in ours.named_parameters() if ".lora_A." in n}
    assert adapted == {n.rsplit(".lora_A", 1)[0] for n, _ in scripts.named_parameters() if ".lora_A." in n}

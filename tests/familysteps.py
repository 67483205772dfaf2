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
    seed with the same weights: the same image (the round's file name), to within 1 of 255, nothing flagged. Frozen
    text encoders are released, as the worker releases them, to the meta device (where a read of them fails).
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
    if plan.text_encoded_once:
        nets.release_text_encoders("meta")
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


# ComfyUI's names for a diffusers transformer's weights, reconstructed from its code (Comfy-Org/ComfyUI: comfy/lora.py
# at ec93dcac, comfy/utils.py at 09708eae, comfy/weight_adapter/lora.py at 6f98b150): comfy/utils.py
# flux_to_diffusers (FLUX.2: comfy.model_base.Flux2 is a Flux) and z_image_to_diffusers (Z-Image:
# comfy.model_base.Lumina2, its NextDiT) map each diffusers weight onto its model's, a q, k or v onto its rows of the
# fused qkv weight; comfy/lora.py model_lora_keys_unet names each of its model's weights for a LoRA file lora_unet_
# and the weight's name (without .weight) with its dots as underscores (its first loop, for every model; its Flux and
# Lumina2 branches add the diffusers names, transformer.<module> and lycoris_<module>, onto the same weights).

def comfyui_flux2_layout(config):
    """{diffusers weight: (ComfyUI's FLUX.2 weight, first row, rows or None: all)} of the blocks' linear layers of a
    FLUX.2 transformer of config, as flux_to_diffusers maps them (hidden_size: heads x head width)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    layout = {}
    for i in range(config["num_layers"]):
        ours, theirs = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for stream, names in (("img_attn", ("to_q", "to_k", "to_v")), ("txt_attn", ("add_q_proj", "add_k_proj",
                                                                                   "add_v_proj"))):
            for k, name in enumerate(names):
                layout[f"{ours}attn.{name}.weight"] = (f"{theirs}{stream}.qkv.weight", k * width, width)
        for name, original in (("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"),
                               ("ff.linear_in", "img_mlp.0"), ("ff.linear_out", "img_mlp.2"),
                               ("ff_context.linear_in", "txt_mlp.0"), ("ff_context.linear_out", "txt_mlp.2")):
            layout[f"{ours}{name}.weight"] = (f"{theirs}{original}.weight", 0, None)
    for i in range(config["num_single_layers"]):
        for name, original in (("attn.to_qkv_mlp_proj", "linear1"), ("attn.to_out", "linear2")):
            layout[f"single_transformer_blocks.{i}.{name}.weight"] = (f"single_blocks.{i}.{original}.weight", 0, None)
    return layout


def comfyui_zimage_layout(config):
    """{diffusers weight: (ComfyUI's Z-Image weight, first row, rows or None: all)} of the linear layers of a Z-Image
    transformer of config, as z_image_to_diffusers maps them (q, k and v each dim rows of attention.qkv)."""
    dim = config["dim"]
    layout = {}
    for blocks, count in (("layers", config["n_layers"]), ("noise_refiner", config["n_refiner_layers"]),
                          ("context_refiner", config["n_refiner_layers"])):
        for i in range(count):
            block = f"{blocks}.{i}."
            for k, name in enumerate(("to_q", "to_k", "to_v")):
                layout[f"{block}attention.{name}.weight"] = (f"{block}attention.qkv.weight", k * dim, dim)
            layout[f"{block}attention.to_out.0.weight"] = (f"{block}attention.out.weight", 0, None)
            for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0"):
                layout[f"{block}{name}.weight"] = (f"{block}{name}.weight", 0, None)
    for name, original in (("all_x_embedder.2-1", "x_embedder"), ("all_final_layer.2-1.linear", "final_layer.linear"),
                           ("all_final_layer.2-1.adaLN_modulation.1", "final_layer.adaLN_modulation.1"),
                           ("cap_embedder.1", "cap_embedder.1"), ("t_embedder.mlp.0", "t_embedder.mlp.0"),
                           ("t_embedder.mlp.2", "t_embedder.mlp.2")):
        layout[f"{name}.weight"] = (f"{original}.weight", 0, None)
    return layout


def comfyui_hidream_layout(config):
    """{diffusers weight: (ComfyUI's HiDream weight, 0, None: all rows)} of the weights a LoRA can adapt in ComfyUI's
    HiDream model (linear layers, the mixtures' gates) as comfy/ldm/hidream/model.py names them from config (ComfyUI
    a125cd8): HiDream-I1's original layout (no key converted), each the same name in diffusers' model."""
    experts, attention = config["num_routed_experts"], ("to_q", "to_k", "to_v", "to_out")

    def swiglu(prefix):  # FeedForwardSwiGLU
        return [f"{prefix}.{name}" for name in ("w1", "w2", "w3")]

    def block(prefix, dual):  # HiDreamImageBlock's HiDreamImageTransformerBlock (dual), else its single-stream one
        moe = [*swiglu(f"{prefix}ff_i.shared_experts"), f"{prefix}ff_i.gate",  # MOEFeedForwardSwiGLU
               *[m for e in range(experts) for m in swiglu(f"{prefix}ff_i.experts.{e}")]]
        ff_i = moe if experts else swiglu(f"{prefix}ff_i")
        return [f"{prefix}adaLN_modulation.1", *[f"{prefix}attn1.{name}{stream}" for stream in ("", "_t")[:1 + dual]
                                                 for name in attention], *ff_i, *(swiglu(f"{prefix}ff_t") if dual else [])]

    modules = ["t_embedder.timestep_embedder.linear_1", "t_embedder.timestep_embedder.linear_2",
               "p_embedder.pooled_embedder.linear_1", "p_embedder.pooled_embedder.linear_2", "x_embedder.proj",
               "final_layer.linear", "final_layer.adaLN_modulation.1",
               *[f"caption_projection.{k}.linear" for k in range(config["num_layers"] + config["num_single_layers"] + 1)],
               *[m for i in range(config["num_layers"]) for m in block(f"double_stream_blocks.{i}.block.", True)],
               *[m for i in range(config["num_single_layers"]) for m in block(f"single_stream_blocks.{i}.block.", False)]]
    return {f"{module}.weight": (f"{module}.weight", 0, None) for module in modules}


def comfyui_lora_keys(layout):
    """{LoRA module name: ComfyUI's weight} that model_lora_keys_unet makes for its model's weights (layout's)."""
    return {"lora_unet_" + original[:-len(".weight")].replace(".", "_"): original for original, _, _ in layout.values()}


def comfyui_kohya_merged(weights, tensors, layout):
    """The transformer's weights ({diffusers name: tensor}, those of layout) with a kohya LoRA file's tensors merged as
    ComfyUI merges them: its model's weights put together from them (layout), each file module the weight
    comfyui_lora_keys names, which gains alpha / rank x lora_up @ lora_down (comfy/weight_adapter/lora.py
    LoRAAdapter.calculate_weight: the rank lora_down's rows, no alpha 1.0), read back through layout."""
    parts = {}
    for name, (original, row, _) in layout.items():
        parts.setdefault(original, []).append((row, weights[name]))
    model = {original: torch.cat([w for _, w in sorted(rows, key=lambda r: r[0])]).clone()
             for original, rows in parts.items()}
    keys = comfyui_lora_keys(layout)
    modules = {key.split(".")[0] for key in tensors}
    assert modules <= set(keys), sorted(modules - set(keys))[:3]  # every module one ComfyUI maps
    assert all(key.split(".", 1)[1] in ("lora_up.weight", "lora_down.weight", "alpha") for key in tensors)  # all read
    for module in modules:
        up, down = tensors[f"{module}.lora_up.weight"].float(), tensors[f"{module}.lora_down.weight"].float()
        alpha = tensors[f"{module}.alpha"].item() if f"{module}.alpha" in tensors else None
        model[keys[module]] += (alpha / down.shape[0] if alpha is not None else 1.0) * (up @ down)
    return {name: model[original][row:row + rows] if rows else model[original]
            for name, (original, row, rows) in layout.items()}


def trained_weights(denoiser):
    """{name: tensor} of a peft-adapted transformer's weights with its adapters merged (peft's own merge)."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    merged = copy.deepcopy(denoiser)
    for module in merged.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {name.replace(".base_layer", ""): tensor for name, tensor in merged.state_dict().items()
            if "lora_" not in name}


def kohya_export_read_as_comfyui_reads_it(pipeline_class, model_dir, train_tiny, folder, layout_of, kohya_module,
                                          diffusers_reads_it=True):
    """A tiny LoRA trained 2 steps and saved as train.py does, exported by export.py: every module of its file one
    ComfyUI maps onto its model (comfyui_lora_keys of layout_of(the transformer's config), the key kohya_module names
    for each diffusers layer of it); merged as ComfyUI merges it (comfyui_kohya_merged), the trained transformer's
    weights, every one the adapters changed; if diffusers_reads_it (HiDream's pipeline reads no kohya names), read back
    by the family's pipeline (diffusers' kohya reader, load_lora_weights) and fused, the same. Returns its tensors."""
    import os

    from safetensors.torch import load_file

    from dreambooth import files
    from dreambooth.commands import export
    from dreambooth.models import networks
    from dreambooth.models import outputs

    base = pipeline_class.from_pretrained(model_dir)
    before = {name: tensor.clone() for name, tensor in base.transformer.state_dict().items()}
    # (ComfyUI's map names a context refiner's adaLN_modulation too, which Z-Image has not: the transformer's weights')
    layout = {name: place for name, place in layout_of(base.transformer.config).items() if name in before}
    keys = comfyui_lora_keys(layout)
    width = {name: rows for name, (_, _, rows) in layout.items()}
    for name, (original, row, _) in layout.items():  # (each diffusers layer: ComfyUI's name and its rows of it)
        module, part = kohya_module(name[:-len(".weight")])
        assert keys[module] == original and (part is None) == (width[name] is None), name
        assert part is None or row == "qkv".index(part) * width[name], name
    plan, state, _ = train_tiny(model_dir, 2, use_lora=True, lora_alpha=8.0, output_dir=str(folder / "kohya-lora"))
    outputs.save_pipeline(state.models, plan)
    path = export.main(["--model_dir", plan.output_dir, "--output_file", str(folder / "kohya.safetensors"),
                        "--save_precision", "fp32"])
    tensors = load_file(path)
    assert tensors and all(key.startswith("lora_unet_") for key in tensors)
    adapted = {key[len("transformer."):].rsplit(".lora_", 1)[0] + ".weight"
               for key in load_file(os.path.join(plan.output_dir, files.LORA_WEIGHTS_FILE))}
    trained = trained_weights(networks.unwrap(state.models.denoiser))
    assert trained.keys() == before.keys() and adapted <= set(layout)
    assert {name for name in before if not torch.equal(before[name], trained[name])} == adapted
    merged = comfyui_kohya_merged(before, tensors, layout)
    for name in layout:
        torch.testing.assert_close(merged[name], trained[name], rtol=0, atol=1e-6, msg=name)
    if not diffusers_reads_it:
        return tensors
    base.load_lora_weights(dict(tensors))
    base.fuse_lora()
    base.unload_lora_weights()  # (the fused weights stay, under the base model's names)
    fused = base.transformer.state_dict()
    for name in layout:
        torch.testing.assert_close(fused[name], trained[name], rtol=0, atol=1e-6, msg=name)
    return tensors

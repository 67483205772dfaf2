import os

import pytest
import torch
from safetensors import safe_open
from support import modes_not_as_umask

from dreambooth import errors
from dreambooth import families
from dreambooth.commands import export
from dreambooth.families.shared import fluxblocks
from dreambooth.families.shared import layouts
from dreambooth.models import outputs


def tuned_copy(base_model, folder):
    """A full model folder whose every weight differs from the base model's (as after training)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base_model, safety_checker=None)
    torch.manual_seed(0)
    with torch.no_grad():
        for model in (c for c in pipe.components.values() if isinstance(c, torch.nn.Module)):
            for weight in model.parameters():
                weight.add_(torch.randn_like(weight) * 0.01)
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tuned_model(tiny_model, tmp_path_factory):
    return tuned_copy(tiny_model, str(tmp_path_factory.mktemp("tuned")))


def weights(pipe, part):
    return getattr(pipe, part).state_dict()


def test_full_model_round_trips_through_diffusers_single_file_loader(tuned_model, tiny_model, tmp_path):
    """Loaded as A1111 users' files are (from_single_file with the base model's configs),
    the export gives back the tuned weights exactly, not the base model's."""
    from diffusers import StableDiffusionPipeline

    path = export.main(["--model_dir", tuned_model, "--output_file", str(tmp_path / "tuned.safetensors"),
                        "--save_precision", "fp32"])
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("first_stage_model.encoder.mid.attn_1.q.weight").ndim == 4  # 1x1 conv, as the original
    assert all(k.startswith(("model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer.text_model."))
               for k in keys)
    loaded = StableDiffusionPipeline.from_single_file(path, config=tiny_model, local_files_only=True,
                                                      safety_checker=None)
    tuned = StableDiffusionPipeline.from_pretrained(tuned_model, safety_checker=None)
    base = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    for part in ("unet", "vae", "text_encoder"):
        ours, back, orig = weights(tuned, part), weights(loaded, part), weights(base, part)
        assert set(back) == set(ours)
        assert all(torch.equal(back[k], ours[k]) for k in ours), part
        assert not torch.equal(back[next(iter(orig))], orig[next(iter(orig))])
    assert len(keys) == sum(len(weights(tuned, p)) for p in ("unet", "vae", "text_encoder"))

    half = export.main(["--model_dir", tuned_model, "--output_file", str(tmp_path / "tuned-fp16.safetensors")])
    assert os.path.getsize(half) < 0.55 * os.path.getsize(path)
    with safe_open(half, "pt") as f:
        assert f.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.float16


def test_sd2_model_round_trips_with_open_clip_text_encoder_names(tiny_sd2v_model, tmp_path):
    """SD 2.x: the text encoder in OpenCLIP's layout (cond_stage_model.model.*, q/k/v stacked as
    in_proj), read back by diffusers' loader of SD 2.x files as the tuned weights; the model's
    v-prediction comes with its configs."""
    from diffusers import StableDiffusionPipeline

    tuned_dir = tuned_copy(tiny_sd2v_model, str(tmp_path / "tuned"))
    path = export.main(["--model_dir", tuned_dir, "--output_file", str(tmp_path / "sd2.safetensors"),
                        "--save_precision", "fp32"])
    tuned = StableDiffusionPipeline.from_pretrained(tuned_dir, safety_checker=None)
    hidden = tuned.text_encoder.config.hidden_size
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        in_proj = f.get_tensor("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight")
        assert torch.equal(in_proj[hidden:2 * hidden], weights(tuned, "text_encoder")[
            next(k for k in weights(tuned, "text_encoder") if k.endswith("layers.0.self_attn.k_proj.weight"))])
    assert "cond_stage_model.model.positional_embedding" in keys
    assert not [k for k in keys if k.startswith("cond_stage_model.transformer.")]
    loaded = StableDiffusionPipeline.from_single_file(path, config=tiny_sd2v_model, local_files_only=True,
                                                      safety_checker=None)
    assert loaded.scheduler.config.prediction_type == "v_prediction"
    for part in ("unet", "vae", "text_encoder"):
        ours, back = weights(tuned, part), weights(loaded, part)
        assert set(back) == set(ours)
        assert all(torch.equal(back[k], ours[k]) for k in ours), part


def test_sdxl_model_round_trips_in_the_original_sdxl_layout(tiny_sdxl_model, tmp_path):
    """SDXL: the first text encoder under conditioner.embedders.0.transformer, the second in
    OpenCLIP's layout under conditioner.embedders.1.model with its projection, the size/crop
    embedding as label_emb; StableDiffusionXLPipeline.from_single_file gives back the tuned weights."""
    from diffusers import StableDiffusionXLPipeline

    tuned_dir = tuned_copy(tiny_sdxl_model, str(tmp_path / "tuned"))
    path = export.main(["--model_dir", tuned_dir, "--output_file", str(tmp_path / "xl.safetensors"),
                        "--save_precision", "fp32"])
    tuned = StableDiffusionXLPipeline.from_pretrained(tuned_dir)
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        projection = f.get_tensor("conditioner.embedders.1.model.text_projection")
    assert torch.equal(projection, tuned.text_encoder_2.text_projection.weight.T)
    assert "model.diffusion_model.label_emb.0.0.weight" in keys
    assert "conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight" in keys
    assert not [k for k in keys if k.startswith("cond_stage_model.")]
    loaded = StableDiffusionXLPipeline.from_single_file(path, config=tiny_sdxl_model, local_files_only=True)
    for part in ("unet", "vae", "text_encoder", "text_encoder_2"):
        ours, back = weights(tuned, part), weights(loaded, part)
        assert set(back) == set(ours), part
        assert all(torch.equal(back[k], ours[k]) for k in ours), part


def test_sd3_model_round_trips_in_stabilitys_single_file_layout(tiny_sd3_model, tmp_path):
    """SD 3.5: the transformer in the original MMDiT layout (family_sd3.original_transformer), the VAE as SD's,
    CLIP-L, CLIP-G and T5 under text_encoders.clip_l/clip_g/t5xxl.transformer (the files that hold all three);
    StableDiffusion3Pipeline.from_single_file gives back the tuned weights (but CLIP-L's projection, which it
    sets to the identity: SD 3 reads CLIP-L's pooled output unprojected)."""
    from diffusers import StableDiffusion3Pipeline

    tuned_dir = tuned_copy(tiny_sd3_model, str(tmp_path / "tuned"))
    path = export.main(["--model_dir", tuned_dir, "--output_file", str(tmp_path / "sd3.safetensors"),
                        "--save_precision", "fp32"])
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    assert {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "model.diffusion_model.pos_embed",
            "text_encoders.t5xxl.transformer.shared.weight", "first_stage_model.decoder.conv_out.weight",
            "text_encoders.clip_g.transformer.text_model.embeddings.position_embedding.weight"} <= keys
    tuned = StableDiffusion3Pipeline.from_pretrained(tuned_dir)
    loaded = StableDiffusion3Pipeline.from_single_file(path, config=tiny_sd3_model, local_files_only=True)
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        ours, back = weights(tuned, part), weights(loaded, part)
        if part == "text_encoder":
            del ours["text_projection.weight"], back["text_projection.weight"]
        assert set(back) == set(ours), part
        assert [k for k in ours if back[k].is_meta or not torch.equal(back[k], ours[k])] == [], part


# Flux.1's and Chroma's single-file converters in diffusers assume the released width (3072: 24 heads of 128)
BFL_WIDTH = [name for name, f in families.FAMILIES.items() if isinstance(f, fluxblocks.FluxBlocks)]


@pytest.mark.parametrize("arch", [name for name, f in families.FAMILIES.items()
                                  if f.denoiser_file and name not in BFL_WIDTH])
def test_a_flow_models_transformer_exports_alone_in_its_original_layout_and_diffusers_reads_it_back(arch, tiny_model_of,
                                                                                                   tmp_path, capsys):
    """export.py on a full model of each family whose file is its transformer alone (denoiser_file), as the model's
    own release and ComfyUI's files are: diffusers' converter of that transformer from the original layout (which
    its single-file loader skips for a file already in diffusers' names) and the loader itself give back every
    weight, and the line says where the file goes."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from safetensors.torch import load_file

    model_dir = tiny_model_of(arch)
    family = families.FAMILIES[arch]
    path = export.main(["--model_dir", model_dir, "--output_file", str(tmp_path / f"{arch}.safetensors"),
                        "--save_precision", "fp32"])
    assert "(its original layout, alone)" in capsys.readouterr().err
    transformer = family.load_denoiser(lambda cls, subfolder: cls.from_pretrained(model_dir, subfolder=subfolder))
    convert = SINGLE_FILE_LOADABLE_CLASSES[type(transformer).__name__]["checkpoint_mapping_fn"]
    back = type(transformer).from_single_file(path, config=model_dir, subfolder="transformer", local_files_only=True)
    ours = transformer.state_dict()
    for theirs in (convert(load_file(path), config=transformer.config), back.state_dict()):
        assert set(theirs) == set(ours)
        assert [k for k in ours if theirs[k].is_meta or not torch.equal(theirs[k], ours[k])] == []


@pytest.mark.parametrize("arch", BFL_WIDTH)
def test_flux_and_chroma_export_their_transformer_in_bfls_layout_which_diffusers_converts_back(arch, tiny_model_of,
                                                                                              tmp_path, capsys):
    """Flux.1's and Chroma's transformer at the released width with one block of each kind (diffusers' converters
    assume that width), random bf16 weights: their export in BFL's layout (q, k and v joined; a single block's input
    with the MLP's; the final modulation as shift, scale; Chroma's approximator by its own names) converted back by
    diffusers is every weight. export.py writes the tiny model's file with the same names."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    family = families.FAMILIES[arch]
    tiny = family.load_denoiser(lambda cls, subfolder: cls.from_pretrained(tiny_model_of(arch), subfolder=subfolder))
    with torch.device("meta"):
        wide = type(tiny).from_config({**tiny.config, "num_layers": 1, "num_single_layers": 1,
                                       "attention_head_dim": 128, "num_attention_heads": 24,
                                       "axes_dims_rope": (16, 56, 56)})
    wide = wide.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in wide.parameters():
            weight.normal_(generator=generator)
    convert = SINGLE_FILE_LOADABLE_CLASSES[type(wide).__name__]["checkpoint_mapping_fn"]
    ours, theirs = wide.state_dict(), convert(family.single_file_denoiser(wide))
    assert set(theirs) == set(ours)
    assert [k for k in ours if not torch.equal(theirs[k], ours[k])] == []
    path = export.main(["--model_dir", tiny_model_of(arch), "--output_file", str(tmp_path / "t.safetensors")])
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == set(family.single_file_denoiser(tiny)) and "img_in.weight" in f.keys()
    assert "(its original layout, alone)" in capsys.readouterr().err


def test_unet_and_vae_names_are_those_of_the_original_sd_1_checkpoints():
    """SD 1.x's own block layout (4 levels, 2 layers each, no attention at the UNet's deepest level)
    at a small width: the renamed keys include the well-known names of the v1-5 checkpoint."""
    from diffusers import AutoencoderKL
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(block_out_channels=(32, 32, 64, 64), layers_per_block=2, cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=8,
                                down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                                up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
    vae = AutoencoderKL(block_out_channels=(8, 16, 32, 32), layers_per_block=2, norm_num_groups=8,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    unet_keys = families.FAMILIES["sd1"].single_file_denoiser(unet)
    vae_keys = families.FAMILIES["sd1"].single_file_vae(vae)
    assert len(unet_keys) == len(unet.state_dict()) and len(vae_keys) == len(vae.state_dict())
    for key in ("time_embed.2.weight", "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
                "input_blocks.3.0.op.weight", "input_blocks.7.0.skip_connection.weight", "input_blocks.11.0.emb_layers.1.weight",
                "middle_block.1.proj_in.weight", "middle_block.2.out_layers.3.weight", "output_blocks.2.1.conv.weight",
                "output_blocks.5.2.conv.weight", "output_blocks.8.2.conv.weight", "output_blocks.11.1.proj_out.weight",
                "output_blocks.0.0.in_layers.2.weight", "out.2.weight"):
        assert key in unet_keys, key
    for key in ("encoder.down.0.downsample.conv.weight", "encoder.down.2.block.0.nin_shortcut.weight",
                "encoder.mid.attn_1.proj_out.weight", "encoder.norm_out.weight", "decoder.up.3.upsample.conv.weight",
                "decoder.up.0.block.0.nin_shortcut.weight", "decoder.mid.block_2.conv2.weight", "quant_conv.weight"):
        assert key in vae_keys, key
    assert "decoder.up.0.upsample.conv.weight" not in vae_keys  # the original's bottom level keeps its size


def test_a_weight_with_no_original_name_is_an_error():
    with pytest.raises(errors.UserError, match="no original-layout name for the UNet weight add_embedding"):
        layouts.rename({"add_embedding.linear_1.weight": torch.zeros(1)}, layouts.unet_prefixes(
            {"layers_per_block": 1, "up_block_types": ("UpBlock2D",)}), "UNet")


def test_lora_exports_to_kohya_that_diffusers_loads_with_its_alpha(lora_output, tiny_model, tmp_path):
    """rank 4, alpha 8: the kohya file must carry alpha 8 on every module, or loaders scale by 1."""
    from diffusers import StableDiffusionPipeline

    folder, _ = lora_output
    path = export.main(["--model_dir", folder, "--output_file", str(tmp_path / "subject-lora.safetensors"),
                        "--save_precision", "fp32"])
    with safe_open(path, "pt") as f:
        keys = list(f.keys())
        assert {float(f.get_tensor(k)) for k in keys if k.endswith(".alpha")} == {8.0}
        assert f.metadata()["ss_network_dim"] == "4"
    assert all(k.startswith(("lora_unet_", "lora_te_text_model_encoder_layers_")) for k in keys)
    # readable as the umask says (a ComfyUI running as another user opens them), the adapters' folder too
    assert modes_not_as_umask(path) == [] and modes_not_as_umask(folder) == []
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.lora_up.weight" in keys

    def fused(source):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
        pipe.load_lora_weights(source)
        pipe.fuse_lora()
        pipe.unload_lora_weights()  # the fused weights stay, under their own names
        return pipe

    ours, kohya = fused(folder), fused(path)
    base = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    for part in ("unet", "text_encoder"):
        a, b, orig = (getattr(p, part).state_dict() for p in (ours, kohya, base))
        assert set(a) == set(b) == set(orig)
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), part
        assert any(not torch.equal(a[k], orig[k]) for k in orig)


def test_export_refuses_to_overwrite_or_to_write_another_format(tuned_model, tmp_path):
    existing = tmp_path / "model.safetensors"
    existing.write_bytes(b"mine")
    with pytest.raises(errors.UserError, match="exists: pass --overwrite"):
        export.main(["--model_dir", tuned_model, "--output_file", str(existing)])
    assert existing.read_bytes() == b"mine"
    with pytest.raises(errors.UserError, match="must end in .safetensors"):
        export.main(["--model_dir", tuned_model, "--output_file", str(tmp_path / "model.ckpt")])


def test_lycoris_adapters_of_a_transformers_text_encoder_are_refused_in_one_line_and_get_no_hint(tiny_flux_model,
                                                                                                tmp_path):
    """A Flux.1 LoKr output whose text encoder was trained too (train.py's default): its LyCORIS file is written for
    the transformer alone yet, so export.py says so in one line with the way out, and dreambooth_run.sh's hint
    (writes_file_of) offers no command that would fail (a new user's walk met the first as an unclear line)."""
    from safetensors.torch import save_file

    from dreambooth import files
    from dreambooth.models import outputs

    folder = tmp_path / "lokr"
    folder.mkdir()
    save_file({"transformer.transformer_blocks.0.attn.to_q.lokr_w1": torch.ones(2, 2),
               "text_encoder.text_model.encoder.layers.0.self_attn.k_proj.lokr_w1": torch.ones(2, 2)},
              str(folder / files.LORA_WEIGHTS_FILE))
    files.write_json(str(folder / files.OUTPUT_MARKER), outputs.TrainRecord(
        tiny_flux_model, steps=2, lora=outputs.LoraSettings.of(True, 4, 4.0, "lokr")).to_json())
    with pytest.raises(errors.UserError) as said:
        export.main(["--model_dir", str(folder), "--output_file", str(tmp_path / "x.safetensors")])
    assert str(said.value) == f"{folder} {export.TEXT_LYCORIS}" and "--no-train_text_encoder" in str(said.value)
    assert not export.writes_file_of(str(folder), tiny_flux_model)
    # (what the script's last lines say instead of a command: the same reason)
    assert export.why_no_file(str(folder), tiny_flux_model) == f"the model {export.TEXT_LYCORIS}"


def test_an_export_of_a_model_that_a_later_run_replaced_is_removed_and_this_models_is_kept(lora_output, tmp_path,
                                                                                        capsys):
    """The file names the train.py output it was written from (its model id, in the metadata); dreambooth_run.sh's
    check after Step 4 (forget_stale_file) removes a file of another model of the subject, with a line, and keeps
    this model's and a file that names none (written elsewhere)."""
    from safetensors.torch import save_file

    folder, _ = lora_output
    path = export.main(["--model_dir", folder, "--output_file", str(tmp_path / "rex.safetensors")])
    with safe_open(path, "pt") as f:
        assert f.metadata()[export.MODEL_ID] == outputs.read_output(folder).model_id
    assert not export.forget_stale_file(path, folder) and os.path.isfile(path)
    capsys.readouterr()
    save_file({"x": torch.zeros(1)}, path, metadata={export.MODEL_ID: "an-earlier-model"})
    assert export.forget_stale_file(path, folder) and not os.path.exists(path)
    assert capsys.readouterr().err == f"removed {path}: the export of the model this run replaced\n"
    save_file({"x": torch.zeros(1)}, path)
    assert not export.forget_stale_file(path, folder) and os.path.isfile(path)

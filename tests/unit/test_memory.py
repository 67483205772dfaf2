"""memory.py and the preflight's GPU checks: the need of each mode from parameter counts and the
measured activations, the flags that make a run fit a card, and torch's view of the GPUs Ray counts."""

import os

import pytest
import torch

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth.commands import preflight
from dreambooth.files import REPO_DIR
from dreambooth.models import random_models
from dreambooth.planning import memory


def counted_sizes():
    """(full size built here, family) of every family whose released parameter counts memory.py holds: its released
    size, else its own full size (SD 1.x: sd15, the general full size of its layout); SD 2.x has none built here."""
    rows = []
    for name, f in families.FAMILIES.items():
        size = f.released_size or next(iter(f.random.own_sizes), None) or ("sd15" if f is families.DEFAULT else None)
        if f.released_params and size:
            rows.append((size, name))
    return rows


@pytest.mark.parametrize("size, family", counted_sizes())
def test_released_parameter_counts_are_the_architectures_built_on_the_meta_device(size, family):
    counts = random_models.parameter_counts(size, families.FAMILIES[family].random.arch)
    assert counts.keys() == memory.RELEASED[family].keys()
    for name, count in counts.items():
        assert memory.RELEASED[family][name] == pytest.approx(count, rel=1e-4), name


def test_the_activation_count_of_sd1_is_the_calibration_and_fused_attention_is_counted_as_such():
    """activations.py's count of SD 1.x's UNet at 512 px (per image, bf16, meta device) is COUNTED_SD1, the
    figure its GPU measurement calibrates; counted with the eager attention matrix instead it would be more."""

    from dreambooth.planning import activations

    counts = []
    for checkpointed in (False, True):
        unet = random_models.meta_networks("sd15", "sd1")["unet"].to(torch.bfloat16).train()
        if checkpointed:
            unet.enable_gradient_checkpointing()
        meta = dict(device="meta", dtype=torch.bfloat16)
        latents, states = torch.empty(4, 4, 64, 64, **meta), torch.empty(4, 77, 768, **meta)
        counts.append(activations.saved_gib(unet, lambda: unet(latents, torch.zeros(4, device="meta"), states)) / 4)
    assert counts == pytest.approx(activations.COUNTED_SD1, rel=2e-3)
    assert activations.MEASURED_SD1 == (memory.ACTIVATION_GIB, memory.CHECKPOINTED_GIB)


def test_the_flow_transformers_need_follows_their_base_precision_resolution_and_text_encoders():
    """Flux.1 dev LoRA: nf4 < int8 < bf16 base; 1024 px needs more activations than 512; T5 (never trained) is
    on the card every step with --train_text_encoder (CLIP-L's adapters), only at the start without; a full
    fine-tune fits no single card, and the flags that fit a 24 GB one are LoRA over a quantised base."""
    lora = memory.Setup(lora=True, gradient_checkpointing=True, batch=1, train_text_encoder=False, resolution=1024)
    bf16, int8, nf4 = (memory.need("flux", memory.dataclasses.replace(lora, base_precision=b))
                       for b in (None, "int8", "nf4"))
    assert nf4.static < int8.static < bf16.static
    assert bf16.static - int8.static == pytest.approx(11901.41e6 / memory.GIB, rel=1e-3)  # one byte a weight less
    small = memory.need("flux", memory.dataclasses.replace(lora, resolution=512))
    assert 0 < small.activations < bf16.activations
    t5 = 4762.31e6 * 2 / memory.GIB
    assert bf16.at_start == pytest.approx(t5 + (123.06e6 + 83.82e6) * 2 / memory.GIB)  # the text side alone
    assert bf16.total == bf16.static + bf16.activations  # (T5 is gone when the transformer arrives)
    with_clip = memory.need("flux", memory.dataclasses.replace(lora, train_text_encoder=True))
    assert with_clip.at_start == 0 and with_clip.static > bf16.static + t5
    full = memory.Setup(gradient_checkpointing=True, use_8bit_adam=True, batch=1, train_text_encoder=False,
                        resolution=1024)
    assert not memory.fits(memory.need("flux", full), 80)
    words, fixed, result = memory.fixes("flux", full, 24)
    assert words == ["--use_lora", "--base_precision", "int8"] and memory.fits(result, 24)


def test_frozen_text_encoders_that_decide_the_card_are_quantised_last():
    """FLUX.2 [dev]'s LoRA: its 24 B text encoder, alone on the card at the start, decides the figure once the
    transformer is quantised; --text_encoder_precision brings it to a byte (int8) or about half a byte (nf4) a
    parameter, and the fixes for a 48 GB card reach it only after the base's own quantisation."""
    lora = memory.Setup(lora=True, gradient_checkpointing=True, batch=1, train_text_encoder=False, resolution=1024)
    nf4 = memory.need("flux2dev", memory.dataclasses.replace(lora, base_precision="nf4"))
    encoders = 24011.36e6 + 84.05e6  # Mistral 3 and the VAE, at the start
    assert nf4.total == nf4.at_start == pytest.approx(encoders * 2 / memory.GIB)
    for precision, size in (("int8", 1.0), ("nf4", 0.5 + 4 / 64)):
        quantised = memory.need("flux2dev", memory.dataclasses.replace(lora, base_precision="nf4",
                                                                         text_encoder_precision=precision))
        assert quantised.at_start == pytest.approx((24011.36e6 * size + 84.05e6 * 2) / memory.GIB)
        assert quantised.static == nf4.static and quantised.total < nf4.total
    card = 48e9 / memory.GIB  # (a 48 GB card: 44.7 GiB)
    words, setup, result = memory.fixes("flux2dev", lora, card)
    assert words == ["--base_precision", "nf4", "--text_encoder_precision", "int8"] and memory.fits(result, card)
    assert "--text_encoder_precision int8" in " ".join(setup.flags())


def test_the_computed_need_meets_the_measured_peaks_and_orders_the_modes():
    for (family, setup), measured in memory.MEASURED.items():
        computed = memory.need(family, setup).total
        assert measured <= computed <= measured * 1.05  # never under what was measured, at most 5 % over
    full = memory.need("sd1", memory.Setup()).total
    ladder = [memory.Setup(gradient_checkpointing=True), memory.Setup(gradient_checkpointing=True, use_8bit_adam=True),
              memory.Setup(gradient_checkpointing=True, use_8bit_adam=True, train_text_encoder=False),
              memory.Setup(lora=True, gradient_checkpointing=True)]
    needs = [memory.need("sd1", s).total for s in ladder]
    assert full > needs[0] > needs[1] > needs[2] > needs[3]
    # twice the pixels, twice the activations; fp32 activations twice bf16's; EMA one more fp32 copy
    one = memory.need("sd1", memory.Setup(resolution=512))
    assert memory.need("sd1", memory.Setup(resolution=724)).activations == pytest.approx(2 * one.activations, rel=0.01)
    assert memory.need("sd1", memory.Setup(half=False)).activations == pytest.approx(2 * one.activations)
    ema = memory.need("sd1", memory.Setup(use_ema=True)).static - one.static
    assert ema == pytest.approx(4 * (859.52e6 + 123.06e6) / memory.GIB)
    split = memory.need("sd1", memory.Setup(gpus_per_worker=2))
    assert split.second_card > 0 and split.total < one.total


def test_the_readme_table_is_the_one_in_code(capsys):
    readme = open(os.path.join(REPO_DIR, "docs", "MEMORY.md")).read()  # (the README links it)
    memory.main()  # (what `python -m dreambooth.planning.memory` prints: table() and flow_table(), each computed once)
    tables = capsys.readouterr().out.strip().split("\n\n")
    assert len(tables) == 2 and tables[0].startswith("| ") and tables[1].startswith("| model, px |")
    assert all(t in readme for t in tables)


def preflight_args(model, *words, gpu_memory):
    argv = ["--photos_dir", "/p", "--data_prefix", "/d", "--model_name", model, "--gpu_memory", str(gpu_memory)]
    return preflight.parse_args(argv), preflight.check_train_flags(["--train_batch_size", "2", *words])


def test_a_run_that_does_not_fit_the_stated_card_names_the_flags_that_make_it_fit():
    """The figures of the table against a stated card size (GPU_MEMORY): no GPU needed to plan for one."""
    with pytest.raises(errors.UserError) as err:
        preflight.check_gpus(*preflight_args("sd15", gpu_memory=16), 0)
    line = str(err.value)
    assert "full fine-tune of SD 1.x at 512 px, 2 + 2 images a step, needs about 18.6 GiB" in line
    assert "and 1 GiB more for CUDA, but a card of GPU_MEMORY=16 GiB has 16.0 GiB free" in line
    assert line.endswith("add --gradient_checkpointing --use_8bit_adam (about 9.7 GiB; README, Requirements)")
    preflight.check_gpus(*preflight_args("sd15", "--gradient_checkpointing", "--use_8bit_adam", gpu_memory=16), 0)
    preflight.check_gpus(*preflight_args("sd15", gpu_memory=24), 0)  # the default run on a 24 GB card
    # SDXL LoRA at 1024 px, one + one image: a 24 GB card wants gradient checkpointing
    with pytest.raises(errors.UserError, match=r"the LoRA of SDXL at 1024 px, 1 \+ 1 images.* add "
                                              r"--gradient_checkpointing \(about"):
        preflight.check_gpus(*preflight_args("sdxl", "--use_lora", "--train_batch_size", "1", gpu_memory=24), 0)
    # a lower resolution is the last thing tried (it changes the result most)
    words, _, fixed = memory.fixes("sdxl", memory.Setup(resolution=1024), 10)
    assert words == ["--use_lora", "--gradient_checkpointing", "--train_batch_size 1", "--resolution 768"]
    assert memory.fits(fixed, 10) and not memory.fits(memory.need("sdxl", memory.Setup(
        lora=True, gradient_checkpointing=True, batch=1, resolution=1024)), 10)
    # nothing fits: said so, with what is left to try
    with pytest.raises(errors.UserError, match=r"use a larger card, --gpus_per_worker 2, or a lower --resolution"):
        preflight.check_gpus(*preflight_args("sdxl", gpu_memory=4), 0)


def test_the_flow_short_names_are_planned_with_their_own_size_before_they_are_fetched():
    """sd35-medium, not cached, is counted as SD 3.5 medium (its own size's parameters and activations), not as
    the family's released large model: its full fine-tune fits a 40 GiB card where large's does not; flux-dev's
    full fine-tune is refused on an 80 GiB card with the flags that make it fit (LoRA)."""
    full = ("--gradient_checkpointing", "--use_8bit_adam", "--no-train_text_encoder", "--train_batch_size", "1")
    preflight.check_gpus(*preflight_args("sd35-medium", *full, gpu_memory=40), 0)
    with pytest.raises(errors.UserError, match=r"the full fine-tune of SD 3.5 at 1024 px, 1 \+ 1 images a step"):
        preflight.check_gpus(*preflight_args("sd35-large", *full, gpu_memory=40), 0)
    medium, large = (preflight.model_family(preflight_args(name, gpu_memory=24)[0]) for name in ("sd35-medium",
                                                                                                 "sd35-large"))
    assert medium[2] == "sd35-medium" and medium[1]["transformer"] < large[1]["transformer"] / 3
    with pytest.raises(errors.UserError, match=r"full fine-tune of Flux.1 at 1024 px.* add --use_lora"):
        preflight.check_gpus(*preflight_args("flux-dev", gpu_memory=80), 0)
    # qwen-image: counted as its own size (20 B), LoRA over an nf4 base fits a 24 GiB card, over bf16 it does not
    lora = ("--use_lora", "--gradient_checkpointing", "--train_batch_size", "1")
    preflight.check_gpus(*preflight_args("qwen-image", *lora, "--base_precision", "nf4", gpu_memory=24), 0)
    with pytest.raises(errors.UserError, match=r"Qwen-Image at 1024 px"):
        preflight.check_gpus(*preflight_args("qwen-image", *lora, gpu_memory=24), 0)


def test_a_cached_model_is_measured_by_its_own_weights(tiny_model, capsys):
    """A cached folder's parameter counts come from its safetensors headers (the tiny model fits anywhere);
    a hub name the suite does not know, and not cached, is said to be unchecked."""
    counts = files.safetensors_params(tiny_model)
    assert set(counts) == {"unet", "vae", "text_encoder"} and 0 < counts["unet"] < 10e6
    args, words = preflight_args("sd15", gpu_memory=2)
    args.model_path = tiny_model
    preflight.check_gpus(args, words, 0)
    preflight.check_gpus(*preflight_args("someone/their-model", gpu_memory=2), 0)
    assert "GPU memory not checked: someone/their-model is not a known model name" in capsys.readouterr().err




def test_validation_samples_count_the_networks_only_drawing_reads(tiny_ideogram4_model):
    """Ideogram 4's --validation_prompt loads its unconditional transformer (the conditional one's 9.3 B) beside the
    trained one, in the base's precision, and the line of a run that does not fit says so; SD 1.x's samples draw with
    the trained networks alone."""
    lora = memory.Setup(lora=True, gradient_checkpointing=True, batch=1, train_text_encoder=False, resolution=1024)
    for base, per_param in ((None, 2), ("nf4", memory.BASE_BYTES["nf4"])):
        setup = memory.dataclasses.replace(lora, base_precision=base)
        alone, sampled = (memory.need("ideogram4", memory.dataclasses.replace(setup, validation=v)) for v in (0, 1))
        assert sampled.static - alone.static == pytest.approx(9279.29e6 * per_param / memory.GIB)
        assert sampled.activations == alone.activations
    assert memory.need("sd1", memory.Setup(validation=True)) == memory.need("sd1", memory.Setup())
    args, words = preflight_args("sd15", "--validation_prompt", "a toy", gpu_memory=0.5)
    assert preflight.memory_setup(words, args, "sd1").validation
    args.model_path = tiny_ideogram4_model
    with pytest.raises(errors.UserError, match=r"Ideogram 4 at 64 px, 2 \+ 2 images a step, its validation samples' "
                                               r"unconditional transformer too, needs about"):
        preflight.check_gpus(args, words, 0)

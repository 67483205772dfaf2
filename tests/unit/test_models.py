"""models/networks.py and random_models.py: the training set-up and the random SD factory, each option on CPU."""


import pytest
import torch

from dreambooth import errors
from dreambooth.models import networks
from dreambooth.models import random_models
from dreambooth.training import steps

CPU = torch.device("cpu")


def test_trained_networks_are_in_train_mode_and_the_vae_is_frozen(tiny_model):
    nets = networks.load_models(tiny_model, CPU, CPU, train_text_encoder=True)
    assert nets.denoiser.training and nets.text_encoder.training
    assert not nets.vae.training and not any(p.requires_grad for p in nets.vae.parameters())
    frozen = networks.load_models(tiny_model, CPU, CPU, train_text_encoder=False)
    assert not frozen.text_encoder.training and not any(p.requires_grad for p in frozen.text_encoder.parameters())


def test_gradient_checkpointing_recomputes_text_encoder_activations(make_plan, step_prompts):
    """transformers checkpoints only in train mode: each layer must run again in backward."""
    nets = networks.setup_models(make_plan(gradient_checkpointing=True), CPU, CPU, distributed=False)
    calls = []
    inner = nets.text_encoder.get_submodule("encoder.layers.0.self_attn")  # early in the checkpointed forward
    inner.register_forward_hook(lambda *a: calls.append(1))
    nets.text_encoder(step_prompts.instance)[0].sum().backward()
    assert len(calls) == 2  # forward, then recomputed in backward
    assert nets.denoiser.is_gradient_checkpointing
    nets.text_encoder.eval()  # as from_pretrained returns it: transformers skips checkpointing
    calls.clear()
    nets.text_encoder(step_prompts.instance)[0].sum().backward()
    assert len(calls) == 1


def test_channels_last_applies_to_unet_and_vae(make_plan):
    nets = networks.setup_models(make_plan(channels_last=True), CPU, CPU, distributed=False)
    conv = nets.denoiser.conv_in.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert nets.vae.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.fixture()
def process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_skips_the_gradient_copy_and_buffer_broadcast(make_plan, process_group):
    nets = networks.setup_models(make_plan(), CPU, CPU, distributed=True)
    assert [type(m).__name__ for m in nets.ddp_wrapped()] == ["DistributedDataParallel"] * 2
    assert nets.denoiser.gradient_as_bucket_view
    assert not getattr(nets.denoiser, "forward_sync_buffers", getattr(nets.denoiser, "broadcast_buffers", True))
    assert networks.unwrap(nets.denoiser) is nets.denoiser.module


def test_compiled_unet_unwraps_and_trains(make_plan, step_prompts):
    plan = make_plan(torch_compile="eager", learning_rate=1e-4)  # dynamo capture; aot_eager runs in test_recovery
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    assert type(nets.denoiser).__name__ == "OptimizedModule"
    assert type(networks.unwrap(nets.denoiser)).__name__ == "UNet2DConditionModel"
    state = steps.make_train_state(nets, plan)
    res = 64
    batch = {"instance_pixels": torch.zeros(1, res, res, 3, dtype=torch.uint8)}
    loss = steps.train_step(state, [batch], step_prompts, 1.0, 1.0)[0]
    assert torch.isfinite(loss)
    # A backend torch does not know: one line naming those it does (a UserError: no restart of the workers)
    with pytest.raises(errors.UserError, match=r"^--torch_compile nope: not a backend of this torch \(.*inductor"):
        networks.setup_models(make_plan(torch_compile="nope"), CPU, CPU, distributed=False)


@pytest.mark.parametrize("size, unet_m, te_m, vae_m", [("sd15", 859.5, 123.1, 83.7)])
def test_sd15_architecture_has_sd_1x_parameter_counts(size, unet_m, te_m, vae_m):
    with torch.device("meta"):
        pipe = random_models.build_pipeline(size)

    def millions(m):
        return round(sum(p.numel() for p in m.parameters()) / 1e6, 1)

    assert (millions(pipe.unet), millions(pipe.text_encoder), millions(pipe.vae)) == (unet_m, te_m, vae_m)


def test_the_random_sdxl_has_sdxl_base_parameter_counts_and_conditioning():
    """--random_model sdxl (the GPU benchmark's model): SDXL base 1.0's exact parameter counts
    (UNet 2,567,463,684; CLIP ViT-L 123,060,480; OpenCLIP bigG 694,659,840; VAE 83,653,863) and its
    cross-attention width and pooled + size/crop embedding input; counted on the meta device."""
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(random_models.TINY_TOKENIZER_DIR, model_max_length=77)
    with torch.device("meta"):
        nets = random_models.build_networks("sdxl", "sdxl", tokenizer)
    counts = {name: sum(p.numel() for p in net.parameters()) for name, net in nets.items()}
    assert counts == {"unet": 2_567_463_684, "text_encoder": 123_060_480, "text_encoder_2": 694_659_840,
                      "vae": 83_653_863}
    config = nets["unet"].config
    assert (config.cross_attention_dim, config.projection_class_embeddings_input_dim, config.sample_size) == (
        2048, 2816, 128)


def test_tiny_safety_checker_flags_nothing_until_its_weights_say_so():
    import numpy as np

    pipe = random_models.build_pipeline("tiny", safety_checker=True)
    images = np.random.default_rng(0).random((2, 64, 64, 3)).astype(np.float32)
    inputs = pipe.feature_extractor([x for x in (images * 255).astype(np.uint8)], return_tensors="pt")
    _, flagged = pipe.safety_checker(inputs.pixel_values, images.copy())
    assert flagged == [False, False]
    with torch.no_grad():
        pipe.safety_checker.concept_embeds_weights.fill_(-1.0)
    _, flagged = pipe.safety_checker(inputs.pixel_values, images.copy())
    assert flagged == [True, True]


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_lora_trains_only_fp32_adapters_over_frozen_weights_in_the_autocast_dtype(make_plan, step_prompts, precision,
                                                                                  dtype):
    """bf16/fp16 on CPU take the branch a GPU run takes: frozen weights in the autocast dtype,
    fp32 adapters (fp16: with the GradScaler)."""
    plan = make_plan(use_lora=True, lora_rank=4, lora_alpha=8.0, mixed_precision=precision)
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    state = steps.make_train_state(nets, plan)
    named = {f"{part}.{k}": v for part in ("denoiser", "text_encoder") for k, v in
             getattr(nets, part).named_parameters()}
    trained = {k for k, v in named.items() if v.requires_grad}
    assert trained and all(".lora_A." in k or ".lora_B." in k for k in trained)
    assert any(k.startswith("text_encoder.") for k in trained)
    assert sum(p.numel() for p in state.params) == sum(named[k].numel() for k in trained)
    assert all(named[k].dtype == torch.float32 for k in trained)
    assert nets.denoiser.conv_in.weight.dtype == nets.vae.encoder.conv_in.weight.dtype == dtype
    assert state.scaler.is_enabled() == (dtype == torch.float16)
    before = {k: v.detach().clone() for k, v in named.items()}
    batch = {"instance_pixels": torch.randint(0, 256, (1, 64, 64, 3), dtype=torch.uint8)}
    for _ in range(2):  # lora_B starts at zero: lora_A moves from the second step on
        loss = steps.train_step(state, [batch], step_prompts, 1.0, 1.0)[0]
    assert torch.isfinite(loss)
    changed = {k for k, v in named.items() if not torch.equal(v, before[k])}
    assert changed == trained


def test_lora_rank_and_alpha_shape_the_adapters(make_plan):
    nets = networks.setup_models(make_plan(use_lora=True, lora_rank=2, lora_alpha=6.0, train_text_encoder=False),
                                 CPU, CPU, distributed=False)
    to_q = nets.denoiser.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    assert to_q.lora_A["default"].weight.shape[0] == 2 and to_q.scaling["default"] == 3.0
    assert not networks.has_lora(nets.text_encoder)
    assert not any(p.requires_grad for p in nets.text_encoder.parameters())


def test_lora_frozen_weights_reach_their_device_already_in_the_autocast_dtype(make_plan, monkeypatch):
    """setup_models casts a LoRA run's frozen weights to the autocast dtype in host memory and only then moves the
    networks: a 12 B transformer never lands on a GPU in fp32 (48 GB before its cast). The move is watched here
    with the meta device standing in for the GPU."""
    meta = torch.device("meta")
    moved = []
    to = torch.nn.Module.to

    def watched(module, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == "meta" and hasattr(module, "config"):  # (a network, not an adapter)
            moved.append({p.dtype for n, p in module.named_parameters() if "lora_" not in n})
        return to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", watched)
    plan = make_plan(use_lora=True, mixed_precision="bf16")
    nets = networks.setup_models(plan, meta, meta, distributed=False)
    assert moved and all(dtypes == {torch.bfloat16} for dtypes in moved)
    assert all(p.is_meta for p in nets.denoiser.parameters())

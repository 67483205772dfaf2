"""The training math and step functions (steps.py) on the tiny model, without Ray."""

import copy

import pytest
import torch

from dreambooth import machine
from dreambooth.generation import imaging
from dreambooth.models import networks
from dreambooth.training import conditioning
from dreambooth.training import steps

CPU = torch.device("cpu")


@pytest.fixture()
def models(tiny_model):
    return networks.load_models(tiny_model, CPU, CPU, train_text_encoder=True)


def batch_for(models, size=2, with_class=True, seed=0, res=None):
    """uint8 (B, R, R, 3) pixels, as the data stream delivers them (R: the model's size unless given)."""
    g = torch.Generator().manual_seed(seed)
    res = res or models.denoiser.config.sample_size * 2
    batch = {"instance_pixels": torch.randint(0, 256, (size, res, res, 3), generator=g, dtype=torch.uint8)}
    if with_class:
        batch["class_pixels"] = torch.randint(0, 256, (size, res, res, 3), generator=g, dtype=torch.uint8)
    return batch


def step(state, batches, step_prompts):
    return steps.train_step(state, batches, step_prompts, prior_loss_weight=1.0, max_grad_norm=1.0)


def test_dreambooth_loss_weights_the_prior_half():
    pred = torch.zeros(4, 1, 2, 2)
    target = torch.cat([torch.ones(2, 1, 2, 2), torch.full((2, 1, 2, 2), 2.0)])
    total, instance, prior = steps.dreambooth_loss(pred, target, 2, prior_loss_weight=0.5)
    assert instance.item() == 1.0 and prior.item() == 4.0 and total.item() == 3.0
    total, instance, prior = steps.dreambooth_loss(pred[:2], target[:2], 2, prior_loss_weight=0.5)
    assert prior is None and total.item() == instance.item() == 1.0


def test_to_model_input_scales_uint8_to_minus_one_one_channels_first_and_channels_last():
    pixels = torch.tensor([[[[0, 255, 127]]]], dtype=torch.uint8).expand(2, 4, 5, 3).contiguous()
    out = imaging.to_model_input(pixels)
    assert out.shape == (2, 3, 4, 5) and out.dtype == torch.float32
    assert out[0, 0].eq(-1).all() and out[0, 1].eq(1).all() and abs(out[0, 2, 0, 0] + 1 / 255) < 1e-6
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_encode_latents_uses_the_vae_scaling_factor(models):
    vae = models.vae
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    torch.manual_seed(0)
    a = steps.encode_latents(models.family, vae, pixels)
    vae.register_to_config(scaling_factor=2 * vae.config.scaling_factor)
    torch.manual_seed(0)
    b = steps.encode_latents(models.family, vae, pixels)
    assert a.shape == (1, 4, 32, 32)
    torch.testing.assert_close(b, 2 * a)


def test_dreambooth_loss_weights_each_row():
    pred = torch.zeros(4, 1, 2, 2)
    target = torch.cat([torch.ones(2, 1, 2, 2), torch.full((2, 1, 2, 2), 2.0)])
    plain = steps.dreambooth_loss(pred, target, 2, 0.5)
    ones = steps.dreambooth_loss(pred, target, 2, 0.5, weights=torch.ones(4))
    assert all(torch.isclose(a, b) for a, b in zip(plain, ones))
    total, instance, prior = steps.dreambooth_loss(pred, target, 2, 0.5, weights=torch.tensor([1.0, 0.0, 0.5, 0.5]))
    assert instance.item() == 0.5 and prior.item() == 2.0 and total.item() == 1.5


@pytest.mark.parametrize("name, expected", [
    # factor of the learning rate after each of 6 steps; warm-up 2, 6 steps in all
    ("constant_with_warmup", [0.5, 1, 1, 1, 1, 1]),
    ("constant", [1, 1, 1, 1, 1, 1]),
    ("linear", [0.5, 1, 0.75, 0.5, 0.25, 0]),
    ("cosine", [0.5, 1, 0.8536, 0.5, 0.1464, 0]),
])
def test_lr_schedules_follow_diffusers_over_the_plans_steps(models, make_plan, name, expected):
    state = steps.make_train_state(models, make_plan(lr_scheduler=name, lr_warmup_steps=2, total_steps=6,
                                                     learning_rate=1.0))
    factors = []
    for _ in range(6):
        state.optimizer.step()
        state.lr_scheduler.step()
        factors.append(state.lr_scheduler.get_last_lr()[0])
    assert factors == pytest.approx(expected, abs=1e-4)


def test_train_step_learns_a_fixed_batch_and_changes_only_trainable_weights(models, step_prompts, make_plan):
    vae_before = copy.deepcopy(models.vae.state_dict())
    unet_before = copy.deepcopy(models.denoiser.state_dict())
    state = steps.make_train_state(models, make_plan())
    batch = batch_for(models)
    torch.manual_seed(0)
    first = step(state, [batch], step_prompts)[0]
    assert isinstance(first, torch.Tensor) and not first.requires_grad  # no .item() sync inside the step
    for _ in range(6):
        torch.manual_seed(0)  # same noise and timesteps: the loss must fall
        last = step(state, [batch], step_prompts)[0]
    assert last.item() < first.item() * 0.9, (first.item(), last.item())
    assert all(torch.equal(v, models.vae.state_dict()[k]) for k, v in vae_before.items())
    assert any(not torch.equal(v, models.denoiser.state_dict()[k]) for k, v in unet_before.items())


def test_frozen_text_encoder_stays_put(tiny_model, step_prompts, make_plan):
    models = networks.load_models(tiny_model, CPU, CPU, train_text_encoder=False)
    before = copy.deepcopy(models.text_encoder.state_dict())
    state = steps.make_train_state(models, make_plan(train_text_encoder=False))
    step(state, [batch_for(models, with_class=False)], step_prompts)
    assert all(torch.equal(v, models.text_encoder.state_dict()[k]) for k, v in before.items())


def test_bf16_autocast_keeps_fp32_master_weights(models, step_prompts, make_plan):
    state = steps.make_train_state(models, make_plan(mixed_precision="bf16"))
    assert state.amp_dtype == torch.bfloat16 and not state.scaler.is_enabled()
    loss = step(state, [batch_for(models, size=1)], step_prompts)[0]
    assert torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in state.params)


def test_fp16_scales_the_loss_and_a_skipped_step_leaves_weights_and_lr_schedule(models, step_prompts, make_plan):
    """(At 16 px: PyTorch's fp16 convolution backward is slow on a CPU.)"""
    state = steps.make_train_state(models, make_plan(mixed_precision="fp16", lr_warmup_steps=10))
    assert state.amp_dtype == torch.float16 and state.scaler.is_enabled()
    loss = step(state, [batch_for(models, size=1, res=16)], step_prompts)[0]
    assert torch.isfinite(loss) and state.lr_scheduler.last_epoch == 1 and state.skipped_steps == 0
    weights = copy.deepcopy(models.denoiser.state_dict())
    scale, lr = state.scaler.get_scale(), state.lr_scheduler.get_last_lr()[0]
    # A loss scale far past fp32's range: every gradient overflows, so the scaler skips.
    state.scaler.update(new_scale=torch.tensor(2.0 ** 127 * 1.9))
    step(state, [batch_for(models, size=1, seed=1, res=16)], step_prompts)
    assert state.skipped_steps == 1
    assert all(torch.equal(v, models.denoiser.state_dict()[k]) for k, v in weights.items())
    assert state.lr_scheduler.last_epoch == 1 and state.lr_scheduler.get_last_lr()[0] == lr
    assert state.scaler.get_scale() < 2.0 ** 127 and scale > 1


def test_default_precision_is_fp32_on_cpu():
    assert machine.amp_dtype(None, CPU) is None
    assert machine.amp_dtype("bf16", CPU) == torch.bfloat16 and machine.amp_dtype("no", CPU) is None


def test_cached_posteriors_draw_the_same_latents_as_encoding(models):
    batch = batch_for(models)
    with torch.no_grad():
        cached = {f"{k}_latents": models.vae.encode(imaging.to_model_input(batch[f"{k}_pixels"])).latent_dist.parameters
                  for k in ("instance", "class")}
    torch.manual_seed(1)
    from_pixels = steps.batch_latents(models, batch)
    torch.manual_seed(1)
    from_cache = steps.batch_latents(models, cached)
    assert from_pixels.shape == (4, 4, 32, 32)
    torch.testing.assert_close(from_cache, from_pixels, rtol=1e-4, atol=1e-5)


def test_gradient_accumulation_takes_one_optimizer_step_per_group(models, step_prompts, make_plan):
    # one worker: groups of per_step batches, at most end - start of them, the batches of earlier steps skipped
    assert [[b for _, b in g] for g in steps.step_batches("abcdefg", 0, 1, 3, 0, 10)] == [list("abc"), list("def")]
    assert [[b for _, b in g] for g in steps.step_batches("abcdefg", 0, 1, 2, 1, 2)] == [list("cd")]
    assert list(steps.step_batches("abcdefg", 0, 1, 2, 0, 0)) == []
    # any number of workers up to per_step: step s trains blocks [s x per_step, (s + 1) x per_step), every one of them
    # once, from the worker that the streaming split hands it (its k-th batch is block k x world + rank)
    for world in (1, 2, 3, 4):
        for start in (0, 2):
            taken = {}
            for rank in range(world):
                stream = [k * world + rank for k in range(40)]
                for number, group in enumerate(steps.step_batches(stream, rank, world, 4, start, 5), start):
                    assert group and all(block == batch for block, batch in group)
                    taken.setdefault(number, []).extend(block for block, _ in group)
            assert {s: sorted(b) for s, b in taken.items()} == {s: list(range(4 * s, 4 * s + 4)) for s in range(start, 5)}
    assert steps.block_seed(4, 7) == steps.block_seed(4, 7) != steps.block_seed(4, 8) != steps.block_seed(5, 8)
    state = steps.make_train_state(models, make_plan())
    before = copy.deepcopy(models.denoiser.state_dict())
    loss, instance, prior = step(state, [batch_for(models, 1), batch_for(models, 1, seed=1)], step_prompts)
    assert state.lr_scheduler.last_epoch == 1
    assert state.optimizer.state_dict()["state"][0]["step"].item() == 1
    assert loss.item() == pytest.approx(instance.item() + prior.item(), rel=1e-5)
    assert any(not torch.equal(v, models.denoiser.state_dict()[k]) for k, v in before.items())


def test_ema_follows_then_averages_with_the_warm_up_decay():
    w = torch.nn.Parameter(torch.zeros(3))
    ema = steps.EMA([w], decay=0.9, update_after_step=2)
    assert [ema.decay_at(s) for s in (1, 2, 3, 4, 100)] == [0.0, 0.0, 2 / 11, 3 / 12, 0.9]
    # steps 1-2 follow the weights; then decays 2/11, 3/12, 4/13 (worked by hand)
    expected = [1.0, 2.0, 31 / 11, 163 / 44, 658 / 143]
    for step_number, value in enumerate([1.0, 2.0, 3.0, 4.0, 5.0], start=1):
        w.data.fill_(value)
        ema.update([w], step_number)
        assert ema.shadow[0].tolist() == pytest.approx([expected[step_number - 1]] * 3)


def test_ema_with_decay_0_is_the_weights_exactly_and_applied_swaps_back_exactly():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 5, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    ema = steps.EMA(params, decay=0.0)
    for _ in range(3):
        with torch.no_grad():
            for p in params:
                p.mul_(1.37).add_(0.11)  # values whose lerp would round if it were computed as a + w(b - a)
        ema.update(params, 5)
        assert all(torch.equal(s, p) for s, p in zip(ema.shadow, params))
    trained = [p.detach().clone() for p in params]
    ema = steps.EMA(params, decay=0.5)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    ema.update(params, 50)
    average = [s.clone() for s in ema.shadow]
    with ema.applied(params):
        assert all(torch.equal(p, a) for p, a in zip(params, average))
    assert all(torch.equal(p, t + 1.0) for p, t in zip(params, trained))
    assert all(torch.equal(s, a) for s, a in zip(ema.shadow, average))
    copy_ = steps.EMA(params, decay=0.5)
    steps.load_average(copy_.shadow, ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(copy_.shadow, ema.shadow))
    with pytest.raises(ValueError, match="holds 1 tensors"):
        steps.load_average(copy_.shadow, {"0": average[0]})


def test_a_run_with_ema_decay_0_ends_on_the_weights_of_a_run_without(tiny_model, step_prompts, make_plan):
    """train_step with --use_ema --ema_decay 0: the averaged weights are exactly those of the same
    seeded run without EMA; with a decay, the average lags the weights."""
    runs = {}
    for name, plan in {"plain": make_plan(), "ema0": make_plan(use_ema=True, ema_decay=0.0),
                       "ema": make_plan(use_ema=True, ema_decay=0.9), "lora": make_plan(use_lora=True),
                       "lora_ema0": make_plan(use_lora=True, use_ema=True, ema_decay=0.0)}.items():
        nets = networks.setup_models(plan, CPU, CPU, distributed=False)
        state = steps.make_train_state(nets, plan)
        torch.manual_seed(3)
        for k in range(3):
            step(state, [batch_for(nets, size=1, seed=k)], step_prompts)
            state.step += 1
        runs[name] = state
    plain, ema0, ema = runs["plain"], runs["ema0"], runs["ema"]
    with ema0.ema.applied(ema0.params):
        assert all(torch.equal(a, b) for a, b in zip(ema0.params, plain.params))
    assert all(torch.equal(a, b) for a, b in zip(ema.params, plain.params))  # the average never trains
    assert any(not torch.equal(a, b) for a, b in zip(ema.ema.shadow, ema.params))
    # LoRA: the average is of the adapters alone, and decay 0 again gives the plain run's adapters
    lora, lora_ema0 = runs["lora"], runs["lora_ema0"]
    trained = [n for m in (lora_ema0.models.denoiser, lora_ema0.models.text_encoder) for n, p in m.named_parameters()
               if p.requires_grad]
    assert len(lora_ema0.ema.shadow) == len(trained) and all("lora_" in n for n in trained)
    with lora_ema0.ema.applied(lora_ema0.params):
        assert all(torch.equal(a, b) for a, b in zip(lora_ema0.params, lora.params))


@pytest.mark.parametrize("use_lora", [False, True])
def test_prior_prediction_targets_the_base_models_own_prediction(tiny_model, step_prompts, make_plan, use_lora):
    """--prior_preservation prior_prediction: the photos again under the class prompt, towards the base
    model's prediction. At the start the trained model is the base, so the prior loss is 0 (to rounding:
    the trained UNet runs 4 rows, the base 2);
    after training it is not, and the target is still exactly what a freshly loaded base UNet predicts
    (full: the frozen copy; LoRA: the adapters switched off)."""
    plan = make_plan(prior_prediction=True, use_lora=use_lora)
    nets = networks.setup_models(plan, CPU, CPU, distributed=False)
    assert (nets.frozen_denoiser is None) == use_lora
    state = steps.make_train_state(nets, plan)
    prompts = conditioning.with_base_class(step_prompts, nets.family, nets.text_encoders(),
                                           {"class": step_prompts.class_prompt[0].tolist()}, CPU)
    batch = batch_for(nets, size=2, with_class=False)
    torch.manual_seed(0)
    total, instance, prior = steps.batch_loss(nets, batch, prompts, 1.0)
    assert prior.item() < 1e-9 * instance.item() and instance.item() > 0.1
    for k in range(3):
        step(state, [batch_for(nets, size=1, with_class=False, seed=k)], prompts)
    torch.manual_seed(0)
    assert steps.batch_loss(nets, batch, prompts, 1.0)[2].item() > 0

    from diffusers import UNet2DConditionModel

    base = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    g = torch.Generator().manual_seed(1)
    noisy = torch.randn(2, 4, 32, 32, generator=g)
    t = torch.tensor([10, 900])
    cond = prompts.class_base.expand(2, -1, -1)
    with torch.no_grad():
        expected = base(noisy, t, cond).sample
        with nets.base_denoiser() as unet:
            assert torch.equal(unet(noisy, t, cond).sample, expected)
        assert not torch.equal(nets.denoiser(noisy, t, cond).sample, expected)  # the trained one moved on


def test_masked_loss_counts_only_the_masked_latent_pixels():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(3, 4, 2, 2, generator=g)
    pred = target.clone()
    pred[0, :, 1, :] += 2.0  # row 0 wrong only in its bottom half
    pred[1, :, 0, :] += 1.0  # row 1 wrong only in its top half
    pred[2] += 3.0  # a class row, wrong everywhere
    top = torch.tensor([[1.0, 1.0], [0.0, 0.0]]).expand(2, 1, 2, 2)  # both photos: only the top counts
    total, instance, prior = steps.dreambooth_loss(pred, target, 2, 0.5, masks=top)
    assert instance.item() == pytest.approx((0.0 + 1.0) / 2)  # row 0's error is masked out
    assert prior.item() == pytest.approx(9.0)  # class rows are never masked
    ones = steps.dreambooth_loss(pred, target, 2, 0.5, masks=torch.ones(2, 1, 2, 2))
    plain = steps.dreambooth_loss(pred, target, 2, 0.5)
    assert all(a.item() == pytest.approx(b.item()) for a, b in zip(ones, plain))
    # with min-SNR weights too; an all-black mask counts nothing instead of dividing by zero
    _, instance, _ = steps.dreambooth_loss(pred, target, 2, 0.5, weights=torch.tensor([1.0, 0.5, 1.0]),
                                           masks=torch.stack([top[0], torch.zeros(1, 2, 2)]))
    assert instance.item() == pytest.approx(0.0)
    # image-pixel masks become latent weights by area: each latent pixel the share it covers
    mask = torch.zeros(1, 4, 4, dtype=torch.uint8)
    mask[0, :2, :] = 255
    mask[0, 2:, :2] = torch.tensor([[255, 0], [0, 255]], dtype=torch.uint8)
    assert steps.latent_masks(mask, (2, 2), CPU)[0, 0].tolist() == [[1.0, 1.0], [0.5, 0.0]]

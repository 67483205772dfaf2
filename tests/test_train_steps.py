"""The training math and step functions on the tiny model, without Ray."""

import copy

import pytest
import torch

import train

CONFIG = {"learning_rate": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_weight_decay": 0.0,
          "adam_epsilon": 1e-8, "lr_warmup_steps": 0, "mixed_precision": "no", "train_text_encoder": True,
          "prior_loss_weight": 1.0, "max_grad_norm": 1.0}


@pytest.fixture()
def models(tiny_model):
    return train.load_models(tiny_model, torch.device("cpu"), train_text_encoder=True)


def batch_for(models, size=2, with_class=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    res = models["unet"].config.sample_size * 2
    batch = {"instance_pixels": torch.rand(size, 3, res, res, generator=g) * 2 - 1}
    if with_class:
        batch["class_pixels"] = torch.rand(size, 3, res, res, generator=g) * 2 - 1
    return batch


@pytest.fixture()
def prompt_ids(tiny_model):
    """(1, L) token ids of an instance and a class prompt, as train_fn builds them."""
    from transformers import CLIPTokenizer

    import dataset

    tokenizer = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    return {k: torch.from_numpy(dataset.tokenize_prompt(tokenizer, p)).unsqueeze(0)
            for k, p in (("instance", "photo of unqtkn toy"), ("class", "photo of a toy"))}


def test_diffusion_target_follows_prediction_type(models):
    scheduler = models["scheduler"]
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    assert torch.equal(train.diffusion_target(scheduler, latents, noise, t), noise)
    from diffusers import DDPMScheduler

    v_sched = DDPMScheduler.from_config(scheduler.config, prediction_type="v_prediction")
    alpha_bar = v_sched.alphas_cumprod[t].view(-1, 1, 1, 1)
    expected = alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * latents
    torch.testing.assert_close(train.diffusion_target(v_sched, latents, noise, t), expected)
    with pytest.raises(ValueError):
        train.diffusion_target(DDPMScheduler.from_config(scheduler.config, prediction_type="sample"),
                               latents, noise, t)


def test_dreambooth_loss_weights_the_prior_half():
    pred = torch.zeros(4, 1, 2, 2)
    target = torch.cat([torch.ones(2, 1, 2, 2), torch.full((2, 1, 2, 2), 2.0)])
    total, instance, prior = train.dreambooth_loss(pred, target, 2, prior_loss_weight=0.5)
    assert instance.item() == 1.0 and prior.item() == 4.0 and total.item() == 3.0
    total, instance, prior = train.dreambooth_loss(pred[:2], target[:2], 2, prior_loss_weight=0.5)
    assert prior is None and total.item() == instance.item() == 1.0


def test_encode_latents_uses_the_vae_scaling_factor(models):
    vae = models["vae"]
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    torch.manual_seed(0)
    a = train.encode_latents(vae, pixels)
    vae.register_to_config(scaling_factor=2 * vae.config.scaling_factor)
    torch.manual_seed(0)
    b = train.encode_latents(vae, pixels)
    assert a.shape == (1, 4, 32, 32)
    torch.testing.assert_close(b, 2 * a)


def test_lr_warmup_then_constant():
    assert [train.lr_factor(s, 3) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert train.lr_factor(0, 0) == 1.0


def test_train_step_learns_a_fixed_batch_and_changes_only_trainable_weights(models, prompt_ids):
    vae_before = copy.deepcopy(models["vae"].state_dict())
    unet_before = copy.deepcopy(models["unet"].state_dict())
    state = train.make_train_state(models, CONFIG, torch.device("cpu"))
    batch = batch_for(models)
    torch.manual_seed(0)
    first = train.train_step(state, [batch], prompt_ids, CONFIG)[0]
    for _ in range(15):
        torch.manual_seed(0)  # same noise and timesteps: the loss must fall
        last = train.train_step(state, [batch], prompt_ids, CONFIG)[0]
    assert last < first * 0.9
    assert all(torch.equal(v, models["vae"].state_dict()[k]) for k, v in vae_before.items())
    assert any(not torch.equal(v, models["unet"].state_dict()[k]) for k, v in unet_before.items())


def test_frozen_text_encoder_stays_put(tiny_model, prompt_ids):
    models = train.load_models(tiny_model, torch.device("cpu"), train_text_encoder=False)
    before = copy.deepcopy(models["text_encoder"].state_dict())
    config = dict(CONFIG, train_text_encoder=False)
    state = train.make_train_state(models, config, torch.device("cpu"))
    train.train_step(state, [batch_for(models, with_class=False)], prompt_ids, config)
    assert all(torch.equal(v, models["text_encoder"].state_dict()[k]) for k, v in before.items())


def test_bf16_autocast_keeps_fp32_master_weights(models, prompt_ids):
    config = dict(CONFIG, mixed_precision="bf16")
    state = train.make_train_state(models, config, torch.device("cpu"))
    loss = train.train_step(state, [batch_for(models, size=1)], prompt_ids, config)[0]
    assert loss == loss  # not NaN
    assert all(p.dtype == torch.float32 for p in state["params"])


def test_checkpoint_round_trip_restores_weights_optimizer_and_position(models, tiny_model, prompt_ids, tmp_path):
    state = train.make_train_state(models, CONFIG, torch.device("cpu"))
    for _ in range(2):
        train.train_step(state, [batch_for(models)], prompt_ids, CONFIG)
    state["step"] = 2
    train.save_checkpoint(state, str(tmp_path), epoch=1)
    rng_after_save = torch.rand(3)

    fresh = train.make_train_state(train.load_models(tiny_model, torch.device("cpu"), True), CONFIG,
                                   torch.device("cpu"))
    assert train.load_checkpoint(fresh, str(tmp_path)) == 1
    assert fresh["step"] == 2
    assert fresh["lr_scheduler"].last_epoch == state["lr_scheduler"].last_epoch
    for k, v in models["unet"].state_dict().items():
        assert torch.equal(v, fresh["models"]["unet"].state_dict()[k])
    opt_a, opt_b = state["optimizer"].state_dict()["state"], fresh["optimizer"].state_dict()["state"]
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"]) for k in opt_a)
    assert torch.equal(torch.rand(3), rng_after_save)


def test_cached_posteriors_draw_the_same_latents_as_encoding(models):
    vae = models["vae"]
    batch = batch_for(models)
    with torch.no_grad():
        cached = {f"{k}_latents": vae.encode(batch[f"{k}_pixels"]).latent_dist.parameters
                  for k in ("instance", "class")}
    torch.manual_seed(1)
    from_pixels = train.batch_latents(vae, batch)
    torch.manual_seed(1)
    from_cache = train.batch_latents(vae, cached)
    assert from_pixels.shape == (4, 4, 32, 32)
    torch.testing.assert_close(from_cache, from_pixels, rtol=1e-4, atol=1e-5)


def test_precomputed_prompt_states_equal_running_the_text_encoder(models, prompt_ids):
    te = models["text_encoder"]
    with torch.no_grad():
        live = train.prompt_conditioning(te, prompt_ids, 2, 3)
        states = {k: te(v)[0] for k, v in prompt_ids.items()}
        cached = train.prompt_conditioning(te, states, 2, 3)
        alone = train.prompt_conditioning(te, states, 2, 0)
    assert live.shape == (5, 77, 32)
    torch.testing.assert_close(cached, live)
    torch.testing.assert_close(alone, live[:2])
    assert not torch.allclose(live[0], live[4])  # instance and class prompts differ


def test_gradient_accumulation_takes_one_optimizer_step_per_group(models, prompt_ids):
    assert list(train.accumulate(iter(range(7)), 3, 10)) == [[0, 1, 2], [3, 4, 5]]
    assert list(train.accumulate(iter(range(7)), 2, 1)) == [[0, 1]]
    state = train.make_train_state(models, CONFIG, torch.device("cpu"))
    before = copy.deepcopy(models["unet"].state_dict())
    loss, instance, prior = train.train_step(state, [batch_for(models, 1), batch_for(models, 1, seed=1)],
                                             prompt_ids, CONFIG)
    assert state["lr_scheduler"].last_epoch == 1
    assert state["optimizer"].state_dict()["state"][0]["step"].item() == 1
    assert loss == pytest.approx(instance + prior, rel=1e-5)
    assert any(not torch.equal(v, models["unet"].state_dict()[k]) for k, v in before.items())

"""objectives.py: what the denoiser learns, for denoising and flow-matching families."""

import math

import pytest
import torch

from dreambooth.families.shared import objectives
from dreambooth.models import networks

CPU = torch.device("cpu")


@pytest.fixture()
def models(tiny_model):
    return networks.load_models(tiny_model, CPU, CPU, train_text_encoder=True)


def test_diffusion_target_follows_prediction_type(models):
    scheduler = models.scheduler
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    assert torch.equal(objectives.diffusion_target(scheduler, latents, noise, t), noise)
    from diffusers import DDPMScheduler

    v_sched = DDPMScheduler.from_config(scheduler.config, prediction_type="v_prediction")
    alpha_bar = v_sched.alphas_cumprod[t].view(-1, 1, 1, 1)
    expected = alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * latents
    torch.testing.assert_close(objectives.diffusion_target(v_sched, latents, noise, t), expected)
    with pytest.raises(ValueError):
        objectives.diffusion_target(DDPMScheduler.from_config(scheduler.config, prediction_type="sample"),
                               latents, noise, t)


def test_min_snr_weights_cap_low_noise_steps(models):
    from diffusers import DDPMScheduler

    scheduler = models.scheduler
    timesteps = torch.tensor([0, 10, 500, 999])
    weights = objectives.min_snr_weights(scheduler, timesteps, gamma=5.0)
    snr = scheduler.alphas_cumprod[timesteps] / (1 - scheduler.alphas_cumprod[timesteps])
    assert snr[0] > 5 and weights[0] == pytest.approx(5 / snr[0].item())  # nearly clean: weighs less
    assert snr[3] < 5 and weights[3] == pytest.approx(1.0)  # noisy: full weight
    assert (weights[:-1] <= weights[1:]).all()
    v_sched = DDPMScheduler.from_config(scheduler.config, prediction_type="v_prediction")
    v_weights = objectives.min_snr_weights(v_sched, timesteps, gamma=5.0)
    assert v_weights[3] == pytest.approx((snr[3] / (snr[3] + 1)).item())


def test_offset_noise_adds_one_constant_per_row_and_channel():
    latents = torch.zeros(2, 4, 8, 8)
    torch.manual_seed(0)
    plain = objectives.training_noise(latents, 0.0)
    torch.manual_seed(0)
    offset = objectives.training_noise(latents, 0.1)
    shift = offset - plain
    assert shift.abs().sum() > 0
    assert torch.allclose(shift, shift[:, :, :1, :1].expand_as(shift), atol=1e-6)
    assert not torch.allclose(shift[0, 0], shift[0, 1])


def flow_scheduler(shift=3.0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift)


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "cosmap", "sigma_sqrt", "none"])
def test_flow_matching_noises_on_the_straight_path_towards_the_velocity(scheme):
    scheduler = flow_scheduler()
    latents = torch.randn(64, 4, 8, 8)
    torch.manual_seed(0)
    draw = objectives.flow_matching(scheduler, latents, objectives.LossOptions(weighting_scheme=scheme))
    noise = draw.target + latents  # the target is noise - latents
    sigmas = (draw.timesteps / scheduler.config.num_train_timesteps).view(-1, 1, 1, 1)  # the scheduler's sigmas
    torch.testing.assert_close(draw.noisy, (1 - sigmas) * latents + sigmas * noise, rtol=1e-5, atol=1e-5)
    assert ((sigmas > 0) & (sigmas <= 1)).all()
    if scheme == "cosmap":
        torch.testing.assert_close(draw.weights, 2 / (math.pi * (1 - 2 * sigmas.flatten() + 2 * sigmas.flatten() ** 2)))
    elif scheme == "sigma_sqrt":
        torch.testing.assert_close(draw.weights, sigmas.flatten() ** -2.0)
    else:
        assert draw.weights is None  # the draw itself is the weighting


@pytest.mark.parametrize("scheme", ["none", "cosmap"])
def test_preconditioned_outputs_measure_the_error_of_the_implied_clean_latents(scheme):
    """--precondition_outputs 1 (diffusers' SD 3 scripts): the loss is that of noisy - sigma x prediction against
    the latents, which is sigma^2 x the velocity error per row (with the scheme's own weights on top)."""
    from dreambooth.training import steps

    scheduler = flow_scheduler()
    latents, pred = torch.randn(8, 4, 8, 8), torch.randn(8, 4, 8, 8)
    torch.manual_seed(0)
    draw = objectives.flow_matching(scheduler, latents, objectives.LossOptions(weighting_scheme=scheme,
                                                                              precondition_outputs=True))
    torch.manual_seed(0)
    plain = objectives.flow_matching(scheduler, latents, objectives.LossOptions(weighting_scheme=scheme))
    sigmas = (draw.timesteps / scheduler.config.num_train_timesteps).view(-1, 1, 1, 1)
    clean = ((draw.noisy - sigmas * pred - latents) ** 2).mean(dim=(1, 2, 3))
    scheme_weights = plain.weights if plain.weights is not None else torch.ones(8)
    expected = (clean * scheme_weights).mean()
    loss, _, _ = steps.dreambooth_loss(pred, draw.target, 8, 1.0, draw.weights)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)


def test_logit_normal_draws_the_middle_of_the_schedule_and_the_seed_decides():
    scheduler = flow_scheduler(shift=1.0)  # unshifted: sigma is the drawn u
    latents = torch.zeros(4000, 1, 1, 1)
    options = objectives.LossOptions(weighting_scheme="logit_normal", logit_std=0.5)
    torch.manual_seed(1)
    middle = objectives.flow_matching(scheduler, latents, options).timesteps / 1000
    uniform = objectives.flow_matching(scheduler, latents, objectives.LossOptions()).timesteps / 1000
    assert abs(middle.mean().item() - 0.5) < 0.02 and middle.std() < uniform.std() * 0.6
    torch.manual_seed(1)
    assert torch.equal(objectives.flow_matching(scheduler, latents, options).timesteps * 1, middle * 1000)
    shifted = objectives.flow_matching(flow_scheduler(3.0), latents, objectives.LossOptions()).timesteps / 1000
    assert shifted.mean() > uniform.mean() + 0.1  # the shift spends more steps at high noise


def test_each_objective_takes_its_own_loss_flags(tiny_model, tiny_sd3_model, make_plan):

    from dreambooth import errors
    from dreambooth import families
    from dreambooth.training import steps

    sd1, sd3 = families.family_of(tiny_model), families.family_of(tiny_sd3_model)
    objectives.check_flags(sd1, snr_gamma=5.0, precondition_outputs=None, weighting_scheme=None)
    objectives.check_flags(sd3, snr_gamma=None, precondition_outputs=1, weighting_scheme="cosmap")
    with pytest.raises(errors.UserError, match="--snr_gamma weighs the timesteps of a denoising model; SD 3.5"):
        objectives.check_flags(sd3, snr_gamma=5.0, precondition_outputs=None, weighting_scheme=None)
    with pytest.raises(errors.UserError, match="--weighting_scheme is for the flow-matching models"):
        objectives.check_flags(sd1, snr_gamma=None, precondition_outputs=None, weighting_scheme="mode")
    with pytest.raises(errors.UserError, match="--precondition_outputs is for the flow-matching models"):
        objectives.check_flags(sd1, snr_gamma=None, precondition_outputs=0, weighting_scheme=None)
    # no --precondition_outputs: the family's (diffusers' SD 3 scripts: 1)
    assert steps.loss_options(make_plan(model_dir=tiny_sd3_model)).precondition_outputs is True
    assert steps.loss_options(make_plan(model_dir=tiny_sd3_model, precondition_outputs=0)).precondition_outputs is False
    # no --weighting_scheme: the family's default (diffusers' SD 3 scripts: logit_normal)
    assert steps.loss_options(make_plan(model_dir=tiny_sd3_model)).weighting_scheme == "logit_normal"
    assert steps.loss_options(make_plan(model_dir=tiny_sd3_model, weighting_scheme="cosmap")).weighting_scheme == "cosmap"
    with pytest.raises(errors.UserError, match="--flow_shift shifts a flow-matching model's noise levels; SD 1.x"):
        objectives.check_flags(sd1, snr_gamma=None, precondition_outputs=None, weighting_scheme=None, flow_shift=3.0)
    assert steps.loss_options(make_plan(model_dir=tiny_sd3_model, flow_shift=2.5)).flow_shift == 2.5


def test_flow_shift_shifts_the_unshifted_schedule_as_the_scheduler_does():
    """--flow_shift S on the same draws: S = 3 is SD 3.5's scheduler (its shift of 3) exactly; on a scheduler
    that shifts only when it draws (Flux.1's, Qwen-Image's dynamic shifting), S = 1 is its own sigmas and S = 3
    moves every sigma up, to S x sigma / (1 + (S - 1) x sigma)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    latents = torch.randn(256, 4, 2, 2)

    def draw(scheduler, shift):
        torch.manual_seed(0)
        return objectives.flow_matching(scheduler, latents, objectives.LossOptions(flow_shift=shift))

    for a, b in ((draw(flow_scheduler(3.0), None), draw(flow_scheduler(3.0), 3.0)),
                 (draw(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), None),
                  draw(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), 1.0))):
        torch.testing.assert_close(b.timesteps.float(), a.timesteps.float())
        torch.testing.assert_close(b.noisy, a.noisy)
    plain, shifted = draw(flow_scheduler(1.0), None), draw(flow_scheduler(1.0), 3.0)
    sigma = plain.timesteps / 1000
    torch.testing.assert_close(shifted.timesteps / 1000, 3 * sigma / (1 + 2 * sigma))
    assert (shifted.timesteps >= plain.timesteps).all() and (shifted.timesteps > plain.timesteps + 1).any()

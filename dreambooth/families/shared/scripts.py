"""What diffusers' DreamBooth scripts compute the same way for every family, written from their steps for the
families' contracts (each family folder's contract.py: the loss its script computes on a batch, which the tests hold
ours to). Not used by a run."""


def uniform_schedule_draw(scheduler, rows):
    """(timesteps, sigmas) of rows draws as the flow-matching scripts draw them with no weighting: a uniform index
    into the scheduler's training schedule (diffusers' compute_density_for_timestep_sampling with "none")."""
    import torch
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling("none", rows, 0.0, 1.0, 1.29)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    sigmas = torch.stack([scheduler.sigmas[(scheduler.timesteps == t).nonzero().item()] for t in timesteps])
    return timesteps, sigmas


def prior_preserving_mse(pred, target, prior_loss_weight):
    """The scripts' loss with prior preservation and no weighting: the instance half's mean squared error, plus
    prior_loss_weight x the class half's."""
    (pred, pred_prior), (target, target_prior) = pred.chunk(2), target.chunk(2)
    loss = ((pred.float() - target.float()) ** 2).reshape(1, -1).mean(1).mean()
    prior = ((pred_prior.float() - target_prior.float()) ** 2).reshape(1, -1).mean(1).mean()
    return loss + prior_loss_weight * prior

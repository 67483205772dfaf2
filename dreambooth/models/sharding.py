"""A denoiser sharded across the workers (--fsdp): PyTorch's FSDP2 (fully_shard) on each block and the
whole, so each worker holds 1/N of the weights, gradients and AdamW state; a block's weights are gathered
only while it runs. A full fine-tune of Flux.1's 12 B transformer needs about 190 GB in fp32 with AdamW:
no card holds it, eight 80 GB ones do together.

The same code runs on CPUs with the gloo backend (the tests' 2-worker runs) as on GPUs with NCCL. The
checkpoint and the saved model stay what they are without sharding (one whole safetensors file of the
denoiser, the optimizer's state): gather() assembles them on rank 0, restore() spreads them again. Every
function here is a collective but plain(): all ranks call it together.
"""


def is_sharded(model):
    """True for a network fully_shard was applied to."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(model):
    """model sharded in place: each element of its top-level ModuleLists (the transformer's blocks, a UNet's
    down/up blocks) its own unit, then the rest as one; weights stay fp32 (autocast computes in bf16)."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Qwen-Image's transformer returns a view: FSDP warns at every step that an in-place op on it would skip its
    # hook. The training step changes no denoiser output in place (steps.batch_loss, the families' denoise).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    # one mesh of every worker, on the device type the model is on: the same call on CPUs (gloo) and GPUs
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # whole tensors, in host memory, on rank 0 only (the others get empty dicts)
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather(denoiser, optimizer):
    """(the denoiser's whole weights, the optimizer's whole state keyed by parameter name) on rank 0."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = _options()
    return (get_model_state_dict(denoiser, options=options),
            get_optimizer_state_dict(denoiser, optimizer, options=options))


def gather_weights(denoiser):
    """The denoiser's whole weights on rank 0 ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(denoiser, options=_options())


def restore(denoiser, optimizer, weights, optimizer_state):
    """gather()'s weights and optimizer state (as every rank read them from the checkpoint) back into the
    sharded denoiser and its optimizer, each rank keeping its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(denoiser, weights, options=options)
    if optimizer_state is not None:
        set_optimizer_state_dict(denoiser, optimizer, optimizer_state, options=options)


def plain(family, model_dir, weights):
    """An unsharded denoiser of family holding weights (gather_weights' on rank 0), built from model_dir's
    config without reading its files' weights: what outputs.save_pipeline writes."""
    import torch

    with torch.device("meta"):
        denoiser = family.denoiser_of_config(model_dir)
    denoiser.load_state_dict(weights, assign=True)
    return denoiser

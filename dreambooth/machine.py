"""This machine: the torch device a process computes on and the memory it can still get."""





def available_memory():
    """Bytes of memory this machine can still give a process (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def torch_device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def amp_dtype(mixed_precision, device):
    """Autocast dtype of a --mixed_precision value on device (None: full fp32).

    The default picks bf16 where the GPU computes it natively (Ampere and later), fp16
    with loss scaling on older GPUs, and fp32 on CPU.
    """
    import torch

    if mixed_precision is None:
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[mixed_precision]

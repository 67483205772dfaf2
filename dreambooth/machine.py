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

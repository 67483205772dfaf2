"""What torch sees of the GPUs Ray counts, node by node: dreambooth_run.sh's preflight asks it before Step 1."""

import sys

from dreambooth import errors

GIB = 2 ** 30


def probe():
    """What torch sees on each node that Ray counts GPUs on: [{"node", "gpus" (Ray's count), "torch",
    "cuda", "warning", "cards": [(name, free GiB, total GiB)]}]. A node whose GPUs are all taken (a run
    in progress) is left out after 60 s."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def look():
        import warnings

        import torch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = torch.cuda.is_available()
        cards = []
        for index in range(torch.cuda.device_count() if available else 0):
            free, total = torch.cuda.mem_get_info(index)
            cards.append((torch.cuda.get_device_name(index), free / GIB, total / GIB))
        return {"torch": torch.__version__, "cuda": torch.version.cuda, "cards": cards,
                "warning": " ".join(str(w.message).split(".")[0] for w in caught if "CUDA" in str(w.message))}

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU")]
    pending = {ray.remote(look).options(
        num_gpus=n["Resources"]["GPU"], num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(): n for n in nodes}
    ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=60)
    for ref in late:
        ray.cancel(ref, force=True)
        print(f"note: the GPUs of node {pending[ref]['NodeManagerAddress']} are busy; their memory is not "
              "checked", file=sys.stderr)
    return [dict(ray.get(ref), node=pending[ref]["NodeManagerAddress"], gpus=int(pending[ref]["Resources"]["GPU"]))
            for ref in ready]


def check_drivers(reports):
    """Every GPU Ray counts is one torch can use: else one line (an NVIDIA driver older than torch's
    CUDA build leaves torch no GPU, and every step would quietly run on the CPU)."""
    for report in reports:
        if len(report["cards"]) >= report["gpus"]:
            continue
        counted = f"node {report['node']}: Ray counts {report['gpus']} GPU(s) but torch {report['torch']} sees " \
                  f"{len(report['cards'])}"
        if report["cuda"] is None:
            raise errors.UserError(f"{counted}: it is a CPU-only build; install torch's CUDA build "
                                   "(https://pytorch.org/get-started/locally/)")
        cause = report["warning"] or "torch.cuda.is_available() is False"
        raise errors.UserError(f"{counted} ({cause}): install an NVIDIA driver for CUDA {report['cuda']} or newer "
                               "(nvidia-smi shows the CUDA version the driver takes), or a torch build for your "
                               "driver (https://pytorch.org/get-started/locally/)")

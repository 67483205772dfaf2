"""Where the training step's time goes: the product's own step, one switch per arm, with a profile.

    python benchmarks/gpu_probe.py --model sd15                  # GPU: every arm, ~6 min on an H100
    python benchmarks/gpu_probe.py --model tiny --steps 2 ...    # the CPU dry run the test suite takes

Each arm builds the model (random weights, no download), runs `steps.train_step` in a plain loop
(no Ray: this measures the step, bench.py measures Ray's share), times --steps steps after
--warmup ones (CUDA events on a GPU, the wall clock on a CPU), then records --profile_steps more
under torch.profiler. Per arm it prints images/s, ms per step, peak memory, and from the profile:
the fraction of the wall time the GPU was busy (sum of kernel times / wall), kernels and
launches per step, and the device time by kind (conv/GEMM, attention, norms, element-wise,
copies and casts, optimizer, other). If throughput grows with the batch while the GPU-busy
fraction is low, the step is bound by the host (launches, casts, small kernels), not the chip.

Arms (--arms, comma-separated): base (batch 2+2, VAE each step, text encoder trained,
channels-last on a GPU, autocast in the device's mixed precision), batch4, batch8, no_channels_last,
channels_last, cudnn_benchmark, cached (latents and prompt embeddings computed once, frozen text
encoder), vae_bf16 (the frozen VAE's weights in the autocast dtype), compiled (torch.compile of the
denoiser, --compiled_backend; its compile time is in the warm-up, not the timing). An arm that fails prints its
error in its row and the others still run; each row is printed as its arm ends.
"""

import argparse
import collections
import dataclasses
import gc
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402

ARMS = {
    "base": {},
    "batch4": {"batch_size": 4},
    "batch8": {"batch_size": 8},
    "no_channels_last": {"channels_last": False},
    "channels_last": {"channels_last": True},
    "cudnn_benchmark": {"cudnn_benchmark": True},
    "cached": {"cached": True},
    "vae_bf16": {"vae_bf16": True},
    "compiled": {"compiled": True},
}
KINDS = (  # device-time kinds, by kernel (or, on a CPU, aten op) name; the first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("conv/GEMM", ("gemm", "conv", "cutlass", "sm80_", "sm90_", "cublas", "matmul", "addmm", "mm", "bmm", "linear")),
    ("norms", ("norm",)),
    ("optimizer", ("adam", "multi_tensor", "foreach", "clip")),
    ("copies/casts", ("copy", "cast", "to_copy", "contiguous", "transpose", "permute", "nchw", "nhwc")),
    ("element-wise", ("elementwise", "vectorized", "silu", "gelu", "add", "mul", "div", "sub", "neg", "exp",
                      "reduce", "sum", "mean", "fill", "where")),
)


@dataclasses.dataclass
class Arm:
    name: str
    batch_size: int = 2
    channels_last: bool | None = None  # None: train.py's rule (on for CUDA)
    cudnn_benchmark: bool = False
    cached: bool = False
    vae_bf16: bool = False
    compiled: bool = False  # with --compiled_backend (--torch_compile, when given, compiles every arm)


def kind_of(name):
    lowered = name.lower()
    for kind, words in KINDS:
        if any(word in lowered for word in words):
            return kind
    return "other"


def summarize(prof, wall_s, steps, on_gpu):
    """(GPU-busy fraction or None on CPU, kernels per step, launches per step, {kind: share of device time})."""
    events = prof.events()
    if on_gpu:
        kernels = [e for e in events if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"]
        times = [(e.name, e.device_time_total) for e in kernels]
        if not kernels:  # a torch that lists kernels only under their CPU ops: each op's own device time
            kernels = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
            times = [(e.name, e.self_device_time_total) for e in kernels]
        launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    else:  # aten ops stand for kernels, each with its own (self) time, so nothing counts twice
        kernels = [e for e in events if e.name.startswith("aten::")]
        times = [(e.name, e.self_cpu_time_total) for e in kernels]
        launches = len(kernels)
    total_us = sum(t for _, t in times) or 1.0
    by_kind = collections.Counter()
    for name, t in times:
        by_kind[kind_of(name)] += t
    busy = (total_us / 1e6) / wall_s if on_gpu else None
    return busy, len(kernels) / steps, launches / steps, {k: v / total_us for k, v in by_kind.most_common()}


def run_arm(arm, args, device):
    import torch

    from dreambooth import machine
    from dreambooth.models import networks
    from dreambooth.training import conditioning
    from dreambooth.training import steps

    torch.backends.cudnn.benchmark = arm.cudnn_benchmark
    channels_last = device.type == "cuda" if arm.channels_last is None else arm.channels_last
    args.batch_size = arm.batch_size
    plan = dataclasses.replace(
        bench.step_plan(args, train_text_encoder=not arm.cached, device=device,
                        precompute_text_embeddings=arm.cached),
        channels_last=channels_last, resolution=args.resolution,
        torch_compile=args.torch_compile or (args.compiled_backend if arm.compiled else None))
    bench.reset_peak_memory(device)
    nets = networks.setup_models(plan, device, device, distributed=False)
    if arm.vae_bf16 and plan.mixed_precision != "no":
        nets.vae.to(dtype=machine.amp_dtype(plan.mixed_precision, device))
    state = steps.make_train_state(nets, plan)
    prompts = conditioning.step_prompts(plan.family, nets.text_encoders(), plan, bench.PROMPT_IDS, device)
    batch = bench.synthetic_batch(nets, args, cached=arm.cached)

    def step():
        return steps.train_step(state, [batch], prompts, plan.prior_loss_weight, plan.max_grad_norm)[0]

    for _ in range(args.warmup):
        step()
    bench.sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        loss.item()
        seconds = time.perf_counter() - t0
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            loss = step()
        loss.item()
        bench.sync(device)
        profiled_wall = time.perf_counter() - t0
    busy, kernels, launches, kinds = summarize(prof, profiled_wall, args.profile_steps, device.type == "cuda")
    result = {"images_per_s": 2 * arm.batch_size * args.steps / seconds, "ms_per_step": 1000 * seconds / args.steps,
              "peak_gb": bench.peak_memory_gb(device), "busy": busy, "kernels": kernels, "launches": launches,
              "kinds": kinds, "channels_last": channels_last, "amp": plan.mixed_precision, "error": None}
    return result


def free_memory(device):
    """What an arm held (its models and optimizer state die with run_arm's frame) back to the device."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


HEADER = ["| arm | batch | images/s | ms/step | peak GiB | GPU busy | kernels/step | launches/step | device time by kind |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]


def row(arm, r):
    if r["error"]:
        return f"| {arm.name} | {arm.batch_size}+{arm.batch_size} | failed: {r['error']} | | | | | | |"
    busy = f"{100 * r['busy']:.0f} %" if r["busy"] is not None else "n/a (CPU)"
    kinds = ", ".join(f"{k} {100 * v:.0f} %" for k, v in r["kinds"].items() if v >= 0.01)
    return (f"| {arm.name} | {arm.batch_size}+{arm.batch_size} | {r['images_per_s']:.3g} | "
            f"{r['ms_per_step']:.4g} | {r['peak_gb']:.3g} | {busy} | {r['kernels']:.0f} | "
            f"{r['launches']:.0f} | {kinds} |")


def table(results):
    return "\n".join(HEADER + [row(arm, r) for arm, r in results])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", choices=sorted(bench.RESOLUTION), default="sd15")
    parser.add_argument("--resolution", type=int, default=None,
                        help="pixels per side (default: the model's, " +
                        ", ".join(f"{m} {r}" for m, r in sorted(bench.RESOLUTION.items())) + ")")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per arm (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--profile_steps", type=int, default=5, help="steps under torch.profiler (default 5)")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="default: train.py's (bf16 on GPUs that have it)")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--torch_compile", nargs="?", const="inductor", default=None, metavar="BACKEND")
    parser.add_argument("--compiled_backend", default="inductor", help="the compiled arm's torch.compile backend")
    parser.add_argument("--keep_going", action="store_true",
                        help="an arm that fails prints its error as its row and the next arm runs")
    args = parser.parse_args(argv)
    args.resolution = args.resolution or bench.RESOLUTION[args.model]
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    import torch

    from dreambooth import hub
    from dreambooth import machine
    from dreambooth.training import steps

    device = machine.torch_device()
    args.mixed_precision = steps.mixed_precision_name(machine.amp_dtype(args.mixed_precision, device))
    hub.quiet_hf_logging()
    results = []
    with tempfile.TemporaryDirectory() as work:
        args.model_dir = os.path.join(work, "model")
        bench.make_model(args.model, args.model_dir)
        print("\n".join(HEADER), flush=True)
        for name in args.arms.split(","):
            arm = Arm(name, **ARMS[name])
            try:
                result = run_arm(arm, args, device)
            except Exception as e:  # one arm's failure (out of memory, a compile error) is its row
                if not args.keep_going:
                    raise
                result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            results.append((arm, result))
            free_memory(device)
            print(row(arm, result), flush=True)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    text = (f"model={args.model} resolution={args.resolution} device={where} "
            f"mixed_precision={args.mixed_precision} gradient_checkpointing={args.gradient_checkpointing} "
            f"torch_compile={args.torch_compile} torch={torch.__version__} steps={args.steps} "
            f"profile_steps={args.profile_steps}\n\n" + table(results))
    print(text)
    return results


if __name__ == "__main__":
    main()

"""Training and generation throughput of the product's own step functions, side by side.

    python benchmarks/bench.py --model small            # CPU: plain loop vs Ray Train, caching on/off
    python benchmarks/bench.py --model sd15 --no_ray    # GPU machine without Ray: the same step functions

Rows: steady-state training images/s (start-up excluded) of `train.train_step` in a plain
PyTorch loop and inside Ray Train (1 worker, `train.main`), with VAE + live text encoder vs
cached latents + precomputed prompt embeddings; start-up costs; generation images/s at several
batch sizes (`drawing.generate_batch`, on the Ray Data actor pool unless --no_ray); peak
memory (process RSS high-water mark from each variant's set-up on CPU, torch.cuda.max_memory_allocated on GPU). Prints a Markdown table.

Each variant runs plain, then in Ray, then plain again; the overhead is taken against the mean
of the two plain runs, whose spread shows how steady the machine was.
"""

import argparse
import gc
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dreambooth import hub  # noqa: E402
from dreambooth import machine  # noqa: E402
from dreambooth.cluster import raycluster  # noqa: E402
from dreambooth.generation import imaging
from dreambooth.models import networks  # noqa: E402
from dreambooth.models import random_models
from dreambooth.training import steps  # noqa: E402

RESOLUTION = {"tiny": 64, "small": 256, "sd15": 512}
ROWS = []


def row(name, value, unit, note=""):
    ROWS.append((name, value, unit, note))
    print(f"{name}: {value:.3f} {unit} {note}", file=sys.stderr, flush=True)


def reset_peak_memory(device):
    """Start a variant's peak-memory count: CUDA's allocator statistics, or on CPU the process's
    RSS high-water mark (Linux resets VmHWM when "5" is written to clear_refs)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux: the peak then counts from the process's start
        pass


def peak_memory_gb(device):
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def make_model(size, folder):
    start = time.perf_counter()
    pipe = random_models.build_pipeline(size)
    pipe.save_pretrained(folder, safe_serialization=True)
    return time.perf_counter() - start


def step_plan(args, train_text_encoder, device, precompute_text_embeddings, use_lora=False):
    """train.py's settings for the plain loop: its own flag defaults, with this run's choices."""
    from dreambooth.planning import planning

    return planning.offline_plan(
        model_dir=args.model_dir, use_lora=use_lora, learning_rate=1e-4 if use_lora else 5e-6, mixed_precision=args.mixed_precision, train_text_encoder=train_text_encoder,
        gradient_checkpointing=args.gradient_checkpointing, torch_compile=args.torch_compile,
        channels_last=device.type == "cuda", precompute_text_embeddings=precompute_text_embeddings)


# token ids of an instance and a class prompt, fixed (the step's cost does not depend on them)
PROMPT_IDS = {"instance": [list(range(49406 % 500, 49406 % 500 + 77))], "class": list(range(77))}


def synthetic_batch(nets, args, cached):
    """2+2 rows (instance + class) of random uint8 pixels on the CPU, as the data stream
    delivers them, or their cached VAE posteriors."""
    import torch


    res = getattr(args, "resolution", None) or RESOLUTION[args.model]
    pixels = {k: torch.randint(0, 256, (args.batch_size, res, res, 3), dtype=torch.uint8)
              for k in ("instance", "class")}
    if not cached:
        return {f"{k}_pixels": v for k, v in pixels.items()}
    with torch.no_grad():
        return {f"{k}_latents": nets.vae.encode(imaging.to_model_input(v.to(nets.aux_device))).latent_dist.parameters.cpu()
                for k, v in pixels.items()}


def plain_loop(args, device, variant):
    """Steady-state images/s of train.train_step with no Ray: variant in full|frozen|cached|lora
    (lora: rank-4 adapters on UNet and text encoder)."""

    from dreambooth.training import conditioning
    from dreambooth.training import steps

    train_te = variant in ("full", "lora")
    plan = step_plan(args, train_te, device, precompute_text_embeddings=variant == "cached",
                     use_lora=variant == "lora")
    reset_peak_memory(device)
    t0 = time.perf_counter()
    nets = networks.setup_models(plan, device, device, distributed=False)
    load_s = time.perf_counter() - t0
    state = steps.make_train_state(nets, plan)
    prompts = conditioning.step_prompts(plan.family, nets.text_encoders(), plan, PROMPT_IDS, device)
    batch = synthetic_batch(nets, args, cached=variant == "cached")
    images_per_step = 2 * args.batch_size

    def step():
        return steps.train_step(state, [batch], prompts, plan.prior_loss_weight, plan.max_grad_norm)

    t0 = time.perf_counter()
    step()
    sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(args.plain_warmup - 1):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()[0]
    loss.item()  # one sync at the end, as train.py reads losses only on logging steps
    elapsed = time.perf_counter() - t0
    return {"images_per_s": images_per_step * args.steps / elapsed, "load_s": load_s, "first_step_s": first_s,
            "peak_gb": peak_memory_gb(device)}


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def write_images(folder, count, res, seed):
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(count):
        Image.fromarray(rng.integers(0, 255, (res, res, 3), dtype=np.uint8)).save(os.path.join(folder, f"{k}.png"))


def ray_train(args, work, variant):
    """Steady-state images/s of the same step inside Ray Train, 1 worker, via train.main.

    Timed from the end of the window that closes at args.warmup to the end of the last one
    (args.steps steps later), from the times in metrics.jsonl: the reports in between count.
    """
    import json

    from dreambooth.commands import train
    from dreambooth.training import runlog

    flags = ["--model_dir", args.model_dir, "--output_dir", os.path.join(work, f"tuned-{variant}"),
             "--instance_images_dir", os.path.join(work, "instance"), "--instance_prompt", "photo of unqtkn toy",
             "--class_images_dir", os.path.join(work, "class"), "--class_prompt", "photo of a toy",
             "--num_workers", "1", "--train_batch_size", str(args.batch_size), "--num_epochs", "1000",
             "--max_train_steps", str(args.warmup + args.steps), "--logging_steps", str(args.logging_steps),
             "--checkpointing_steps", "100000", "--mixed_precision", args.mixed_precision, "--overwrite"]
    if variant == "lora":
        flags.append("--use_lora")
    elif variant != "full":
        flags.append("--no-train_text_encoder")
    if variant == "frozen":
        flags.append("--no-precompute_text_embeddings")  # live text encoder, as in the plain loop
    if variant == "cached":
        flags.append("--cache_latents")
    t0 = time.perf_counter()
    result = train.main(flags)
    wall_s = time.perf_counter() - t0
    with open(os.path.join(result.path, runlog.METRICS_FILE)) as f:
        times = {m["step"]: m["time"] for m in map(json.loads, f)}
    end = args.warmup + args.steps
    return {"images_per_s": 2 * args.batch_size * args.steps / (times[end] - times[args.warmup]), "wall_s": wall_s}


def generation(args, device, use_ray):
    """Steady images/s of drawing.generate_batch at each batch size (first batch excluded)."""
    from dreambooth.generation import drawing
    from dreambooth.models import outputs

    settings = drawing.ImageSettings(num_inference_steps=args.inference_steps)
    results = {}
    if use_ray:
        raycluster.init_ray()
    else:
        t0 = time.perf_counter()
        pipe = drawing.load_pipeline(args.model_dir, device)
        row("generation: pipeline load", time.perf_counter() - t0, "s")
    for batch in args.gen_batches:
        prompts, seeds = ["photo of a toy"] * batch, list(range(batch))
        if use_ray:
            with tempfile.TemporaryDirectory() as out:
                rows = [{"prompt": "photo of a toy", "seed": k, "file": f"{k}.png"} for k in range(3 * batch)]
                stamps = [time.perf_counter()
                          for _ in drawing.run_actor_pool(
                              [drawing.DrawJob(outputs.ModelRef(args.model_dir), out, False, tuple(rows))],
                              settings, batch, 1)]
            results[batch] = (len(stamps) - batch) / (stamps[-1] - stamps[batch - 1])
        else:
            drawing.generate_batch(pipe, prompts, seeds, settings)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(2):
                drawing.generate_batch(pipe, prompts, seeds, settings)
            sync(device)
            results[batch] = 2 * batch / (time.perf_counter() - t0)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", choices=sorted(RESOLUTION), default="small")
    parser.add_argument("--steps", type=int, default=20, help="Timed steps per variant.")
    parser.add_argument("--warmup", type=int, default=10, help="Untimed steps first inside Ray Train.")
    parser.add_argument("--plain_warmup", type=int, default=3, help="Untimed steps first in the plain loop.")
    parser.add_argument("--logging_steps", type=int, default=10,
                        help="train.py's reporting interval inside Ray (its default); divides --warmup and --steps.")
    parser.add_argument("--batch_size", type=int, default=2, help="Instance rows per step (+ as many class rows).")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--torch_compile", nargs="?", const="inductor", default=None, metavar="BACKEND")
    parser.add_argument("--no_ray", action="store_true", help="Plain-loop figures only (no Ray installed).")
    parser.add_argument("--variants", default="full,frozen,cached",
                        help="Training variants (full, frozen, cached, lora); '' for none. Peak CPU memory (RSS) "
                             "counts from each variant's set-up but keeps what earlier ones freed: compare "
                             "variants in separate runs.")
    parser.add_argument("--gen_batches", default="1,4,8")
    parser.add_argument("--inference_steps", type=int, default=None, help="Default: 50 on GPU, 10 on CPU.")
    parser.add_argument("--skip_generation", action="store_true")
    args = parser.parse_args(argv)
    if args.warmup % args.logging_steps or args.steps % args.logging_steps or not args.warmup:
        parser.error("--warmup and --steps must be positive multiples of --logging_steps")
    args.gen_batches = [int(b) for b in args.gen_batches.split(",")]
    device = machine.torch_device()
    args.mixed_precision = steps.mixed_precision_name(machine.amp_dtype(args.mixed_precision, device))  # train.py's rule
    args.inference_steps = args.inference_steps or (50 if device.type == "cuda" else 10)
    variants = [v for v in args.variants.split(",") if v]
    hub.quiet_hf_logging()

    with tempfile.TemporaryDirectory() as work:
        args.model_dir = os.path.join(work, "model")
        row("start-up: build + save random model", make_model(args.model, args.model_dir), "s")
        use_ray = not args.no_ray and variants
        if use_ray:
            t0 = time.perf_counter()
            raycluster.init_ray()
            row("start-up: Ray start", time.perf_counter() - t0, "s")
            res = RESOLUTION[args.model]
            write_images(os.path.join(work, "instance"), 4, res, 0)
            write_images(os.path.join(work, "class"), 40, res, 1)
            from dreambooth.generation import imagefiles
            from dreambooth.training import dataset

            t0 = time.perf_counter()
            paths = imagefiles.list_images(os.path.join(work, "class"), "class")
            dataset.build_train_dataset(paths[:4], paths, res, True, False).materialize()
            row("start-up: dataset build (40 class rows)", time.perf_counter() - t0, "s")
        plain = {}
        for variant in variants:
            # plain, Ray, plain again: the plain figure is the mean of the runs either side,
            # so drift in the machine's speed does not pass for Ray overhead.
            runs = [plain_loop(args, device, variant)]
            if use_ray:
                ray_result = ray_train(args, work, variant)
                runs.append(plain_loop(args, device, variant))
            rates = [r["images_per_s"] for r in runs]
            plain[variant] = {**runs[0], "images_per_s": sum(rates) / len(rates)}
            row(f"plain loop, {variant}", plain[variant]["images_per_s"], "images/s",
                f"(before / after Ray: {rates[0]:.3g} / {rates[1]:.3g})" if use_ray else "")
            row(f"plain loop, {variant}: peak memory", max(r["peak_gb"] for r in runs), "GiB",
                "(RSS high-water mark of the process since the variant's set-up)" if device.type == "cpu" else "(max_memory_allocated)")
            if use_ray:
                row(f"Ray Train 1 worker, {variant}", ray_result["images_per_s"], "images/s",
                    f"(whole train.py run {ray_result['wall_s']:.1f} s)")
                row(f"Ray overhead, {variant}", 100 * (1 - ray_result["images_per_s"] / plain[variant]["images_per_s"]),
                    "%")
        if plain:
            row("start-up: model load (plain)", plain[variants[0]]["load_s"], "s")
            row("start-up: first step (plain)", plain[variants[0]]["first_step_s"], "s")
        if "frozen" in plain and "cached" in plain:
            row("speed-up of caching latents + embeddings (plain, frozen TE)",
                plain["cached"]["images_per_s"] / plain["frozen"]["images_per_s"], "x")
        if not args.skip_generation:
            for batch, rate in generation(args, device, use_ray=not args.no_ray).items():
                where = "plain" if args.no_ray else "actor pool"
                row(f"generation batch {batch} ({args.inference_steps} steps, {where})", rate, "images/s")

    import torch

    lines = [f"\nmodel={args.model} resolution={RESOLUTION[args.model]} batch={args.batch_size}+{args.batch_size} "
             f"device={device.type}{' ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''} "
             f"mixed_precision={args.mixed_precision} gradient_checkpointing={args.gradient_checkpointing} "
             f"torch={torch.__version__}\n",
             "| measure | value | unit | note |", "| --- | ---: | --- | --- |"]
    lines += [f"| {name} | {value:.3g} | {unit} | {note} |" for name, value, unit, note in ROWS]
    # One write, not print: Ray Data patches print() to redraw its finished progress bars around each call.
    sys.stderr.flush()
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Validation samples during training: images from the current weights at fixed seeds.

Every validation step each rank draws its share of the images (image k on rank
k % world size), rank 0 gathers them into `<run folder>/validation/step-<N>/` and
rewrites one timeline sheet (a row per validation step, a column per prompt and seed).
Sampling leaves the training RNG streams and train/eval modes as it found them, so a run
with validation trains exactly as one without.
"""

import os

from dreambooth import files
from dreambooth.generation import drawing
from dreambooth.generation import imaging
from dreambooth.models import networks
from dreambooth.models import quantize
from dreambooth.training import checkpoint

FOLDER = "validation"  # in the run's folder under --storage_path
TIMELINE = "timeline.png"


def step_folder(run_dir, step):
    """The folder of a round's images: <run folder>/validation/step-<N>."""
    return os.path.join(run_dir, FOLDER, f"step-{step}")


def images_of(plan):
    """[(prompt, image index, seed)] of one validation round, in column order."""
    return [(prompt, i, drawing.image_seed(plan.seed, prompt, i))
            for prompt in plan.validation_prompts for i in range(plan.num_validation_images)]


class Sampler:
    """Draws validation images with a worker's training networks (networks.Models), the model
    folder's own tokenizers and scheduler, and the run's autocast dtype. The text encoders
    run on their device and the VAE on its own: the two-device split samples as it trains."""

    def __init__(self, nets, plan, amp_dtype):
        import diffusers

        self.nets, self.plan, self.amp_dtype = nets, plan, amp_dtype
        self.family = plan.family
        self.negative = self.family.default_negative_prompt or ""  # (generate.py's without --negative_prompt)
        self.tokenizers = self.family.load_tokenizers(plan.model_dir)
        # The model's own sampler (PNDM for SD 1.x), as generate.py draws with it.
        config = files.read_json(os.path.join(plan.model_dir, "scheduler", "scheduler_config.json"))
        self.scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
        # Frozen text encoders are released from the device once training's states are computed
        # (networks.Models.release_text_encoders): the samples' prompts are encoded now, once.
        self.drawing_networks = None  # (the family's networks only drawing reads: loaded at the first round)
        self.encoded = {}
        if plan.text_encoded_once:
            import torch

            with torch.no_grad(), torch.autocast(nets.denoiser_device.type, dtype=amp_dtype,
                                                 enabled=amp_dtype is not None):
                self.encoded = {prompt: self.encode([prompt]) for prompt in (self.negative, *plan.validation_prompts)}

    def encode(self, texts):
        """(states, pooled or None) of the prompts texts, on the UNet's device (the family's encode_text)."""
        import torch

        if len(texts) == 1 and texts[0] in self.encoded:
            return self.encoded[texts[0]]

        ids = torch.stack([torch.from_numpy(self.family.token_ids(self.tokenizers, p)) for p in texts])
        states, pooled = self.family.encode_text([networks.unwrap(te) for te in self.nets.text_encoders()],
                                           ids.to(self.nets.aux_device))
        return states.to(self.nets.denoiser_device), pooled.to(self.nets.denoiser_device) if pooled is not None else None

    def pipeline(self):
        nets = self.nets
        parts = {"vae": nets.vae, self.family.denoiser: networks.unwrap(nets.denoiser), "scheduler": self.scheduler}
        for encoder_name, tokenizer_name, tokenizer in zip(self.family.text_encoders, self.family.tokenizers(),
                                                           self.tokenizers):
            # The text encoders stay out: the pipeline is given prompt states (encode) and never calls them, and it
            # draws on the device of its first module by name that is on a GPU: with --gpus_per_worker 2, a text
            # encoder on the second card would put the latents there, away from the denoiser.
            parts[encoder_name], parts[tokenizer_name] = None, tokenizer
        if self.family.safety_checker:
            parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        if self.drawing_networks is None:
            self.drawing_networks = {name: self.load_drawing_network(name) for name in self.family.validation_networks}
        pipe = self.family.validation_pipeline({**parts, **self.drawing_networks})
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def load_drawing_network(self, name):
        """A network only drawing reads (family.validation_networks), frozen, on the denoiser's device in the run's
        autocast dtype (fp32 without one), quantised as the base is with --base_precision: kept for later rounds."""
        import torch

        plan, device = self.plan, self.nets.denoiser_device
        net = self.family.load_drawing_network(lambda cls, subfolder: networks.from_pretrained(
            cls, plan.model_dir, plan.allow_unsafe_weights, subfolder=subfolder), name)
        net = net.requires_grad_(False).eval().to(dtype=self.amp_dtype or torch.float32)
        if plan.base_precision:
            return quantize.quantized(net, plan.base_precision, net.dtype, device)
        return net.to(device)

    def __call__(self, items):
        """PIL images of [(prompt, index, seed)], one by one (memory stays at one image's)."""
        import torch

        nets = self.nets
        vae = nets.vae
        pipe = self.pipeline()
        images = []
        with torch.no_grad(), torch.autocast(nets.denoiser_device.type, dtype=self.amp_dtype,
                                             enabled=self.amp_dtype is not None):
            negative, negative_pooled = self.encode([self.negative])
            for prompt, _, seed in items:
                states, pooled = self.encode([prompt])
                text = self.family.pipeline_text(states, pooled, negative, negative_pooled)
                # generate.py's guidance (the family's by default), whatever the pipeline's own
                latents = pipe(**text, **self.family.pipeline_kwargs(),
                               **{self.family.guidance_argument: self.family.guidance(self.plan.guidance_scale)},
                               height=self.plan.resolution, width=self.plan.resolution,
                               num_inference_steps=self.plan.validation_inference_steps,
                               generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").images
                latents = self.family.unpack_latents(pipe, latents, self.plan.resolution, self.plan.resolution)
                decoded = self.family.decode_latents(vae, latents.to(nets.aux_device))
                images += pipe.image_processor.postprocess(decoded.float(), output_type="pil")
        return images


def run_round(sampler, step, rank, world, run_dir):
    """One validation round at step, called by every rank. Returns (timeline path, {file
    name: image}) on rank 0, None elsewhere. Training's RNG streams and modes are restored."""
    import torch.distributed as dist

    items = images_of(sampler.plan)
    # A sharded denoiser (--fsdp) runs only when every rank runs it: then each draws every image, rank 0 keeps them
    sharded = sampler.plan.fsdp
    mine = list(range(len(items))) if sharded else list(range(rank, len(items), world))
    nets = [sampler.nets.denoiser, *sampler.nets.text_encoders()]
    modes = [net.training for net in nets]
    rng = checkpoint.rng_state()
    for net in nets:
        net.eval()  # no dropout in the samples
    try:
        drawn = list(zip(mine, sampler([items[k] for k in mine])))
    finally:
        for net, mode in zip(nets, modes):
            net.train(mode)
        checkpoint.set_rng_state(rng)
    if world > 1 and not sharded:
        gathered = [None] * world
        dist.all_gather_object(gathered, drawn)
        drawn = [pair for part in gathered for pair in part]
    if rank != 0:
        return None
    folder = step_folder(run_dir, step)
    os.makedirs(folder, exist_ok=True)
    names = [drawing.image_file_name(prompt, index) for prompt, index, _ in items]
    images = {names[k]: image for k, image in sorted(drawn, key=lambda pair: pair[0])}
    for name, image in images.items():
        files.save_image_atomic(image, os.path.join(folder, name))
    return write_timeline(os.path.join(run_dir, FOLDER), names), images


def write_timeline(folder, names):
    """timeline.png in folder: a row per step-<N> folder (in step order, each named on its left), a column per
    name."""
    from PIL import Image

    steps = sorted((int(d.split("-", 1)[1]) for d in os.listdir(folder) if d.startswith("step-")))
    images = []
    for step in steps:
        for name in names:
            path = os.path.join(folder, f"step-{step}", name)
            if os.path.isfile(path):
                with Image.open(path) as image:
                    images.append(image.copy())
            else:
                images.append(Image.new("RGB", (8, 8), "white"))
    path = os.path.join(folder, TIMELINE)
    sheet = imaging.make_grid(images, thumb_size=128, columns=len(names))
    files.save_image_atomic(imaging.labelled_rows(sheet, [f"step {step}" for step in steps], 128), path)
    return path

"""What a model family provides: the one interface the suite asks whatever differs between families.

A family is one folder of dreambooth/families (sd1/, sdxl/, flux/, ...) whose __init__.py defines one subclass
of Family and its instance, FAMILY; families/__init__.py finds the folders and makes the table of them, named by
their folders, and finds a model folder's family. What several families share is a base or a helper in shared/
(unet.py, fluxblocks.py, flux2base.py, builders.py, layouts.py); a family never imports another. Everything else asks the family object the Plan carries (plan.family, models.family), never `if family == ...`.
What a model decides for itself (its prediction type, its native resolution) is read from its own
configs, not asked here.

Heavy imports (torch, transformers, diffusers) happen inside the methods that need them: the
family is asked its name and label by a `--help` or a one-line error that never waits for them.
"""

import os

import numpy as np

from dreambooth import files
from dreambooth.families.shared import layouts
from dreambooth.families.shared import objectives


def part_config(model_dir, part):
    """A model part's config.json (unet, vae, ...), read as JSON: importing diffusers costs the driver seconds."""
    return files.read_json(os.path.join(model_dir, part, "config.json"))


def kohya_lora_tensors(groups, alpha_of, order_of, widths=None):
    """{kohya key: tensor} of LoRA adapters grouped by the original layer they act on: groups {kohya module:
    {part: [down, up]}}, part None for a layer of its own, else the part of a layer the original fuses (q, k, v
    of one qkv layer, ...), in the order order_of(module) gives. A fused layer's adapters are joined
    block-diagonally: the down weights stacked, each up weight in its rows and its block of columns, a part
    without adapters as zeros (widths {part: rows}; default: every part as wide as the adapters' up weights),
    alpha x the number of parts (the scale alpha / rank kept). alpha_of(module): the alpha (None: the rank)."""
    import torch

    out = {}
    for name, parts in groups.items():
        alpha = alpha_of(name)
        if list(parts) == [None]:
            down, up = parts[None]
        else:
            order = order_of(name)
            first_down, first_up = next(iter(parts.values()))
            rank = first_down.shape[0]
            rows = widths or dict.fromkeys(order, first_up.shape[0])
            down = torch.cat([parts[p][0] if p in parts else first_down.new_zeros(first_down.shape) for p in order])
            up = down.new_zeros(sum(rows[p] for p in order), rank * len(order))
            row = 0
            for k, p in enumerate(order):
                if p in parts:
                    up[row:row + rows[p], k * rank:(k + 1) * rank] = parts[p][1]
                row += rows[p]
            alpha = (alpha or rank) * len(order)
        out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"] = down, up
        out[f"{name}.alpha"] = torch.tensor(float(alpha or down.shape[0]))
    return out


def unfused_kohya_module(module):
    """(kohya's module name, None: a layer of its own) of a transformer whose original layout is diffusers' own:
    lora_unet_ and the module's name with its dots as underscores."""
    return "lora_unet_" + module.replace(".", "_"), None


def denoiser_kohya_lora(fam, state_dict, alphas, kohya_module=unfused_kohya_module, widths=None):
    """{kohya key: tensor} of a LoRA file's tensors on fam's denoiser alone (its text encoders are never trained:
    trainable_text_encoders; another network's adapters a KeyError), each module under kohya_module's (name, part):
    part None a layer of its own, else q, k or v of one fused attention layer of widths {part: rows}
    (kohya_lora_tensors), with the denoiser's alpha."""
    def module_of(network, module):
        if network != fam.denoiser:
            raise KeyError(f"no kohya layout for {network} adapters of {fam.label}")
        return kohya_module(module)

    return kohya_lora_tensors(group_lora(state_dict, module_of), lambda name: alphas.get(fam.denoiser),
                              lambda name: ("q", "k", "v"), widths)


def group_lora(state_dict, module_of):
    """{kohya module: {part: [down, up]}} of a LoRA file's tensors (peft's <network>.<module>.lora_A/lora_B.weight
    names): module_of(network, module) -> (kohya module, part or None)."""
    groups = {}
    for key, tensor in state_dict.items():
        network, rest = key.split(".", 1)
        module, kind, _ = rest.rsplit(".", 2)  # (<module>.lora_A.weight)
        name, part = module_of(network, module)
        groups.setdefault(name, {}).setdefault(part, [None, None])[kind == "lora_B"] = tensor
    return groups


def tokenize_prompt(tokenizer, prompt):
    """Prompt -> (L,) int64 token ids, padded to the tokenizer's model_max_length."""
    ids = tokenizer(prompt, padding="max_length", truncation=True,
                    max_length=tokenizer.model_max_length, return_tensors="np").input_ids
    return ids[0].astype(np.int64)


def tokenize_all(tokenizers, prompt):
    """Prompt -> (L,) ids with one tokenizer, (E, L) with E: each tokenizer's ids, the shorter ones
    padded on with their own pad token to the longest (Flux.1: CLIP's 77 beside T5's 512; the family's
    encode_text reads each encoder's own length)."""
    ids = [tokenize_prompt(tokenizer, prompt) for tokenizer in tokenizers]
    if len(ids) == 1:
        return ids[0]
    length = max(len(row) for row in ids)
    return np.stack([np.pad(row, (0, length - len(row)), constant_values=tokenizer.pad_token_id)
                     for row, tokenizer in zip(ids, tokenizers)])


def config_of(model):
    """A network's config under DDP's and torch.compile's wrappers (which have none of their own)."""
    while not hasattr(model, "config"):
        model = getattr(model, "_orig_mod", None) or model.module
    return model.config


class Family:
    """The base every family subclasses: what it must say (the attributes) and do (the methods that
    raise NotImplementedError); the others have the plain default."""

    # --- identity
    name = ""  # the table's key and the record's: its folder's name ("sd1", "sdxl", ...), set by the table
    label = ""  # as the README and error lines say it: "SD 1.x"
    order = 1000  # its place in the table, the docs' tables and the lists of --help (a later family: after the rest)
    pipeline = ""  # the diffusers pipeline class, as model_index.json names it
    denoiser = "unet"  # the denoiser's subfolder, and its name in the pipeline and in diffusers' LoRA files
    denoiser_label = "UNet"  # as the plan's line says it
    # its layers LoRA adapts (diffusers' choice): module names' ends, or a regular expression of whole names (a str)
    denoiser_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    text_encoders = ("text_encoder",)  # subfolders, in the order their states are concatenated
    trainable_text_encoders = ("text_encoder", "text_encoder_2")  # those --train_text_encoder trains, if it has them
    safety_checker = False  # its pipeline has one (and generate.py's --safety_checker applies)
    negative_prompt = True  # its pipeline draws away from a negative prompt (generate.py's --negative_prompt)
    guidance_scale = 7.5  # --guidance_scale's default: classifier-free guidance (Flux.1 dev: its guidance input)
    guidance_argument = "guidance_scale"  # the pipeline's name for it (Qwen-Image's: true_cfg_scale)
    default_negative_prompt = None  # drawn against when none is given (Qwen-Image guides only against one)
    guided_training = False  # --guidance_scale is an input of the denoiser in training too (Flux.1 dev)
    zero_negative_prompt = False  # the empty negative prompt drawn as zeros (SDXL's force_zeros_for_empty_prompt)
    time_ids = False  # the denoiser also takes each image's size and crop (SDXL's "text_time"): the stream carries them
    validation_networks = ()  # the folder's networks only drawing reads (Ideogram 4's unconditional transformer):
    # validation samples load them once, frozen, beside the denoiser (load_drawing_network; memory.py: drawing_params)
    supports = frozenset({"draw", "train", "export", "export_lora"})  # generate/evaluate, train, export (a full
    # model as one original-layout file; its LoRA in kohya's layout)
    denoiser_file = False  # export's full model: the denoiser alone in its original layout, as a flow model's own
    # release is (ComfyUI's models/diffusion_models, beside the base model's VAE and text encoders), not a checkpoint
    lycoris_export = True  # with export_lora: export.py writes LoHa/LoKr adapters in LyCORIS' names (layouts.lycoris)
    released_resolutions = (512,)  # of the released models, for the README (a model's config decides)
    released_params = {}  # parameter counts of the released networks ({subfolder: count}), for memory.py
    released_size = None  # flow-matching families: the own size (random.own_sizes) of the released model memory.py counts
    text_tokens = 77  # the text states' length in training (activations.py)
    known_models = ()  # its base models known by short name (known.KnownModel), pinned: families.KNOWN_MODELS
    kohya_text_prefixes = {}  # the UNet families': kohya's prefix of each text encoder's LoRA modules
    measured_memory = ()  # (memory.Setup fields that differ, GiB per worker) measured on a GPU: docs/MEMORY.md
    known_vaes = {}  # the VAEs of its own people train it with, pinned: {hub name: commit} (vae_cache.py)
    # docs/MEMORY.md's flow table (memory.py): (model, its own full size, LoRA resolutions, --fsdp worker counts)
    memory_rows = ()

    # its models with random weights (cache_model.py --tiny/--random_model --arch): builders.RandomModels
    random = None

    def matches(self, pipeline, text_encoder_config):
        """Whether a folder is of this family: model_index.json's pipeline class, and the first text
        encoder's config (a dict, {} when unreadable)."""
        return pipeline == self.pipeline

    def check_folder(self, model_dir):
        """A UserError, before Ray starts, for what this machine lacks to read the family's model folder (after
        families.check_model_dir's own checks; None: its released model, not fetched yet); nothing by default."""

    def tokenizers(self):
        """The tokenizer subfolders, one per text encoder, in the same order."""
        return tuple(name.replace("text_encoder", "tokenizer") for name in self.text_encoders)

    def parts(self):
        """The model folder's subfolders its pipeline loads (besides the scheduler)."""
        return (self.denoiser, "vae", *self.text_encoders, *self.tokenizers())

    def networks(self):
        """The subfolders that hold weights."""
        return (self.denoiser, "vae", *self.text_encoders)

    # --- the model folder's own numbers
    def native_resolution(self, model_dir):
        """The pixel size the model was trained at: the denoiser's sample size x the VAE's downscaling."""
        return part_config(model_dir, self.denoiser)["sample_size"] * self.vae_scale(model_dir)

    def size_multiple(self, model_dir):
        """The step every trained height and width must be a multiple of."""
        raise NotImplementedError

    # --- the VAE (networks.load_vae, steps.py, the latent cache, validation)
    def vae_class(self):
        """The VAE's class (diffusers' AutoencoderKL: every family but Qwen-Image)."""
        from diffusers import AutoencoderKL

        return AutoencoderKL

    def vae_downscale(self, vae_config):
        """How many pixels a latent pixel covers, per side, of a VAE config (a dict or the VAE's own)."""
        return 2 ** (len(vae_config["block_out_channels"]) - 1)

    def vae_scale(self, model_dir):
        """How many pixels a latent pixel of the model's VAE covers, per side (vae_downscale of its config)."""
        return self.vae_downscale(part_config(model_dir, "vae"))

    def latent_channels(self, vae_config):
        return vae_config["latent_channels"]

    def latent_posterior(self, vae, pixels):
        """The VAE's DiagonalGaussianDistribution of (B, 3, H, W) pixels in [-1, 1]: (B, C, h, w) latents."""
        return vae.encode(pixels.to(vae.dtype)).latent_dist

    def scale_latents(self, vae, latents):
        """The VAE's latents as the denoiser takes them: shifted (SD 3.5, Flux.1) and scaled by its config."""
        shift = getattr(vae.config, "shift_factor", None)
        return (latents - shift if shift else latents) * vae.config.scaling_factor

    def decode_latents(self, vae, latents):
        """(B, 3, H, W) pixels of latents as the denoiser makes them (scale_latents undone)."""
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + (getattr(vae.config, "shift_factor", None) or 0.0)
        return vae.decode(latents).sample

    # --- the networks (models/networks.py)
    def load_denoiser(self, load):
        """The denoiser; load(cls, subfolder) is models.from_pretrained with the run's weight rule."""
        from diffusers import UNet2DConditionModel

        return load(UNet2DConditionModel, self.denoiser)

    # --- the text side (prompts.py, networks.py, steps.py, validation.py)
    def denoiser_of_config(self, model_dir):
        """The denoiser of model_dir's config, its weights not read: built in torch's default device (under
        torch.device("meta"): the shapes alone)."""
        return self.load_denoiser(lambda cls, subfolder: cls.from_config(cls.load_config(os.path.join(model_dir,
                                                                                                      subfolder))))

    def load_tokenizers(self, model_dir):
        from transformers import CLIPTokenizer

        return [CLIPTokenizer.from_pretrained(model_dir, subfolder=folder) for folder in self.tokenizers()]

    def token_ids(self, tokenizers, prompt):
        """A prompt's token ids as encode_text reads them: (L,) with one tokenizer, (E, L) with E (tokenize_all)."""
        return tokenize_all(tokenizers, prompt)

    def trains_text_encoder(self, flag):
        """Whether --train_text_encoder (flag) trains any of its text encoders: never for a family whose encoders
        are all frozen (Qwen-Image's), whatever the flag says."""
        return bool(flag and self.trainable_text_encoders)

    def load_text_encoders(self, model_dir, load):
        """The text encoders in order; load(cls, subfolder) is models.from_pretrained with the run's
        weight rule."""
        raise NotImplementedError

    def encode_text(self, text_encoders, ids):
        """(states (N, L, D), pooled (N, P) or None) of token ids: (N, L) with one tokenizer, (N, E, L)
        with E (prompts.prompt_ids' shapes)."""
        raise NotImplementedError

    trimmed_text = False  # its text states are as long as the longest prompt's, with their mask (Qwen-Image's)

    def pad_text(self, states, side, length):
        """states (N, L, D) and encode_text's second value padded to length L' >= L tokens: the families whose
        states are always max-length never pad; those of trimmed_text pad both with zeros."""
        if not self.trimmed_text or length <= states.shape[1]:
            return states, side
        import torch.nn.functional as F

        more = length - states.shape[1]
        return F.pad(states, (0, 0, 0, more)), F.pad(side, (0, more))

    def text_width(self, denoiser_config):
        """The width of the text states a flow-matching denoiser of this config reads (planning/activations.py)."""
        return denoiser_config.joint_attention_dim

    def meta_side_input(self, denoiser_config, tensor_options):
        """encode_text's second value for one prompt, empty (tensor_options: torch.empty's device and dtype), to count
        a flow-matching denoiser's activations (planning/activations.py): a pooled embedding."""
        import torch

        return torch.empty(1, denoiser_config.pooled_projection_dim, **tensor_options)

    def pipeline_text(self, states, side, negative, negative_side):
        """The pipeline's keyword inputs for prompt states (encode_text's pair) and a negative prompt's."""
        text = dict(prompt_embeds=states, negative_prompt_embeds=negative)
        if self.zero_negative_prompt:
            # SDXL's empty negative prompt is zeros (its force_zeros_for_empty_prompt), as generate.py draws
            import torch

            text.update(negative_prompt_embeds=torch.zeros_like(states), pooled_prompt_embeds=side,
                        negative_pooled_prompt_embeds=torch.zeros_like(side))
        elif side is not None:
            text.update(pooled_prompt_embeds=side, negative_pooled_prompt_embeds=negative_side)
        return text

    def freeze_unread_layers(self, text_encoders):
        """Freeze what never reaches the loss (DDP would wait for its gradients); nothing by default."""

    # --- the objective and the denoiser (steps.batch_loss)
    flow_matching = False  # trained by objectives.flow_matching (--weighting_scheme applies), else denoising (--snr_gamma)
    default_weighting_scheme = "none"
    default_logit_std = 1.0  # --logit_std's default: its DreamBooth script's (Ideogram 4's: 1.5)
    precondition_outputs = False  # flow matching: the error measured on the implied clean latents (weights sigma^2)

    def load_scheduler(self, model_dir):
        """The scheduler training draws its noise from (the model's own schedule): DDPM's, or the flow-matching
        families' FlowMatchEulerDiscreteScheduler."""
        from diffusers import DDPMScheduler
        from diffusers import FlowMatchEulerDiscreteScheduler

        cls = FlowMatchEulerDiscreteScheduler if self.flow_matching else DDPMScheduler
        return cls.from_pretrained(model_dir, subfolder="scheduler")

    def draw(self, scheduler, latents, options):
        """The objectives.Draw of a batch's latents: flow matching's, or DDPM denoising."""
        return (objectives.flow_matching if self.flow_matching else objectives.denoising)(scheduler, latents, options)

    def denoise(self, model, noisy, timesteps, states, pooled, time_ids, guidance=None):
        """The denoiser's prediction for noisy latents under text states (and the pooled text and size
        numbers where the family has them; the guidance value where guided_training)."""
        return model(noisy, timesteps, states, **self.unet_inputs(pooled, time_ids)).sample

    def size_conditioning(self, batch, num_rows, resolution, device, dtype):
        """(B, 6) size and crop numbers of the batch's rows for a family whose denoiser takes them, else None."""
        return None

    def unet_inputs(self, pooled, time_ids):
        """The denoiser's keyword inputs beside the latents, timesteps and states."""
        return {}

    # --- drawing (generate.py, validation.py)
    def load_drawing_network(self, load, name):
        """One of validation_networks, read with load(cls, subfolder) (networks.load_models' loader)."""
        raise NotImplementedError

    def drawing_params(self, params):
        """The parameters of validation_networks in a model whose networks have params ({subfolder: count})."""
        return 0

    def validation_pipeline(self, parts):
        """The pipeline validation samples draw with, of parts (its components; the text encoders None once
        released: it draws from pipeline_text's prompt states)."""
        import diffusers

        return getattr(diffusers, self.pipeline)(**parts)

    def pipeline_kwargs(self):
        """What its pipeline is called with beside the prompt and the settings, to draw as it trains."""
        return {}

    def unpack_latents(self, pipe, latents, height, width):
        """(B, C, h, w) latents of what pipe returns with output_type="latent" (Flux.1 packs them)."""
        return latents

    def guidance(self, value):
        """The guidance a run draws (and, guided_training, trains) at: value (--guidance_scale) or the family's."""
        return self.guidance_scale if value is None else value

    # --- outputs
    def lora_file_layers(self, peft_layers):
        """A network's LoRA layers as the family's pipeline expects them in its LoRA file (save_lora_weights):
        diffusers' older names (lora.down/lora.up) for the UNet families, as their reference scripts write."""
        from diffusers.utils import convert_state_dict_to_diffusers

        return convert_state_dict_to_diffusers(peft_layers)

    # --- export (export.py): a LoRA in kohya's layout, a full model as one original-layout file
    def kohya_lora(self, state_dict, alphas, model_dir):
        """{kohya key: tensor} of a LoRA file's tensors (alphas {network: alpha}) in the family's kohya layout
        (the UNet families': layouts.unet_kohya_lora; a transformer's: its own)."""
        raise NotImplementedError

    def single_file_denoiser(self, denoiser):
        """{original key: tensor} of the family's denoiser (under model.diffusion_model. in a checkpoint; alone in
        a denoiser_file), the UNet families': layouts.unet_prefixes; a transformer's: its own."""
        raise NotImplementedError

    def single_file_vae(self, vae):
        """{original key under first_stage_model.: tensor} of the VAE (every family's AutoencoderKL: one layout)."""
        return layouts.rename(vae.state_dict(), layouts.vae_prefixes(vae.config), "VAE")

    def single_file_text_encoders(self, weights):
        """{original key: tensor} of the text encoders, weights: one {text_model.* key: tensor} per encoder."""
        raise NotImplementedError

    def __repr__(self):
        return f"<family {self.name}>"

    def __eq__(self, other):  # a Plan pickled to a worker carries a copy
        return isinstance(other, Family) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

"""Every command-line flag of the suite, defined once.

Names follow diffusers' train_dreambooth.py; the names of Ray's DreamBooth example
(--model_dir, --instance_images_dir, --lr, --num_epochs, ...) are aliases, so the
commands of both run unchanged. Each script picks the flags it uses with
`make_parser`, and checks flag combinations with the `check_*` functions.
"""

import argparse
import os
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth.config.flaggroups import GROUP_OF
from dreambooth.config.flaggroups import HELP_GROUPS
from dreambooth.config.flagtypes import _switch
from dreambooth.config.flagtypes import abs_path
from dreambooth.config.flagtypes import bool_list
from dreambooth.config.flagtypes import ema_decay
from dreambooth.config.flagtypes import float_list
from dreambooth.config.flagtypes import fraction
from dreambooth.config.flagtypes import int_list
from dreambooth.config.flagtypes import model_path
from dreambooth.config.flagtypes import non_negative_float
from dreambooth.config.flagtypes import non_negative_int
from dreambooth.config.flagtypes import one_prompt
from dreambooth.config.flagtypes import positive_float
from dreambooth.config.flagtypes import positive_int
from dreambooth.config.flagtypes import resolution
from dreambooth.config.flagtypes import resources_flag
from dreambooth.config.flagtypes import storage_location
from dreambooth.config.flagtypes import webhook_url

_FLOW = [f for f in families.FAMILIES.values() if f.flow_matching]
FLOW_LABELS = ", ".join(f.label for f in _FLOW)
FLOW_DEFAULTS = "; ".join(f"{f.label}: {f.default_weighting_scheme}" for f in _FLOW)
FLOW_PRECONDITION = "; ".join(f"{f.label}: {int(f.precondition_outputs)}" for f in _FLOW)
FLOW_LOGIT_STD = "; ".join(f"{f.label}: {f.default_logit_std:g}" for f in _FLOW)
GUIDANCE_DEFAULTS = "; ".join(f"{f.label}: {f.guidance_scale:g}" for f in families.FAMILIES.values())
GUIDED = " and ".join(f.label for f in families.FAMILIES.values() if f.guided_training)  # (Flux.1 dev, FLUX.2 [dev])
# The families whose LoRA adapters export.py writes as one file, and those of them whose LoHa and LoKr adapters it
# writes too (in LyCORIS' layout) or not
EXPORTED_ADAPTERS = ", ".join(f.label for f in families.FAMILIES.values() if "export_lora" in f.supports)
EXPORTED_LYCORIS = ", ".join(f.label for f in families.FAMILIES.values()
                             if "export_lora" in f.supports and f.lycoris_export)
NO_LYCORIS = ", ".join(f.label for f in families.FAMILIES.values()
                       if "export_lora" in f.supports and not f.lycoris_export)


# name -> (option strings, add_argument keyword arguments). The name is the attribute the
# code reads; the options are what users type. Two options mean different things in two
# scripts because the commands of Ray's example use them so: --model_dir is the hub cache
# folder for cache_model.py (name cache_dir) and the model folder elsewhere (model_dir);
# --revision is the model's commit for cache_model.py (revision) and the dataset's for
# download_example_dataset.py (dataset_revision), whose --cache_dir is hub_cache_dir.
# The short names of the base models, as the families list them (Family.known_models), and the gated ones.
SHORT_NAMES = ", ".join(model.short_name for model in families.KNOWN_MODELS)
GATED = ", ".join(model.short_name for model in families.KNOWN_MODELS if model.gated)
# train.py's --optimizer choices: torch's AdamW, bitsandbytes' 8-bit AdamW, prodigyopt's Prodigy, schedulefree's AdamW
OPTIMIZERS = ("adamw", "adamw8bit", "prodigy", "adamw_schedulefree")
# train.py's --adapter choices: peft's LoRA, DoRA, LoHa and LoKr
ADAPTERS = ("lora", "dora", "loha", "lokr")

FLAGS = {
    # --- models and folders
    "model_dir": (("--model_dir", "--pretrained_model_name_or_path"),
        dict(type=model_path, required=True, metavar="DIR|NAME",
             help="The base model: a diffusers folder (the path cache_model.py prints), a hub name "
                  f"(CompVis/stable-diffusion-v1-4) or a short name ({SHORT_NAMES}), found in the hub cache (offline "
                  f"works) or fetched once, pinned, safetensors only ({GATED}: gated, a hub token needed; README, "
                  "'Models').")),
    "cache_dir": (("--model_dir", "--cache_dir"),
        dict(dest="cache_dir", type=storage_location, default=None, metavar="DIR|URI",
             help="Hub cache folder to download the model into. Default: the one model cache every script "
                  "reads, ORIG_MODEL_DIR, else $DATA_PREFIX/model-orig, else data/model-orig here. A bucket's "
                  "folder (s3://bucket/prefix, gs://…): cached on this node, copied there once, its URI printed.")),
    "model_name": (("--model_name",),
        dict(default="sd14", help=f"The base model: a short name ({SHORT_NAMES}; tiny: the built-in tiny random "
                                  f"model, as --tiny) or a hub repository. {GATED}: gated, fetched with your hub "
                                  "token (`hf auth login` or HF_TOKEN; README, 'Models').")),
    "revision": (("--revision",),
        dict(default=None,
             help="Commit of the model repository. Default: the pinned commit of a short-named model "
                  "(see README, 'Models'), else main.")),
    "tiny": (("--tiny",),
        dict(action="store_true",
             help="Write a randomly initialised tiny SD 1.x model instead of downloading "
                  "(offline, CPU-friendly; for tests and trying the pipeline).")),
    "eval_models": (("--eval_models",),
        dict(action="store_true",
             help="Cache the scoring models of evaluate.py instead (DINO --dino_model and CLIP --clip_model; "
                  "with --tiny: tiny random ones). Prints the folder to pass as --eval_models_dir.")),
    "dino_model": (("--dino_model",),
        dict(default="facebook/dino-vits16", help="Hub repository of the DINO ViT (the paper's ViT-S/16).")),
    "dino_revision": (("--dino_revision",),
        dict(default="main", help="Its commit or branch; a 40-hex commit already cached needs no network.")),
    "clip_model": (("--clip_model",),
        dict(default="openai/clip-vit-base-patch32", help="Hub repository of the CLIP model.")),
    "clip_revision": (("--clip_revision",),
        dict(default="main", help="Its commit or branch; a 40-hex commit already cached needs no network.")),
    "random_model": (("--random_model",),
        dict(default=None, metavar="SIZE",
             help="Write a randomly initialised model of this size instead (cache_model.py --help names them); "
                  "--tiny is --random_model tiny.")),
    "arch": (("--arch",),
        dict(default=None, metavar="ARCH",
             help="The architecture of --tiny / --random_model, one per model family (cache_model.py --help "
                  "names them). Its hub name says it: dreambooth-ray/tiny-stable-diffusion-2-v, -xl.")),
    "dataset_repo": (("--repo_id",),
        dict(dest="dataset_repo", default="diffusers/dog-example", help="Hub dataset with the example photos.")),
    "dataset_revision": (("--revision",),
        dict(dest="dataset_revision", default=None, help="Dataset revision (default: latest).")),
    "hub_cache_dir": (("--cache_dir",),
        dict(dest="hub_cache_dir", type=abs_path, default=None, metavar="DIR",
             help="Hub cache folder (default: the Hugging Face cache).")),
    "output_dir": (("--output_dir",),
        dict(type=abs_path, required=True, metavar="DIR", help="Where results are written.")),
    "instance_data_dir": (("--instance_images_dir", "--instance_data_dir"),
        dict(type=abs_path, required=True, metavar="DIR",
             help="Folder with the 4-6 photos of your subject.")),
    "class_data_dir": (("--class_images_dir", "--class_data_dir"),
        dict(type=abs_path, default=None, metavar="DIR",
             help="Folder of class (regularisation) images from generate.py; "
                  "giving it turns on prior preservation.")),
    "instance_prompt": (("--instance_prompt",),
        dict(required=True, help="Prompt with the unique identifier, e.g. 'photo of unqtkn dog'.")),
    "caption_extension": (("--caption_extension",),
        dict(default=".txt", metavar="EXT",
             help="A file beside an instance image with its stem and this extension (dog1.jpg -> dog1.txt) holds "
                  "that image's prompt instead of --instance_prompt. '' turns captions off.")),
    "class_prompt": (("--class_prompt",),
        dict(default=None, help="Prompt of the class images, e.g. 'photo of a dog'.")),
    "with_prior_preservation": (("--with_prior_preservation",),
        dict(action="store_true",
             help="Add the prior-preservation loss (implied by --class_data_dir).")),
    "prior_preservation": (("--prior_preservation",),
        dict(choices=["class_images", "prior_prediction"], default="class_images",
             help="How the class prompt's prior is kept. class_images (the paper's): train on class images "
                  "drawn by the base model (--class_data_dir). prior_prediction: no class images; each step "
                  "also trains the photos under --class_prompt towards the frozen base model's own prediction "
                  "for the same noisy latents (LoRA: the adapters switched off; full fine-tuning: a frozen "
                  "copy of the UNet in the autocast precision, SD 1.x 1.7 GB, SDXL 5.1 GB), so Step 3 is skipped.")),
    "prior_loss_weight": (("--prior_loss_weight",),
        dict(type=non_negative_float, default=1.0, help="Weight of the prior-preservation loss.")),
    # --- data
    "resolution": (("--resolution",),
        dict(type=resolution, default=None,
             help="Training/generation image size in pixels (multiple of 8). "
                  "Default: the model's native size (512 for SD 1.x).")),
    "center_crop": (("--center_crop",),
        dict(action="store_true", help="Center-crop training images (default: random crop).")),
    "enable_bucket": (("--enable_bucket",),
        dict(action="store_true",
             help="Aspect-ratio buckets (kohya's flag): each photo is resized to the bucket of its aspect ratio, "
                  "about --resolution squared pixels, instead of cropped to a square, so a tall or wide photo "
                  "keeps all of its subject; every batch is one bucket; class images are fitted to their "
                  "batch's bucket.")),
    "min_bucket_reso": (("--min_bucket_reso",),
        dict(type=positive_int, default=None, help="Shortest side of a bucket. Default: half the resolution.")),
    "max_bucket_reso": (("--max_bucket_reso",),
        dict(type=positive_int, default=None, help="Longest side of a bucket. Default: twice the resolution.")),
    "bucket_reso_steps": (("--bucket_reso_steps",),
        dict(type=positive_int, default=None,
             help="Buckets' sides are multiples of this (of the model's own size step too). Default: 64, "
                  "less for models under 512 px.")),
    "random_flip": (("--random_flip",),
        dict(action="store_true", help="Flip training images horizontally at random.")),
    # --- optimisation
    "train_text_encoder": (("--train_text_encoder",),
        dict(action=argparse.BooleanOptionalAction, default=True,
             help="Fine-tune the text encoder together with the UNet.")),
    "use_lora": (("--use_lora",),
        dict(action="store_true",
             help="Train LoRA adapters (peft) on the UNet's attention projections, and on the text encoder's "
                  "with --train_text_encoder, instead of every weight: output_dir then holds only "
                  "pytorch_lora_weights.safetensors, for the base model's load_lora_weights.")),
    "adapter": (("--adapter",),
        dict(type=str.lower, choices=ADAPTERS, default=None,
             help="The adapters to train (implies --use_lora), all through peft, with --rank and --lora_alpha: lora "
                  "(the default of --use_lora); dora (DoRA: each adapted weight's magnitude trained apart from its "
                  "direction; diffusers' --use_dora) on the denoiser, the text encoders' adapters LoRA (diffusers' "
                  "load_lora_weights drops their magnitudes); loha and lokr (LyCORIS' Hadamard and Kronecker "
                  "products), which generate.py, evaluate.py and sweep.py load through peft and export.py writes in "
                  f"LyCORIS' layout ({EXPORTED_LYCORIS}).")),
    "use_dora": (("--use_dora",),
        dict(action="store_true", help="The same as --adapter dora (diffusers' SDXL LoRA script's flag).")),
    "lora_rank": (("--rank", "--lora_rank"),
        dict(type=positive_int, default=4, help="LoRA rank (width of the adapters).")),
    "lora_alpha": (("--lora_alpha",),
        dict(type=positive_float, default=None,
             help="LoRA alpha: the adapters' output is scaled by alpha / rank. Default: the rank.")),
    "lora_dropout": (("--lora_dropout",),
        dict(type=non_negative_float, default=0.0, help="Dropout on the LoRA adapters' input.")),
    "train_batch_size": (("--train_batch_size",),
        dict(type=positive_int, default=1,
             help="Instance images per worker per step (as many class images are added).")),
    "learning_rate": (("--lr", "--learning_rate"),
        dict(type=positive_float, default=None,
             help="The learning rate. Default: 5e-6, or 1e-4 with --use_lora; 1.0 with --optimizer prodigy.")),
    "lr_warmup_steps": (("--lr_warmup_steps",),
        dict(type=non_negative_int, default=0, help="Optimizer steps of linear warm-up at the start of the schedule.")),
    "lr_scheduler": (("--lr_scheduler",),
        dict(choices=["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"],
             default="constant_with_warmup",
             help="Learning-rate schedule over the run's optimizer steps (diffusers.optimization); "
                  "'constant' ignores --lr_warmup_steps, as in diffusers.")),
    "lr_num_cycles": (("--lr_num_cycles",),
        dict(type=positive_int, default=1, help="Cosine cycles of cosine_with_restarts (hard restarts).")),
    "lr_power": (("--lr_power",), dict(type=positive_float, default=1.0, help="Power of the polynomial schedule.")),
    "scale_lr": (("--scale_lr",),
        dict(action="store_true",
             help="Multiply --learning_rate by the instance images of one optimizer step over all workers "
                  "(train_batch_size x gradient_accumulation_steps x num_workers).")),
    "offset_noise": (("--offset_noise",),
        dict(type=non_negative_float, nargs="?", const=0.1, default=0.0, metavar="SCALE",
             help="Add SCALE x a per-channel constant to the training noise (0.1 without a value, as "
                  "diffusers' flag): the model learns to make darker darks and brighter brights.")),
    "caption_dropout_rate": (("--caption_dropout_rate", "--caption_dropout"),
        dict(type=fraction, default=0.0, metavar="RATE",
             help="Train this share of the instance rows on the empty prompt instead of their caption or "
                  "--instance_prompt (drawn from the run's seeded random stream); class rows keep the class "
                  "prompt. The model then also learns the subject without its words, which helps "
                  "classifier-free guidance with captioned photos (--caption_dropout: diffusers' FLUX.2 [klein] "
                  "script's name). Default: 0 (off).")),
    "holdout": (("--holdout",),
        dict(type=non_negative_int, default=0, metavar="N",
             help="Keep the last N photos (in name order) out of training; evaluate.py --holdout N and sweep.py "
                  "--holdout N then also score DINO and CLIP-I against them, photos the model never saw (a model "
                  "that copies its training photos scores high on those, not on these). Default: 0.")),
    "masked_loss": (("--masked_loss",),
        dict(action="store_true",
             help="Weight each photo's loss by a mask: 'NAME.mask.png' beside 'NAME.jpg' (white counts, black "
                  "does not, gray in between; the photo's size), or else the photo's own transparency. The "
                  "background then teaches nothing: the subject is learnt, not the room it was photographed "
                  "in. Photos without a mask count everywhere; class images always do.")),
    "use_ema": (("--use_ema",),
        dict(action="store_true",
             help="Keep an exponential moving average of the trained weights (LoRA: of the adapters) on every "
                  "worker and in every checkpoint; validation samples and the saved model are the averaged "
                  "weights. Costs one more fp32 copy of the trained weights per worker (SD 1.x full: 3.9 GB).")),
    "ema_decay": (("--ema_decay",),
        dict(type=ema_decay, default=0.9999,
             help="Most weight the average keeps per step. It ramps up as (1 + n) / (10 + n) after n averaged "
                  "steps (diffusers' EMAModel warm-up), so a short DreamBooth run averages its recent steps "
                  "instead of keeping its start; 0: the average is the weights themselves.")),
    "ema_update_after_step": (("--ema_update_after_step",),
        dict(type=non_negative_int, default=0,
             help="Steps during which the average just follows the weights before it starts averaging.")),
    "snr_gamma": (("--snr_gamma",),
        dict(type=positive_float, default=None,
             help="Min-SNR loss weighting with this gamma (5.0 in the paper): low-noise timesteps weigh "
                  "less, which speeds up convergence. Default: off (plain MSE).")),
    "base_precision": (("--base_precision",),
        dict(choices=["int8", "nf4"], default=None,
             help="With --use_lora: keep the frozen denoiser quantised to int8 or nf4 (bitsandbytes) under the fp32 "
                  "adapters, for a card too small for it in bf16. Default: the autocast dtype (bf16 on GPUs).")),
    "text_encoder_precision": (("--text_encoder_precision",),
        dict(choices=["int8", "nf4"], default=None,
             help="With --use_lora: the frozen text encoders (those not trained: T5, Qwen's, Mistral 3, a CLIP "
                  "without --train_text_encoder) quantised to int8 or nf4 (bitsandbytes) while they compute the "
                  "prompts' states, for a card too small for them in bf16 (FLUX.2 [dev]'s 24 B Mistral 3: 45 GiB "
                  "in bf16, 22 in int8, 13 in nf4). The states differ a little from bf16's (nf4 more than int8). "
                  "Default: the autocast dtype (bf16 on GPUs).")),
    "weighting_scheme": (("--weighting_scheme",),
        dict(choices=["logit_normal", "mode", "cosmap", "sigma_sqrt", "none"], default=None,
             help=f"Flow-matching families ({FLOW_LABELS}): how training draws the noise level (logit_normal, "
                  "mode, none: uniform) or weighs the loss (cosmap, sigma_sqrt), as diffusers' scripts for them. "
                  f"Default: the family's ({FLOW_DEFAULTS}).")),
    "flow_shift": (("--flow_shift",),
        dict(type=positive_float, default=None, metavar="SHIFT",
             help="Flow-matching families: move the noise levels training draws towards the noisy end, "
                  "sigma -> SHIFT x sigma / (1 + (SHIFT - 1) x sigma) of the unshifted schedule (kohya's and "
                  "musubi-tuner's --discrete_flow_shift, SimpleTuner's --flow_schedule_shift; 3 is common for "
                  "Qwen-Image). Default: the model's scheduler, as diffusers' scripts train (SD 3.5: its shift of 3; "
                  "Flux.1 and Qwen-Image: no shift in training, theirs is resolution-dependent at drawing).")),
    "precondition_outputs": (("--precondition_outputs",),
        dict(type=int, choices=[0, 1], default=None,
             help="Flow-matching families: 1 measures the error on the clean latents the prediction implies "
                  "(noisy - sigma x prediction), as diffusers' SD 3 scripts do by default: each row's velocity "
                  f"error weighs sigma^2; 0 the velocity itself. Default: the family's ({FLOW_PRECONDITION}).")),
    "logit_mean": (("--logit_mean",),
        dict(type=float, default=0.0, help="--weighting_scheme logit_normal: the mean of the logit.")),
    "logit_std": (("--logit_std",),
        dict(type=positive_float, default=None,
             help=f"--weighting_scheme logit_normal: the spread of the logit. Default: the family's ({FLOW_LOGIT_STD}).")),
    "mode_scale": (("--mode_scale",),
        dict(type=float, default=1.29, help="--weighting_scheme mode: its scale.")),
    "allow_tf32": (("--allow_tf32",),
        dict(action="store_true",
             help="TF32 matmuls and convolutions on Ampere and later GPUs (faster fp32, ~10 mantissa bits).")),
    "set_grads_to_none": (("--set_grads_to_none",),
        dict(action="store_true", help="Accepted for diffusers' commands: gradients are always freed, not zeroed.")),
    "enable_xformers_memory_efficient_attention": (("--enable_xformers_memory_efficient_attention",),
        dict(action="store_true",
             help="Accepted for diffusers' commands: PyTorch's memory-efficient attention (SDPA) is always on.")),
    "num_class_images": (("--num_class_images",),
        dict(type=positive_int, default=None,
             help="As diffusers: before training, generate class images with the base model until "
                  "--class_data_dir holds this many (generate.py's pool, seeded by --seed).")),
    "optimizer": (("--optimizer",),
        dict(type=str.lower, choices=OPTIMIZERS, default="adamw",
             help="adamw (torch's); adamw8bit (bitsandbytes', state in a quarter of the memory: --use_8bit_adam); "
                  "prodigy (prodigyopt's: it finds its own step size, learning rate 1.0 by default); "
                  "adamw_schedulefree (schedulefree's: no schedule, it warms up over --lr_warmup_steps itself and "
                  "validation samples and the saved model get its averaged weights). Either spelling of diffusers' "
                  "names (AdamW, prodigy).")),
    "use_8bit_adam": (("--use_8bit_adam",),
        dict(action="store_true", help="The same as --optimizer adamw8bit (replaces --fused_adamw).")),
    "prodigy_beta3": (("--prodigy_beta3",),
        dict(type=positive_float, default=None,
             help="Prodigy's beta3, the average of its step-size estimate. Default: the square root of --adam_beta2 "
                  "(Prodigy's own).")),
    "prodigy_decouple": (("--prodigy_decouple",),
        dict(type=_switch, nargs="?", const=True, default=True, metavar="on|off",
             help="Prodigy's weight decay decoupled from the gradient, as AdamW's (diffusers' default); off as diffusers writes it too: =False.")),
    "prodigy_use_bias_correction": (("--prodigy_use_bias_correction",),
        dict(type=_switch, nargs="?", const=True, default=True, metavar="on|off",
             help="Prodigy's Adam bias correction (diffusers' default); off as diffusers writes it too: =False.")),
    "prodigy_safeguard_warmup": (("--prodigy_safeguard_warmup",),
        dict(type=_switch, nargs="?", const=True, default=True, metavar="on|off",
             help="Prodigy's step size kept from growing during the learning-rate warm-up (diffusers' default); off as diffusers writes it too: =False.")),
    "adam_beta1": (("--adam_beta1",), dict(type=float, default=0.9, help="AdamW beta1.")),
    "adam_beta2": (("--adam_beta2",), dict(type=float, default=0.999, help="AdamW beta2.")),
    "adam_weight_decay": (("--adam_weight_decay",),
        dict(type=non_negative_float, default=1e-2, help="AdamW weight decay.")),
    "adam_epsilon": (("--adam_epsilon",), dict(type=positive_float, default=1e-8, help="AdamW epsilon.")),
    "max_grad_norm": (("--max_grad_norm",), dict(type=positive_float, default=1.0, help="Gradient clipping norm.")),
    "max_train_steps": (("--max_train_steps",),
        dict(type=positive_int, default=None,
             help="Optimizer steps to train. Default: --num_train_epochs' worth if given, else 800. "
                  "Given with --num_train_epochs, this wins (as in diffusers), and a line says so.")),
    "num_train_epochs": (("--num_train_epochs", "--num_epochs"),
        dict(type=positive_int, default=None,
             help="Passes over the data, when --max_train_steps is not given (see --max_train_steps).")),
    "gradient_accumulation_steps": (("--gradient_accumulation_steps",),
        dict(type=positive_int, default=1, help="Batches per optimizer step (larger effective batch).")),
    "gradient_checkpointing": (("--gradient_checkpointing",),
        dict(action="store_true", help="Recompute activations in backward: much less memory, ~30%% slower.")),
    "cache_latents": (("--cache_latents",),
        dict(action="store_true",
             help="Encode every training image with the VAE once, before training, instead of every step "
                  "(implies --center_crop; with --random_flip both views are cached).")),
    "precompute_text_embeddings": (("--precompute_text_embeddings", "--pre_compute_text_embeddings"),
        dict(action=argparse.BooleanOptionalAction, default=True,
             help="With a frozen text encoder, compute the prompt embeddings once, not every step.")),
    "torch_compile": (("--torch_compile",),
        dict(nargs="?", const="inductor", default=None, metavar="BACKEND",
             help="torch.compile the UNet (slow first steps, faster after); optionally name the "
                  "backend (default inductor; aot_eager compiles in seconds, for checks).")),
    "fsdp": (("--fsdp",),
        dict(action="store_true",
             help="Shard the denoiser's weights, gradients and AdamW state across the workers (PyTorch's FSDP, "
                  "fully_shard per block) instead of a copy on each: a full fine-tune of a model no single card "
                  "holds (Flux.1's 12 B transformer, SD 3.5 large), over --num_workers GPUs. The denoiser only "
                  "(--no-train_text_encoder), without --use_lora (adapters fit one card: DDP is faster), "
                  "--use_ema, an --optimizer other than adamw, --torch_compile or fp16.")),
    "channels_last": (("--channels_last",),
        dict(action=argparse.BooleanOptionalAction, default=None,
             help="UNet and VAE in channels-last memory layout (NHWC convolutions). Default: on with GPUs.")),
    "fused_adamw": (("--fused_adamw",),
        dict(action=argparse.BooleanOptionalAction, default=True,
             help="AdamW's fused kernel (one kernel for all parameters; GPU and CPU).")),
    "gpus_per_worker": (("--gpus_per_worker",),
        dict(type=int, choices=[1, 2], default=1,
             help="GPUs per Ray Train worker. 2: UNet on the first, text encoder and VAE on the second "
                  "(full fine-tuning with fp32 AdamW state on 24 GB cards), as in Ray's AIR example.")),
    "mixed_precision": (("--mixed_precision",),
        dict(choices=["no", "fp16", "bf16"], default=None,
             help="Autocast precision over fp32 master weights (fp16 adds loss scaling). Default: bf16 on "
                  "GPUs that support it natively, fp16 on older GPUs, no on CPU.")),
    "seed": (("--seed",), dict(type=int, default=0, help="Random seed.")),
    # --- Ray
    "num_workers": (("--num_workers",),
        dict(type=non_negative_int, default=None,
             help="Ray Train workers, one GPU each (two with --gpus_per_worker 2). 0: no workers, the training "
                  "function runs in this process (Ray Train's local mode) as one worker would: a debugger's "
                  "breakpoints stop in it; no restarts, no --min_workers, --fsdp or --score_steps. Default: as "
                  "many as the Ray cluster's GPUs hold; 1 without GPUs.")),
    "min_workers": (("--min_workers",),
        dict(type=positive_int, default=None, metavar="N",
             help="Elastic training: go on with as few as N workers while nodes are gone (a spot node reclaimed), "
                  "and grow back to --num_workers when they return, instead of waiting for all of them. Each "
                  "step trains the same rows on any number of workers (--num_workers x "
                  "--gradient_accumulation_steps batches, the accumulation taking up what fewer workers leave), so "
                  "the result does not depend on how many it had. Default: --num_workers (no change of size).")),
    "resources_per_worker": (("--resources_per_worker",),
        dict(type=resources_flag, default=None, metavar="NAME=N[,NAME=N]",
             help="Ray resources of your own that each worker reserves beside its CPUs and GPUs (ray start "
                  "--resources='{\"trainer\": 1}' on the nodes to train on): keeps the workers on those nodes, "
                  "one per unit.")),
    "elastic_resize_interval": (("--elastic_resize_interval",),
        dict(type=float, default=60.0, metavar="SECONDS",
             help="With --min_workers: how often the run looks for returned nodes to grow onto (a resize restarts "
                  "the workers from the newest checkpoint).")),
    "use_gpu": (("--use_gpu",),
        dict(action=argparse.BooleanOptionalAction, default=None,
             help="Train on GPUs. Default: yes if the Ray cluster has GPUs.")),
    "storage_path": (("--storage_path",),
        dict(type=storage_location, default=None, metavar="DIR|URI",
             help="Ray Train storage (checkpoints, run state): shared storage on a cluster, or a bucket "
                  "(s3://bucket/prefix; AWS_ENDPOINT_URL for MinIO/R2/Ceph; gs://…). "
                  "Default: ray_results/ beside --output_dir.")),
    # --- logging and checkpoints
    "report_to": (("--report_to",),
        dict(choices=["none", "tensorboard", "wandb", "mlflow", "all"], default="none",
             help="Also send the run's settings, loss, learning rate, images/s and validation images to: "
                  "tensorboard (events in the run folder's tensorboard/), wandb (a W&B run; offline in the run "
                  "folder when there is no API key or no network: wandb sync later), mlflow (MLFLOW_TRACKING_URI, "
                  "default a SQLite store mlflow.db under --storage_path), or all. evaluate.py adds the model's "
                  "scores to the same W&B/MLflow run. metrics.jsonl and loss.png are always written.")),
    "tracker_project_name": (("--tracker_project_name",),
        dict(default=None, metavar="NAME",
             help="The W&B project or MLflow experiment of --report_to. Default: WANDB_PROJECT (W&B) or "
                  "MLFLOW_EXPERIMENT_NAME (MLflow) when set, else dreambooth.")),
    "notify_url": (("--notify_url",),
        dict(type=webhook_url, default=None, metavar="URL",
             help="POST a JSON message to this webhook when the run starts, finishes (with its result) or fails "
                  "(with its cause): Slack and Discord webhooks take it as it is. Never written to a file or log.")),
    "validation_prompt": (("--validation_prompt",),
        dict(type=one_prompt, action="append", default=None, metavar="PROMPT",
             help="Sample this prompt during training with the current weights (one prompt, commas and all; "
                  "repeat the flag for several): images and a timeline sheet in the run folder's validation/.")),
    "num_validation_images": (("--num_validation_images",),
        dict(type=positive_int, default=4, help="Images per validation prompt, each from its own fixed seed.")),
    "validation_epochs": (("--validation_epochs",),
        dict(type=positive_int, default=None,
             help="Sample every N epochs instead (diffusers' SDXL LoRA script's spelling): N x the steps of "
                  "one epoch.")),
    "vae_dir": (("--pretrained_vae_model_name_or_path", "--vae_dir"),
        dict(default=None, metavar="VAE",
             help="Train (and cache latents, and sample) with this VAE instead of the model's: a folder with "
                  "config.json and the weights, or a hub name in the hub cache (e.g. SDXL's fp16-fix VAE, whose "
                  "fp16 activations do not overflow). A full model's output keeps it; LoRA adapters do not carry "
                  "a VAE.")),
    "validation_steps": (("--validation_steps",),
        dict(type=positive_int, default=None, help="Sample every N steps (and at the end). Default: "
                                                   "--checkpointing_steps.")),
    "validation_inference_steps": (("--validation_inference_steps",),
        dict(type=positive_int, default=25, help="Denoising steps per validation image (and per image "
                                                 "--score_steps scores).")),
    "score_steps": (("--score_steps",),
        dict(type=positive_int, default=None, metavar="N",
             help="Score the model every N steps (and at the end) as evaluate.py does: DINO, CLIP-I and CLIP-T of "
                  "its images of the evaluation prompts against your photos, from that step's checkpoint, while "
                  "the training goes on (Ray Train's validation, a task of its own). Each step's scores go to "
                  "metrics.jsonl, the trackers and a line of the output; its images and report to "
                  "scores/step-N/ in the run folder. Needs --eval_models_dir (cache_model.py --eval_models) and "
                  "--class_name.")),
    "keep_best": (("--keep_best",),
        dict(action="store_true",
             help="Save the model of the best-scored step instead of the last (with --score_steps): the highest DINO "
                  "among the scored steps whose CLIP-T is at most --clip_t_margin below the base model's, the rule "
                  "sweep.py picks by. Its record (dreambooth_training.json) says which step and why.")),
    "logging_steps": (("--logging_steps",),
        dict(type=positive_int, default=10, help="Report loss, lr and images/s every N steps.")),
    "checkpointing_steps": (("--checkpointing_steps",),
        dict(type=positive_int, default=500, help="Save a resumable Ray checkpoint every N steps.")),
    "checkpoints_total_limit": (("--checkpoints_total_limit",),
        dict(type=positive_int, default=1,
             help="Keep only the newest K checkpoints while the run trains (default 1, all a resume needs; "
                  "a full SD 1.x checkpoint is about 12 GB, a LoRA one a few MB).")),
    "checkpoint_upload": (("--checkpoint_upload",),
        dict(choices=("auto", "sync", "async"), default="auto",
             help="How a checkpoint reaches --storage_path: 'async' uploads it in the background while training goes "
                  "on (Ray Train's CheckpointUploadMode.ASYNC), 'sync' waits for it; 'auto' (the default): async to a "
                  "bucket, sync to a folder (where a full disk stops the run at once). A resume only takes a checkpoint "
                  "whose every file arrived.")),
    "keep_checkpoints": (("--keep_checkpoints",),
        dict(action="store_true",
             help="Keep the run's checkpoints once its model is saved (default: removed then, their disk freed; "
                  "keep them to continue the run with more --max_train_steps later).")),
    "resume_from_checkpoint": (("--resume_from_checkpoint",),
        dict(default=None, metavar="latest|auto|PATH",
             help="Continue a run from its newest checkpoint ('latest') or a checkpoint folder. 'auto': only "
                  "a run of this --output_dir that did not finish (a crash), else start afresh; "
                  "dreambooth_run.sh passes it, so a rerun continues where a crash stopped it.")),
    "max_failures": (("--max_failures",),
        dict(type=non_negative_int, default=3,
             help="Restart the worker group up to N times from the last checkpoint when a worker dies.")),
    "max_preemption_failures": (("--max_preemption_failures",),
        dict(type=int, default=-1, metavar="N",
             help="Restart the worker group up to N times when a node is preempted (a spot reclaim, a drain), counted "
                  "apart from --max_failures, which is kept for real failures; -1 (the default): every time.")),
    "stall_timeout": (("--stall_timeout",),
        dict(type=non_negative_float, default=None, metavar="SECONDS",
             help="End the run in one line when a worker has waited this long for its next step's data (the cluster "
                  "has nothing left to run the data stream on: a lost node, every CPU held), naming what Ray reports "
                  "as pending; its newest checkpoint is kept to continue from. 0: wait forever. Default: 5 times "
                  "the slowest step so far, at least 10 minutes.")),
    "overwrite": (("--overwrite",),
        dict(action="store_true", help="Allow writing into a non-empty folder that is not ours.")),
    "allow_unsafe_weights": (("--allow_unsafe_weights",),
        dict(action="store_true",
             help="Also load pickled .bin weights (they can run code when loaded); default: safetensors only.")),
    # --- generation
    "prompts": (("--prompts",),
        dict(type=one_prompt, nargs="+", default=None, action="extend", metavar="PROMPT",
             help="The prompts to draw: each value is one prompt, commas and all (--prompts 'a dog, oil "
                  "painting' 'a cat'); repeat the flag or use --prompts_file for more.")),
    "prompts_file": (("--prompts_file",),
        dict(type=abs_path, default=None, metavar="FILE",
             help="More prompts: one per line ('#' lines are comments).")),
    "force": (("--force",),
        dict(action="store_true",
             help="Delete the images already in --output_dir (drawn by another model or with other settings, "
                  "as its record says) and draw these; without it such a folder is an error, never a mix.")),
    "class_images": (("--class_images",),
        dict(action="store_true",
             help="The images are class images for training (dreambooth_run.sh's Step 3): images already in "
                  "--output_dir from the same model, prompt and size are kept even when drawn with other steps, "
                  "guidance or seed (what training reads is the same).")),
    "num_samples_per_prompt": (("--num_samples_per_prompt", "--num_class_images"),
        dict(type=positive_int, default=1,
             help="Images per prompt; existing ones are kept, only the missing are made.")),
    "batch_size": (("--batch_size",),
        dict(type=positive_int, default=4, help="Images per forward pass on one actor.")),
    "num_inference_steps": (("--num_inference_steps",),
        dict(type=positive_int, default=50, help="Denoising steps per image.")),
    "guidance_scale": (("--guidance_scale",),
        dict(type=non_negative_float, default=None,
             help=f"Guidance scale: classifier-free guidance (Qwen-Image: its true_cfg_scale, against the negative "
                  f"prompt ' ' unless --negative_prompt is given); for the guidance-distilled models of {GUIDED} "
                  "(Flux.1 dev: schnell has none), the transformer's guidance input, in training too (train.py, as diffusers' scripts for them), where "
                  "for the other families it sets only the validation samples'. Default: the model family's "
                  f"({GUIDANCE_DEFAULTS}).")),
    "negative_prompt": (("--negative_prompt",), dict(default=None, help="What to steer away from.")),
    "num_actors": (("--num_actors",),
        dict(type=positive_int, default=None,
             help="Size of the Ray Data actor pool. Default: one per GPU in the cluster, "
                  "or one CPU actor without GPUs.")),
    "safety_checker": (("--safety_checker",),
        dict(choices=["auto", "on", "off"], default="auto",
             help="Run the model's safety checker (if it has one). auto: off for a base model (class "
                  "images, as diffusers does: a flagged image would be a black training image), on for a "
                  "model train.py wrote. Flagged images are not saved, and a line says so.")),
    "lora_dir": (("--lora_dir", "--lora_weights_dir"),
        dict(type=storage_location, default=None, metavar="DIR",
             help="Folder of LoRA adapters (pytorch_lora_weights.safetensors, as train.py --use_lora writes) "
                  "to apply to --model_dir. Passing that folder as --model_dir does the same, with the base "
                  "model it was trained on.")),
    "lora_scale": (("--lora_scale",),
        dict(type=float, default=1.0, help="Strength of the LoRA adapters (0: the base model).")),
    "use_ray_data": (("--use_ray_data",),
        dict(action="store_true",
             help="Accepted for compatibility with Ray's example: generation always runs on Ray Data.")),
    # --- evaluation
    "base_model_dir": (("--base_model_dir",),
        dict(type=model_path, default=None, metavar="DIR",
             help="Base model to score beside the tuned one (default: the one train.py recorded; "
                  "for a LoRA, the model it applies to).")),
    "unique_token": (("--unique_token",),
        dict(default="unqtkn",
             help="The identifier the subject was trained with (removed from the prompts for CLIP-T).")),
    "class_name": (("--class_name",),
        dict(required=True, help="The subject's class as in the class prompt: dog, backpack, person.")),
    "subject_type": (("--subject_type",),
        dict(choices=("object", "live"), default=None,
             help="Prompt set: 25 prompts for objects, or 25 for pets and people (accessories, poses). Default: "
                  "live for a pet or a person (--class_name dog, cat, person, ...), else object.")),
    "eval_prompts": (("--eval_prompts",),
        dict(type=abs_path, default=None, metavar="FILE",
             help="Your own prompt set: one prompt per line with '{subject}' where '<token> <class>' goes.")),
    "eval_models_dir": (("--eval_models_dir",),
        dict(type=abs_path, required=True, metavar="DIR",
             help="Folder with dino/ (a ViT, e.g. facebook/dino-vits16) and clip/ (a CLIPModel) in "
                  "transformers' format.")),
    # --- sweep
    "subjects_dir": (("--subjects_dir",),
        dict(type=abs_path, default=None, metavar="DIR",
             help="Many subjects in one job: one sub-folder per subject with its photos and a subject.json "
                  "({\"class_name\": \"dog\", \"unique_token\": \"unqtkn\", \"subject_type\": \"live\"}; "
                  "token and type default to the flags; the type, else to the class's). Instead of "
                  "--instance_data_dir and --class_name.")),
    "sweep_learning_rate": (("--sweep_learning_rate",),
        dict(type=float_list, default=None, metavar="LR,LR,...",
             help="Learning rates to try (grid), or with --search random the range to draw from "
                  "log-uniformly. Default: train.py's --learning_rate.")),
    "sweep_max_train_steps": (("--sweep_max_train_steps",),
        dict(type=int_list, default=None, metavar="N,N,...",
             help="Step counts to score: each trial trains to the largest and scores its checkpoints at the "
                  "others too (no extra training). Default: 400.")),
    "sweep_rank": (("--sweep_rank",),
        dict(type=int_list, default=None, metavar="R,R,...", help="LoRA ranks to try (with --use_lora).")),
    "sweep_train_text_encoder": (("--sweep_train_text_encoder",),
        dict(type=bool_list, default=None, metavar="on,off",
             help="Try training the text encoder, freezing it, or both ('on,off').")),
    "eval_images_per_prompt": (("--eval_images_per_prompt",),
        dict(type=positive_int, default=4, help="Images per evaluation prompt and model (the paper: 4).")),
    "search": (("--search",),
        dict(choices=("grid", "random"), default="grid",
             help="grid: every combination of the values; random: --num_trials draws.")),
    "num_trials": (("--num_trials",),
        dict(type=positive_int, default=4, help="Trials per subject with --search random.")),
    "early_stopping": (("--early_stopping",),
        dict(choices=("auto", "on", "off"), default="auto",
             help="Stop trials that are behind (Ray Tune's ASHA scheduler): each step count is scored while its "
                  "trial trains on (DINO, counted only with CLIP-T within --clip_t_margin of the base model's); a "
                  "trial in the bottom half of its subject's trials at a step count stops there. auto: on for random "
                  "search and for grids of more than 4 trials; off for small grids (every trial then trains to the "
                  "last step count, every step count of each scored). Needs 2 or more --sweep_max_train_steps.")),
    "clip_t_margin": (("--clip_t_margin",),
        dict(type=non_negative_float, default=0.02,
             help="The best trial has the highest DINO among those whose CLIP-T is at most this far below "
                  "the base model's (a model that only repeats its photos scores high DINO, low CLIP-T).")),
    "sweep_dir": (("--sweep_dir",),
        dict(type=abs_path, default=None, metavar="DIR",
             help="The sweep's working folder: trials, class images, scores, Tune's state (a rerun resumes "
                  "it); a folder, or a bucket's (s3://bucket/prefix, gs://…: trials on any node write there). "
                  "Default: --output_dir with '-sweep' appended.")),
    "max_concurrent_trials": (("--max_concurrent_trials",),
        dict(type=positive_int, default=None,
             help="Trials at once. Default: as many as the cluster's GPUs hold (--num_workers x "
                  "--gpus_per_worker each); one on a cluster without GPUs.")),
    # --- export
    "output_file": (("--output_file", "--checkpoint_path"),
        dict(type=storage_location, required=True, metavar="FILE|URI",
             help="The .safetensors file to write (--checkpoint_path: the name in diffusers' conversion "
                  "script); a bucket's (s3://bucket/key.safetensors, gs://…) is written here, then copied there.")),
    "save_precision": (("--save_precision",),
        dict(choices=("fp16", "bf16", "fp32"), default="fp16",
             help="Precision of the weights in the file: fp16 halves it (what A1111 and ComfyUI load "
                  "anyway), fp32 keeps the trained weights exactly.")),
    # --- serve.py
    "serve_data_prefix": (("--data_prefix",),
        dict(dest="data_prefix", type=storage_location, default=None,
             help="Where dreambooth_run.sh wrote its subjects (DATA_PREFIX: a folder, or a bucket's); their models "
                  "in <data_prefix>/subjects/<SUBJECT>/model-tuned are served. Default: $DATA_PREFIX.")),
    "host": (("--host",),
        dict(default="127.0.0.1",
             help="Where the HTTP server listens. Default 127.0.0.1: this machine only. 0.0.0.0: every "
                  "interface (a line says who can reach it; add --api_key).")),
    "port": (("--port",), dict(type=positive_int, default=8000, help="The HTTP port.")),
    "api_key": (("--api_key",),
        dict(default=None,
             help="A key every request must carry ('Authorization: Bearer <key>'; GET /healthz excepted). Default: "
                  "$DREAMBOOTH_API_KEY (better than the flag: a command line is visible to every local user).")),
    "adapters_per_replica": (("--adapters_per_replica",),
        dict(type=positive_int, default=4,
             help="Subjects' adapters a replica holds at once (Ray Serve's multiplexing; the least recently used "
                  "one goes). Each is a few MB; the base model is loaded once per replica.")),
    "min_replicas": (("--min_replicas",),
        dict(type=positive_int, default=1, help="Replicas of each base model kept when idle.")),
    "max_replicas": (("--max_replicas",),
        dict(type=positive_int, default=1,
             help="Replicas each base model may scale up to as its queue grows (Ray Serve's autoscaling).")),
    "gpus_per_replica": (("--gpus_per_replica",),
        dict(type=non_negative_float, default=None,
             help="GPUs each replica reserves. Default: 1 where the cluster has GPUs, else 0 (CPU).")),
    "max_images_per_request": (("--max_images_per_request",),
        dict(type=positive_int, default=4, help="The most images one request may ask for (n); more: 400.")),
    "max_batch_size": (("--max_batch_size",),
        dict(type=positive_int, default=4,
             help="Requests a replica draws together (Ray Serve's batching; those of one subject and settings in "
                  "one call of the pipeline).")),
    "rescan_interval": (("--rescan_interval",),
        dict(type=positive_float, default=5.0,
             help="Seconds between looks for subjects on a base model not served yet (a new subject on a served "
                  "base is served at once).")),
    # --- preflight.py (dreambooth_run.sh's Step 0): the script's variables, by name
    "photos_dir": (("--photos_dir",),
        dict(type=storage_location, required=True,
             help="The subject's photos (INSTANCE_DIR or the script's own folder; a folder or a bucket's).")),
    "photos_var": (("--photos_var",),
        dict(default="INSTANCE_DIR", help="The variable that set --photos_dir, as the error lines name it.")),
    "preflight_class_name": (("--class_name",), dict(dest="class_name", default=None, help="CLASS_NAME.")),
    "data_prefix": (("--data_prefix",),
        dict(type=storage_location, required=True,
             help="DATA_PREFIX: where everything is written (a folder, or a bucket's: s3://bucket/prefix).")),
    "model_path": (("--model_path",), dict(default=None, help="The base model's folder, if already cached.")),
    "tuned_model_dir": (("--tuned_model_dir",),
        dict(type=storage_location, default=None,
             help="TUNED_MODEL_DIR: a model of another family or mode there is said now (Step 4 replaces it).")),
    "model_cache": (("--model_cache",),
        dict(type=storage_location, default=None,
             help="ORIG_MODEL_DIR: the model cache Step 1 fills (a model already there is not counted again).")),
    "preflight_stage": (("--stage",),
        dict(dest="stage", choices=["all", "files", "cluster"], default="all",
             help="files: what needs no Ray (the flags, CLASS_NAME, the photos and their captions, the model's name, "
                  "the disk), before the script starts its cluster; cluster: the rest (GPUs, workers, shared "
                  "storage), once it runs; all: both.")),
    "preflight_num_workers": (("--num_workers",),
        dict(dest="num_workers", default="", help="NUM_WORKERS ('' or 0: one per GPU).")),
    "gpu_memory": (("--gpu_memory",),
        dict(type=float, default=None, metavar="GIB",
             help="GPU_MEMORY: check the training against cards with this many GiB free instead of asking the "
                  "GPUs (plan for a card this machine lacks, or while its GPUs are busy).")),
}


_UPLOAD = "upload the result yourself when training ends: hf upload <repo id> $OUTPUT_DIR"
_IF_ONLY = "a DeepFloyd IF option; this suite trains Stable Diffusion 1.x, whose CLIP text encoder needs none"
# The flags of diffusers' train_dreambooth.py that train.py does not take, and what to do
# instead: a command that has one stops with that line, not with "unrecognized arguments".
REFUSED = {
    "--push_to_hub": _UPLOAD, "--hub_model_id": _UPLOAD, "--hub_token": _UPLOAD,
    "--revision": "cache the model at that revision with cache_model.py --revision and pass the snapshot "
                  "folder it prints as --pretrained_model_name_or_path",
    "--variant": "weights load as the model folder holds them (fp32 safetensors from cache_model.py); "
                 "--mixed_precision sets the compute precision",
    "--tokenizer_name": "the tokenizer is read from the model folder's tokenizer/",
    "--sample_batch_size": "class images are generated with the run's settings; to choose the batch, make them "
                           "first with generate.py --batch_size",
    "--prior_generation_precision": "class images are generated in fp16 on GPUs and fp32 on CPUs; "
                                    "generate.py makes them",
    "--local_rank": "Ray Train starts and ranks the workers: set --num_workers",
    "--logging_dir": "tracker files go to the run folder under --storage_path (TensorBoard's tensorboard/, "
                     "W&B's wandb/); MLFLOW_TRACKING_URI sets MLflow's store",
    "--dataloader_num_workers": "Ray Data decodes and batches the images on the cluster's CPUs",
    "--validation_scheduler": "validation samples use the model's own scheduler, as generate.py does",
    "--validation_images": _IF_ONLY, "--class_labels_conditioning": _IF_ONLY,
    "--text_encoder_use_attention_mask": _IF_ONLY, "--tokenizer_max_length": _IF_ONLY,
    "--skip_save_text_encoder": _IF_ONLY,
}
# diffusers' train_dreambooth_lora_sdxl.py adds these (its other flags are train_dreambooth.py's):
_ONE_LR = "one learning rate and weight decay for every trained weight (--learning_rate, --adam_weight_decay)"
_FOLDER = ("photos come from a folder (--instance_data_dir), captions from .txt files beside them "
           "(--caption_extension)")
REFUSED_SDXL = {
    "--adam_weight_decay_text_encoder": _ONE_LR, "--text_encoder_lr": _ONE_LR,
    "--cache_dir": "models are fetched into the hub cache by cache_model.py (HF_HUB_CACHE sets where)",
    "--dataset_name": _FOLDER, "--dataset_config_name": _FOLDER, "--caption_column": _FOLDER,
    "--image_column": _FOLDER,
    "--do_edm_style_training": "EDM-style training (Playground v2.5) is not offered; SD 1.x, 2.x and SDXL train "
                               "with their schedulers' own objective",
    "--image_interpolation_mode": "photos are resized with bicubic interpolation",
    "--output_kohya_format": "export.py writes the kohya-format file after training: python export.py "
                             "--model_dir OUTPUT_DIR --output_file my-lora.safetensors",
    "--repeats": "--num_train_epochs or --max_train_steps set how often each photo is seen",
}
REFUSED.update(REFUSED_SDXL)
# ... and diffusers' train_dreambooth_lora_sd3.py / _flux.py these:
_LAYERS = "LoRA adapts the layers diffusers' scripts adapt by default (each family's denoiser_lora_targets)"
REFUSED.update({
    "--max_sequence_length": "T5 reads the family's length in training and drawing alike (diffusers' defaults: "
                             "SD 3.5 77 tokens, Flux.1 512)",
    "--lora_layers": _LAYERS, "--lora_blocks": _LAYERS,
    "--upcast_before_saving": "the adapters train and are saved in fp32",
    "--enable_npu_flash_attention": "Ascend NPUs are not supported; CUDA GPUs use PyTorch's fused attention",
})
# ... and diffusers' train_dreambooth_lora_flux2.py / _flux2_klein.py these:
_BUCKETS = "--enable_bucket sorts the photos into aspect-ratio buckets (--min_bucket_reso, --max_bucket_reso, " \
           "--bucket_reso_steps)"
_FROZEN_TEXT = "the frozen text encoders compute the prompts' states once and leave the GPU; " \
               "--text_encoder_precision int8|nf4 quantises them for a smaller card"
REFUSED.update({
    "--aspect_ratio_buckets": _BUCKETS, "--use_aspect_ratio_buckets": _BUCKETS,
    "--bnb_quantization_config_path": "--base_precision int8|nf4 quantises the frozen transformer with bitsandbytes "
                                      "(and --text_encoder_precision the frozen text encoders)",
    "--do_fp8_training": "fp8 training is not offered; --base_precision int8|nf4 quantises the frozen base under "
                         "the adapters",
    "--final_validation_prompt": "generate.py draws the trained model (dreambooth_run.sh's Step 5); "
                                 "--validation_prompt draws samples while training",
    "--skip_final_inference": "train.py draws nothing after training (generate.py does: Step 5)",
    "--fsdp_text_encoder": "the text encoders are frozen; --fsdp shards the transformer",
    "--offload": _FROZEN_TEXT, "--remote_text_encoder": _FROZEN_TEXT,
    "--text_encoder_out_layers": "each family reads its text encoder's own layers, as its pipeline does (FLUX.2 "
                                 "[klein]: 9, 18, 27; [dev]: 10, 20, 30), in training and drawing alike",
})


def option_strings(names):
    """Every spelling of the named flags (their options, and --no-X of on/off switches)."""
    spellings = []
    for name in names:
        options, kwargs = FLAGS[name]
        spellings += options
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            spellings += ["--no-" + o[2:] for o in options]
    return tuple(spellings)


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {REFUSED[option_string]}")


def normalize_option(token):
    """'--num-workers=4' -> '--num_workers=4', '--no-train-text-encoder' -> '--no-train_text_encoder':
    every flag also answers to its hyphenated spelling (Ray's docs write --num-workers)."""
    if not token.startswith("--") or token == "--":
        return token
    name, sep, value = token.partition("=")
    negated = name.startswith("--no-")
    body = name[5:] if negated else name[2:]
    return ("--no-" if negated else "--") + body.replace("-", "_") + sep + value


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default shown once: added as '(default: X)' unless its help already says
    what the default is (a default worked out at run time, e.g. 'Default: the model's size')."""

    def _get_help_string(self, action):
        text = action.help or ""
        if isinstance(action, argparse.BooleanOptionalAction) and "default" not in text.lower():
            return f"{text} (default: {'on' if action.default else 'off'})"
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
            return text
        return text + " (default: %(default)s)"


# --config's example keys, the first three that a script has (a key of another script's is refused)
CONFIG_EXAMPLES = {"model_dir": 'model_dir = "..."', "max_train_steps": "max_train_steps = 400",
                   "sweep_learning_rate": "sweep_learning_rate = [1e-6, 5e-6]", "prompts": 'prompts = ["..."]',
                   "num_samples_per_prompt": "num_samples_per_prompt = 8", "validation_prompt": 'validation_prompt = ["..."]'}


def config_help(names):
    """--config's help, its example keys among names (the script's own flags)."""
    shown = ", ".join([CONFIG_EXAMPLES[n] for n in CONFIG_EXAMPLES if n in names][:3])
    return (f"TOML file of flag values, keys named as the flags ({shown}); the command line wins. Every run "
            f"writes one beside its outputs that repeats it.")
NOT_WRITTEN = ("config", "help", "resume_from_checkpoint", "notify_url")  # a repeated run starts afresh;
# a webhook URL is a secret (it is its own key)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage before an error; we print one line. Options may be
    spelled with hyphens or underscores, and only in full: argparse's prefix matching would take a misspelt
    --learning_rat for --learning_rate, so a typo is an error that names the closest flag. With --config FILE, the
    file's values come first and the command line's after them, so the command line wins."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = [normalize_option(a) for a in (sys.argv[1:] if args is None else list(args))]
        # the flags typed (a config file's values are not: the file may hold every flag of a run)
        self.typed = {self._option_string_actions[t.split("=")[0]].dest for t in args
                      if t.split("=")[0] in self._option_string_actions}
        if any(a.dest == "config" for a in self._actions):
            args = self._config_tokens(args) + args
        # the flags the user gave (command line or --config), as config_text tells them from derived ones
        self.given = {self._option_string_actions[t.split("=")[0]].dest for t in args
                      if t.split("=")[0] in self._option_string_actions}
        self.words = args
        return super().parse_known_args(args, namespace)

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            message += closest_flags(message.split(": ", 1)[1].split(), self._option_string_actions)
            message += self._equals_hint()
        elif message.startswith("the following arguments are required"):  # (argparse says this first: a misspelt
            # required flag, or any typo, would go unnamed)
            unknown = [word for word in getattr(self, "words", ()) if word.startswith("--") and
                       word.split("=")[0] not in self._option_string_actions]
            if unknown:
                message = (f"unrecognized arguments: {' '.join(unknown)}"
                           f"{closest_flags(unknown, self._option_string_actions)} (and {message})")
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def _equals_hint(self):
        """' (--prompts=… takes the one value after '='; …)' when a word left over follows a flag of several values
        given as --flag=value (argparse then takes no more values for it), else ''."""
        words = getattr(self, "words", [])
        for before, word in zip(words, words[1:]):
            flag = before.split("=", 1)[0]
            action = self._option_string_actions.get(flag)
            if "=" in before and action is not None and action.nargs in ("+", "*") and not word.startswith("-"):
                return f" ({flag}=… takes the one value after '='; for several: {flag} \"…\" \"…\")"
        return ""

    def _action_for(self, key):
        for action in self._actions:
            if action.dest == key or f"--{key}" in action.option_strings:
                return action
        return None

    def _config_tokens(self, args):
        """The --config file's values as command-line tokens (before the command line's own)."""
        path = None
        for i, token in enumerate(args):
            if token == "--config" and i + 1 < len(args):
                path = args[i + 1]
            elif token.startswith("--config="):
                path = token.split("=", 1)[1]
        if path is None:
            return []
        import tomllib

        try:
            if path.startswith(("s3://", "gs://")):  # (sweep.py's in a bucket)
                from dreambooth import storage

                values = tomllib.loads(storage.read_bytes(path).decode())
            else:
                values = tomllib.loads(files.read_user_text(os.path.expanduser(path), "--config"))
        except errors.UserError as err:
            self.error(str(err))
        except OSError as err:
            self.error(f"--config {path}: {err.strerror or str(err).splitlines()[0]}")
        except tomllib.TOMLDecodeError as err:
            self.error(f"--config {path}: not valid TOML ({err})")
        if not values:
            self.error(f"--config {path}: holds no settings (an empty file?)")
        given = {t.split("=")[0] for t in args if t.startswith("--")}
        tokens = []
        fallback = getattr(self, "config_fallback", None)  # sweep.py: train.py's flags go to every trial
        for key, value in values.items():
            action = self._action_for(key)
            if action is None and fallback is not None:
                action = fallback._action_for(key)
            if action is None or action.dest in NOT_WRITTEN:
                self.error(f"--config {path}: unknown key '{key}' (keys are this script's flags, see --help)"
                           + closest_flags([f"--{key}"], self._option_string_actions, keys=True))
            option = next(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
                if given & set(action.option_strings):
                    continue  # the command line's list replaces the file's
                items = value if isinstance(value, list) else [value]
                if isinstance(action, argparse._ExtendAction):
                    tokens += [option, *map(str, items)]
                else:
                    for item in items:
                        tokens += [option, str(item)]
            elif isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(option if value else "--no-" + option[2:])
            elif action.nargs == 0:  # store_true
                tokens += [option] if value else []
            elif isinstance(value, list):
                tokens.append(f"{option}={','.join(map(str, value))}")
            else:
                tokens.append(f"{option}={value}")
        return tokens


def closest_flags(words, options, keys=False):
    """'; did you mean --learning_rate?' for the words that are misspelt flags (--learning_rat): the nearest of options
    (a parser's option strings) to each, said as a --config key where keys; '' when none is near."""
    import difflib

    names = sorted(o for o in options if o.startswith("--"))
    near = []
    for word in (w for w in words if w.startswith("--")):
        for match in difflib.get_close_matches(word.split("=")[0], names, n=1, cutoff=0.75):
            said = match[2:] if keys else match
            if said not in near:
                near.append(said)
    return f"; did you mean {' or '.join(near)}?" if near else ""


def config_values(parser, args):
    """{flag name: value} of the parsed flags of a run (None left out)."""
    values = {}
    for action in parser._actions:
        if action.dest in NOT_WRITTEN or action.help == argparse.SUPPRESS or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value is not None:
            values[action.dest] = list(value) if isinstance(value, (list, tuple)) else value
    return values


def config_text(parser, args, values=None):
    """The parsed flags of a run (or values) as the text of a --config file that repeats it (keys: the
    flags' names). Unset flags are left out; the values are the resolved ones (absolute paths). Values
    the parse worked out from other flags (the learning rate from --use_lora, lora_alpha from the rank)
    are written as comments: read back, they are worked out again, so that a config with flags added
    (or edited) gives what the same flags typed would."""
    import tomli_w

    derived = {}
    if values is None:
        values = config_values(parser, args)
        given = getattr(parser, "given", None)
        if given is not None:
            defaults = {a.dest: a.default for a in parser._actions}
            derived = {k: v for k, v in values.items() if k not in given and v != defaults.get(k)}
            values = {k: v for k, v in values.items() if k not in derived}
    text = f"# {parser.prog} --config this-file repeats the run\n" + tomli_w.dumps(values)
    if derived:
        text += ("\n# Worked out from the flags above when they are read (uncomment one to fix it):\n" +
                 "".join(f"# {line}\n" for line in tomli_w.dumps(derived).splitlines() if line))
    return text


def write_config(path, text):
    """Write a config_text where a crash never leaves half of it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def make_parser(description, names, positional=None, refused=(), helps=None, optional=(), config=False, types=None,
                without=()):
    """A parser with the named flags from FLAGS, in the given order; the options in refused
    (keys of REFUSED) stop the parse with their line; helps: {name: help} where a script means
    a shared flag in its own way; optional: required flags that this script can do without;
    config: also take --config FILE (TOML, keys named as the flags); types: {name: type} likewise;
    without: option spellings this script does not take (an alias that means something else here)."""
    parser = OneLineErrorParser(description=description, formatter_class=HelpFormatter)
    if positional:
        positional(parser)
    if config:
        parser.add_argument("--config", metavar="FILE", default=None, help=config_help(names))
    used = {GROUP_OF.get(name, "other") for name in names}
    groups = {title: parser.add_argument_group(title) for title in (*HELP_GROUPS, "other") if title in used}
    for name in names:
        options, kwargs = FLAGS[name]
        options = [o for o in options if o not in without]
        kwargs = dict(kwargs)
        kwargs.setdefault("dest", name)
        if helps and name in helps:
            kwargs["help"] = helps[name]
        if types and name in types:
            kwargs["type"] = types[name]
        if name in optional:
            kwargs.update(required=False, default=None)
        groups[GROUP_OF.get(name, "other")].add_argument(*options, **kwargs)
    for option in refused:
        parser.add_argument(option, nargs="?", action=_Refused, help=argparse.SUPPRESS)
    return parser

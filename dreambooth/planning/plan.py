"""The plan of a training run (Plan): every setting of train.py, decided once on the driver by planning.py and
handed to every worker; nothing is added to it afterwards."""

import dataclasses

from dreambooth import families
from dreambooth.storage import runfiles

# How the plan line names the adapters of --adapter
ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}
# How the plan line names an optimizer other than torch's AdamW, before the schedule
OPTIMIZER_WORDS = {"adamw8bit": "8-bit AdamW, ", "prodigy": "Prodigy, which scales it by the step size it finds, ",
                   "adamw_schedulefree": "schedule-free AdamW, which warms up itself, "}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A training run, decided. Fields named as train.py's flags hold their values;
    the others are what the driver worked out from the files and the cluster."""

    # what is trained, from what
    model_dir: str
    vae_dir: str | None  # --pretrained_vae_model_name_or_path, resolved: a VAE in place of the model's
    output_dir: str
    allow_unsafe_weights: bool
    instance_prompt: str
    class_prompt: str | None
    instance_prompts: tuple  # the distinct prompts of the instance images (captions or instance_prompt)
    image_prompt: tuple  # per instance image: its prompt's index in instance_prompts
    with_prior_preservation: bool  # class images (--class_data_dir)
    prior_prediction: bool  # --prior_preservation prior_prediction: the base model's prediction, no class images
    family: families.Family  # the base model's, read once from its folder (families.require)
    prior_loss_weight: float
    train_text_encoder: bool
    use_lora: bool  # LoRA adapters (lora_rank, lora_alpha, lora_dropout) instead of every weight
    adapter: str | None  # with use_lora: "lora" or "dora" (peft's DoRA)
    lora_rank: int
    lora_alpha: float  # already defaulted to the rank
    lora_dropout: float
    # data
    instance_images: tuple  # absolute paths (converted to PNG where the format needed it)
    held_out: tuple  # --holdout: the names of the photos kept out of training, recorded with the output
    masked_loss: bool
    instance_masks: tuple  # --masked_loss: per instance image, (mask source, original photo) or None (find_masks)
    class_images: tuple
    resolution: int
    center_crop: bool
    random_flip: bool
    enable_bucket: bool
    buckets: tuple  # --enable_bucket: every bucket's (height, width); () without
    cache_latents: bool
    precompute_text_embeddings: bool
    train_batch_size: int
    gradient_accumulation_steps: int
    # optimiser and loss
    learning_rate: float  # already multiplied out with --scale_lr
    lr_scheduler: str
    lr_warmup_steps: int
    lr_num_cycles: int
    lr_power: float
    offset_noise: float
    snr_gamma: float | None
    base_precision: str | None  # --use_lora: "int8"/"nf4" frozen denoiser (quantize.py); None: the autocast dtype
    text_encoder_precision: str | None  # --use_lora: "int8"/"nf4" frozen text encoders; None: the autocast dtype
    weighting_scheme: str | None  # flow matching: the family's default when None
    flow_shift: float | None  # flow matching: the training sigmas' shift (None: the scheduler's own)
    logit_mean: float
    logit_std: float | None  # the family's default when None
    mode_scale: float
    precondition_outputs: int | None  # flow matching: the family's default when None
    guidance_scale: float | None  # the samples' guidance (Flux.1 dev: its training input too); None: the family's
    caption_dropout_rate: float  # share of instance rows trained on the empty prompt (its ids: the last "instance" row)
    use_ema: bool  # an exponential moving average of the trained weights is what validation and the output get
    ema_decay: float
    ema_update_after_step: int
    adam_beta1: float
    adam_beta2: float
    adam_weight_decay: float
    adam_epsilon: float
    max_grad_norm: float
    fused_adamw: bool
    optimizer: str  # flags.OPTIMIZERS: "adamw", "adamw8bit", "prodigy", "adamw_schedulefree"
    use_8bit_adam: bool  # (optimizer == "adamw8bit")
    prodigy_beta3: float | None
    prodigy_decouple: bool
    prodigy_use_bias_correction: bool
    prodigy_safeguard_warmup: bool
    allow_tf32: bool
    mixed_precision: str | None  # None: bf16/fp16 on GPUs that have it, fp32 on CPU
    # memory and speed
    fsdp: bool  # the denoiser sharded across the workers (sharding.shard) instead of DDP's copies
    gradient_checkpointing: bool
    channels_last: bool
    torch_compile: str | None
    # steps
    seed: int
    steps_per_epoch: int
    total_steps: int
    stream_epochs: int  # epochs of rows in the training stream
    # Ray
    num_workers: int  # the most workers (a step trains num_workers x gradient_accumulation_steps batches on any number)
    min_workers: int | None  # --min_workers: elastic, from min_workers to num_workers (None: num_workers always)
    in_process: bool  # --num_workers 0: train_fn in the driver's process (Ray Train's local mode), as one worker
    elastic_resize_interval: float
    resources_per_worker: str | None  # --resources_per_worker: 'NAME=N,...' (own_resources)
    gpus_per_worker: int
    use_gpu: bool
    cpus_per_worker: float
    storage_path: str
    run_name: str
    max_failures: int
    max_preemption_failures: int  # restarts after a node's preemption, counted apart (-1: unlimited)
    stall_timeout: float | None  # a worker's longest wait for its next step's data (None: stall.Clock's default)
    input_stamps: tuple  # files.stamps of the photos and class images before they were read (RunInputs.stamps)
    # logging and checkpoints
    logging_steps: int
    report_to: str  # "none" | "tensorboard" | "wandb" | "mlflow" | "all" (trackers.py)
    tracker_project_name: str
    notify_url: str  # (never written: a secret)
    progress_bar: bool  # rank 0 draws a bar: only when the driver's stderr is a terminal
    checkpointing_steps: int
    checkpoints_total_limit: int | None
    checkpoint_upload: str  # "auto" | "sync" | "async" (--checkpoint_upload; uploads_in_background)
    keep_checkpoints: bool  # False: the run's checkpoints are removed once its model is saved
    resume_path: str | None
    identity: dict | None  # run_identity.of_run: what decides the weights, recorded with checkpoints and the model
    # validation samples (none without prompts)
    validation_prompts: tuple
    num_validation_images: int
    validation_steps: int  # already defaulted to checkpointing_steps
    validation_inference_steps: int
    # scores while training (--score_steps; None: none): the checkpoints of those steps scored as evaluate.py does
    score_steps: int | None
    instance_data_dir: str  # the photos' folder, as given (the subject's photos the scores compare with)
    eval_models_dir: str | None
    class_name: str | None
    unique_token: str
    subject_type: str | None
    eval_prompts: str | None
    eval_images_per_prompt: int
    keep_best: bool  # the best-scored step's model saved instead of the last
    clip_t_margin: float  # how far below the base model's CLIP-T a step may score and still be the best
    settings_toml: str  # the resolved flags as a --config file that repeats the run
    # a sweep's trial (sweep_trial.py): the steps scored whatever happens (its step counts: never skipped for a scoring
    # still running), the folder each of them keeps its scored model in (model-step-N), and its subject's base
    # model's scores, already made by the sweep (the run does not score the base model again)
    score_at: tuple = ()
    step_models: str | None = None
    base_scores: dict | None = None

    @property
    def run_dir(self):  # the local folder of the run's own files (runfiles.run_folder)
        return runfiles.run_folder(self.storage_path, self.run_name)

    @property
    def text_encoded_once(self):
        """Frozen text encoders whose states are computed once: then they leave the device (models/networks.py)."""
        return not self.train_text_encoder and self.precompute_text_embeddings

    def is_checkpoint_step(self, step):
        """Checkpoints every checkpointing_steps, on the steps scored and at the last step."""
        return step % self.checkpointing_steps == 0 or step == self.total_steps or self.is_score_step(step)

    def own_resources(self):
        """{resource: amount} each worker reserves beside its CPUs and GPUs (--resources_per_worker; {} without)."""
        from dreambooth.config import flagtypes

        return flagtypes.resource_amounts(self.resources_per_worker) if self.resources_per_worker else {}

    def workers_said(self):
        """'2 worker(s)', '1 to 2 workers (elastic)' with --min_workers, or 'this process' with --num_workers 0."""
        if self.in_process:
            return "this process (--num_workers 0: Ray Train's local mode)"
        if self.min_workers:
            return f"{self.min_workers} to {self.num_workers} workers (elastic)"
        return f"{self.num_workers} worker(s)"

    def uploads_in_background(self):
        """Whether checkpoints upload while training goes on (--checkpoint_upload; 'auto': to a bucket; never in this
        process, --num_workers 0, whose loop writes them itself)."""
        from dreambooth import storage

        return not self.in_process and (self.checkpoint_upload == "async" or (
            self.checkpoint_upload == "auto" and storage.is_remote(self.storage_path)))

    def is_score_step(self, step):
        """The checkpoints scored while training: every score_steps and at the last step, or a sweep's score_at (none
        without)."""
        if self.score_at:
            return step in self.score_at
        return bool(self.score_steps) and (step % self.score_steps == 0 or step == self.total_steps)

    def is_validation_step(self, step):
        """Every rank samples its share on the same steps: every validation_steps and at the end."""
        return bool(self.validation_prompts) and (step % self.validation_steps == 0 or step == self.total_steps)

    def is_report_step(self, step):
        """Every rank reports on the same steps: Ray Train requires matching report calls."""
        return step % self.logging_steps == 0 or self.is_checkpoint_step(step)

    def describe(self):
        """The plan in three lines, printed once at the start of a run."""
        trained = self.family.denoiser_label + (" + text encoder" if self.train_text_encoder else "")
        if self.use_lora:
            trained = f"{ADAPTER_NAMES.get(self.adapter, 'LoRA')} adapters (rank {self.lora_rank}, alpha {self.lora_alpha:g}) on the {trained}"
            quantised = [f"{what} {precision}" for what, precision in (
                ("the base", self.base_precision), ("the frozen text encoders", self.text_encoder_precision)) if precision]
            trained += f" ({', '.join(quantised)})" if quantised else ""
        prior = f" + {self.train_batch_size} class" if self.with_prior_preservation else ""
        if self.prior_prediction:
            prior = f" + the same {self.train_batch_size} under the class prompt, towards the base model's prediction"
        device = f"{self.gpus_per_worker} GPU" if self.use_gpu else f"{self.cpus_per_worker:g} CPU"
        workers = f"{self.workers_said()} x ({device})" if not self.in_process else self.workers_said()
        resume = f"; resuming from {self.resume_path}" if self.resume_path else ""
        if self.validation_prompts:
            resume += (f"; {len(self.validation_prompts)} validation prompt(s) x {self.num_validation_images} "
                       f"every {self.validation_steps} steps")
        if self.score_at:
            resume += f"; scored at steps {', '.join(map(str, self.score_at))} (DINO, CLIP-I, CLIP-T) while it trains, " \
                "each from a checkpoint of its step"
        elif self.score_steps:
            resume += f"; scored every {self.score_steps} steps (DINO, CLIP-I, CLIP-T) while it trains, each from a " \
                "checkpoint of its step"
        if self.fsdp:
            trained += f", sharded across the {self.num_workers} worker(s) (FSDP)"
        if self.use_ema:
            trained += f", averaged (EMA, decay up to {self.ema_decay:g}: samples and the output hold the average)"
        captions = f" ({len(self.instance_prompts)} prompts from captions)" if len(self.instance_prompts) > 1 else ""
        return (f"plan: {self.total_steps} steps ({self.steps_per_epoch} per epoch) training {trained} on "
                f"{len(self.instance_images)} instance{captions} and {len(self.class_images)} class images at "
                f"{self.resolution} px{' (aspect-ratio buckets)' if self.enable_bucket else ''}\n"
                f"      {workers}, batch {self.train_batch_size} instance{prior} "
                f"x {self.gradient_accumulation_steps} accumulated, lr {self.learning_rate:g} "
                f"({OPTIMIZER_WORDS.get(self.optimizer, '') + self.lr_scheduler}), seed {self.seed}\n"
                f"      run {self.run_name}: checkpoints every {self.checkpointing_steps} steps in "
                f"{self.storage_path}{' (uploaded while training goes on)' if self.uploads_in_background() else ''}"
                f"{resume}")

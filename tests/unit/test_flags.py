import os

import pytest

from dreambooth.config import flags
from dreambooth.files import REPO_DIR
from dreambooth.planning import planning

BASE = ["--model_dir", "/m", "--output_dir", "/o", "--instance_images_dir", "/i", "--instance_prompt", "p"]


def parse_train(argv):
    return planning.parse_args(argv)


def test_ray_example_names_are_aliases_of_diffusers_names():
    seeds = parse_train(BASE + ["--class_images_dir", "/c", "--class_prompt", "q", "--lr", "1e-4",
                                "--num_epochs", "7", "--num_workers", "3"])
    diffusers_style = parse_train(["--pretrained_model_name_or_path", "/m", "--output_dir", "/o",
                                   "--instance_data_dir", "/i", "--instance_prompt", "p",
                                   "--class_data_dir", "/c", "--class_prompt", "q", "--learning_rate", "1e-4",
                                   "--num_train_epochs", "7", "--num_workers", "3"])
    assert vars(seeds) == vars(diffusers_style)
    assert seeds.model_dir == "/m" and seeds.learning_rate == 1e-4 and seeds.num_train_epochs == 7


def test_class_dir_turns_on_prior_preservation_and_storage_defaults_beside_output():
    args = parse_train(BASE + ["--class_images_dir", "/c", "--class_prompt", "q"])
    assert args.with_prior_preservation
    assert args.storage_path == "/ray_results"
    assert not parse_train(BASE).with_prior_preservation


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse_train(["--model_dir", "m", "--output_dir", "o", "--instance_images_dir", "i",
                        "--instance_prompt", "p"])
    assert args.model_dir == str(tmp_path / "m") and args.instance_data_dir == str(tmp_path / "i")


@pytest.mark.parametrize("extra, message", [
    (["--lr", "-1"], "must be > 0"),
    (["--max_train_steps", "0"], "positive integer"),
    (["--resolution", "100"], "multiple of 8"),
    (["--with_prior_preservation"], "needs --class_data_dir"),
    (["--class_images_dir", "/c"], "needs --class_prompt"),
    (["--num_workers", "-1"], "must be >= 0"),
    (["--prior_loss_weight", "-0.5"], "must be >= 0"),
    # an empty path (MODEL=$(cache_model.py … | tail -n 1) after a failed fetch): it was the current folder, or ""
    (["--model_dir="], "argument --model_dir/--pretrained_model_name_or_path: is empty (a shell variable never set"),
    (["--output_dir", ""], "argument --output_dir: is empty"),
    (["--storage_path", " "], "argument --storage_path: is empty"),
])
def test_bad_flags_exit_2_with_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_train(BASE + extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_every_flag_answers_to_its_hyphenated_spelling():
    underscored = parse_train(BASE + ["--class_images_dir", "/c", "--class_prompt", "q", "--num_workers", "4",
                                      "--max_train_steps=9"])
    hyphenated = parse_train(["--model-dir", "/m", "--output-dir=/o", "--instance-images-dir", "/i",
                              "--instance-prompt", "p", "--class-images-dir", "/c", "--class-prompt", "q",
                              "--num-workers=4", "--max-train-steps", "9"])
    assert vars(hyphenated) == vars(underscored)
    assert flags.normalize_option("--no-train-text-encoder") == "--no-train_text_encoder"
    assert flags.normalize_option("--negative_prompt=a-b --c") == "--negative_prompt=a-b --c"
    assert flags.normalize_option("-h") == "-h" and flags.normalize_option("photo-of") == "photo-of"


# Every option of diffusers' examples/dreambooth/train_dreambooth.py (at 58eb52c).
DIFFUSERS_FLAGS = """
--adam_beta1 --adam_beta2 --adam_epsilon --adam_weight_decay --allow_tf32 --center_crop --checkpointing_steps
--checkpoints_total_limit --class_data_dir --class_labels_conditioning --class_prompt --dataloader_num_workers
--enable_xformers_memory_efficient_attention --gradient_accumulation_steps --gradient_checkpointing --hub_model_id
--hub_token --instance_data_dir --instance_prompt --learning_rate --local_rank --logging_dir --lr_num_cycles
--lr_power --lr_scheduler --lr_warmup_steps --max_grad_norm --max_train_steps --mixed_precision --num_class_images
--num_train_epochs --num_validation_images --offset_noise --output_dir --pre_compute_text_embeddings
--pretrained_model_name_or_path --prior_generation_precision --prior_loss_weight --push_to_hub --report_to
--resolution --resume_from_checkpoint --revision --sample_batch_size --scale_lr --seed --set_grads_to_none
--skip_save_text_encoder --snr_gamma --text_encoder_use_attention_mask --tokenizer_max_length --tokenizer_name
--train_batch_size --train_text_encoder --use_8bit_adam --validation_images --validation_prompt
--validation_scheduler --validation_steps --variant --with_prior_preservation
""".split()

# The Stable Diffusion commands of diffusers' examples/dreambooth/README.md, paths changed;
# --push_to_hub, which every one of them ends with, is checked apart.
DIFFUSERS_COMMANDS = [
    "--instance_prompt=a photo of sks dog|--resolution=512|--train_batch_size=1|--gradient_accumulation_steps=1|"
    "--learning_rate=5e-6|--lr_scheduler=constant|--lr_warmup_steps=0|--max_train_steps=400",
    "--class_data_dir=/c|--with_prior_preservation|--prior_loss_weight=1.0|--instance_prompt=a photo of sks dog|"
    "--class_prompt=a photo of dog|--resolution=512|--train_batch_size=1|--gradient_accumulation_steps=1|"
    "--learning_rate=5e-6|--lr_scheduler=constant|--lr_warmup_steps=0|--num_class_images=200|--max_train_steps=800",
    "--class_data_dir=/c|--with_prior_preservation|--prior_loss_weight=1.0|--instance_prompt=a photo of sks dog|"
    "--class_prompt=a photo of dog|--resolution=512|--train_batch_size=1|--gradient_accumulation_steps=2|"
    "--gradient_checkpointing|--use_8bit_adam|--learning_rate=5e-6|--lr_scheduler=constant|--lr_warmup_steps=0|"
    "--num_class_images=200|--max_train_steps=800",
    "--class_data_dir=/c|--with_prior_preservation|--prior_loss_weight=1.0|--instance_prompt=a photo of sks dog|"
    "--class_prompt=a photo of dog|--resolution=512|--train_batch_size=1|--gradient_accumulation_steps=1|"
    "--gradient_checkpointing|--use_8bit_adam|--enable_xformers_memory_efficient_attention|--set_grads_to_none|"
    "--learning_rate=2e-6|--lr_scheduler=constant|--lr_warmup_steps=0|--num_class_images=200|--max_train_steps=800",
    "--train_text_encoder|--class_data_dir=/c|--with_prior_preservation|--prior_loss_weight=1.0|"
    "--instance_prompt=a photo of sks dog|--class_prompt=a photo of dog|--resolution=512|--train_batch_size=1|"
    "--use_8bit_adam|--gradient_checkpointing|--learning_rate=2e-6|--lr_scheduler=constant|--lr_warmup_steps=0|"
    "--num_class_images=200|--max_train_steps=800",
]


@pytest.mark.parametrize("command", DIFFUSERS_COMMANDS)
def test_diffusers_documented_commands_parse_and_push_to_hub_says_what_to_do(command, capsys):
    argv = ["--pretrained_model_name_or_path=/m", "--instance_data_dir=/i", "--output_dir=/o", *command.split("|")]
    args = parse_train(argv)
    assert args.model_dir == "/m" and args.max_train_steps in (400, 800) and args.learning_rate in (5e-6, 2e-6)
    with pytest.raises(SystemExit):
        parse_train(argv + ["--push_to_hub"])
    err = capsys.readouterr().err
    assert "--push_to_hub is not supported: upload the result yourself" in err and err.count("\n") == 1


# Every option of diffusers' examples/dreambooth/train_dreambooth_lora_sdxl.py (at 58eb52c).
DIFFUSERS_SDXL_FLAGS = """
--adam_beta1 --adam_beta2 --adam_epsilon --adam_weight_decay --adam_weight_decay_text_encoder --allow_tf32
--cache_dir --caption_column --center_crop --checkpointing_steps --checkpoints_total_limit --class_data_dir
--class_prompt --dataloader_num_workers --dataset_config_name --dataset_name --do_edm_style_training
--enable_xformers_memory_efficient_attention --gradient_accumulation_steps --gradient_checkpointing --hub_model_id
--hub_token --image_column --image_interpolation_mode --instance_data_dir --instance_prompt --learning_rate
--local_rank --logging_dir --lora_dropout --lr_num_cycles --lr_power --lr_scheduler --lr_warmup_steps
--max_grad_norm --max_train_steps --mixed_precision --num_class_images --num_train_epochs --num_validation_images
--optimizer --output_dir --output_kohya_format --pretrained_model_name_or_path --pretrained_vae_model_name_or_path
--prior_generation_precision --prior_loss_weight --prodigy_beta3 --prodigy_decouple --prodigy_safeguard_warmup
--prodigy_use_bias_correction --push_to_hub --random_flip --rank --repeats --report_to --resolution
--resume_from_checkpoint --revision --sample_batch_size --scale_lr --seed --snr_gamma --text_encoder_lr
--train_batch_size --train_text_encoder --use_8bit_adam --use_dora --validation_epochs --validation_prompt --variant
--with_prior_preservation
""".split()


# Every option of diffusers' examples/dreambooth/train_dreambooth_lora_flux.py and _lora_sd3.py (at 58eb52c).
DIFFUSERS_FLOW_FLAGS = """
--adam_beta1 --adam_beta2 --adam_epsilon --adam_weight_decay --adam_weight_decay_text_encoder --allow_tf32
--cache_dir --cache_latents --caption_column --center_crop --checkpointing_steps --checkpoints_total_limit
--class_data_dir --class_prompt --dataloader_num_workers --dataset_config_name --dataset_name
--enable_npu_flash_attention --gradient_accumulation_steps --gradient_checkpointing --guidance_scale
--hub_model_id --hub_token --image_column --instance_data_dir --instance_prompt --learning_rate --local_rank
--logging_dir --logit_mean --logit_std --lora_alpha --lora_blocks --lora_dropout --lora_layers --lr_num_cycles
--lr_power --lr_scheduler --lr_warmup_steps --max_grad_norm --max_sequence_length --max_train_steps
--mixed_precision --mode_scale --num_class_images --num_train_epochs --num_validation_images --optimizer
--output_dir --precondition_outputs --pretrained_model_name_or_path --prior_generation_precision
--prior_loss_weight --prodigy_beta3 --prodigy_decouple --prodigy_safeguard_warmup --prodigy_use_bias_correction
--push_to_hub --random_flip --rank --repeats --report_to --resolution --resume_from_checkpoint --revision
--sample_batch_size --scale_lr --seed --text_encoder_lr --train_batch_size --train_text_encoder
--upcast_before_saving --use_8bit_adam --validation_epochs --validation_prompt --variant --weighting_scheme
--with_prior_preservation
""".split()


# Every option of diffusers' examples/dreambooth/train_dreambooth_lora_flux2.py and _flux2_klein.py (at 58eb52c; the
# klein script has --caption_dropout, not --remote_text_encoder).
DIFFUSERS_FLUX2_FLAGS = """--caption_dropout
--adam_beta1 --adam_beta2 --adam_epsilon --adam_weight_decay --adam_weight_decay_text_encoder --allow_tf32
--aspect_ratio_buckets --bnb_quantization_config_path --cache_dir --cache_latents --caption_column --center_crop
--checkpointing_steps --checkpoints_total_limit --class_data_dir --class_prompt --dataloader_num_workers
--dataset_config_name --dataset_name --do_fp8_training --enable_npu_flash_attention --final_validation_prompt
--fsdp_text_encoder --gradient_accumulation_steps --gradient_checkpointing --guidance_scale --hub_model_id
--hub_token --image_column --instance_data_dir --instance_prompt --learning_rate --local_rank --logging_dir
--logit_mean --logit_std --lora_alpha --lora_dropout --lora_layers --lr_num_cycles --lr_power --lr_scheduler
--lr_warmup_steps --max_grad_norm --max_sequence_length --max_train_steps --mixed_precision --mode_scale
--num_class_images --num_train_epochs --num_validation_images --offload --optimizer --output_dir
--pretrained_model_name_or_path --prior_generation_precision --prior_loss_weight --prodigy_beta3 --prodigy_decouple
--prodigy_safeguard_warmup --prodigy_use_bias_correction --push_to_hub --random_flip --rank --remote_text_encoder
--repeats --report_to --resolution --resume_from_checkpoint --revision --sample_batch_size --scale_lr --seed
--skip_final_inference --text_encoder_lr --text_encoder_out_layers --train_batch_size --upcast_before_saving
--use_8bit_adam --use_aspect_ratio_buckets --validation_epochs --validation_prompt --variant --weighting_scheme
--with_prior_preservation
""".split()


def test_every_diffusers_flag_is_taken_or_refused_with_what_to_do_instead(capsys):
    parser = flags.make_parser("t", planning.TRAIN_FLAGS, refused=flags.REFUSED)
    options = parser._option_string_actions
    assert len(DIFFUSERS_FLAGS) == 61 and all(f in options for f in DIFFUSERS_FLAGS)
    assert len(DIFFUSERS_SDXL_FLAGS) == 72 and all(f in options for f in DIFFUSERS_SDXL_FLAGS)
    assert len(DIFFUSERS_FLOW_FLAGS) == 78 and all(f in options for f in DIFFUSERS_FLOW_FLAGS)
    assert len(DIFFUSERS_FLUX2_FLAGS) == 86 and all(f in options for f in DIFFUSERS_FLUX2_FLAGS)
    every = DIFFUSERS_FLAGS + DIFFUSERS_SDXL_FLAGS + DIFFUSERS_FLOW_FLAGS + DIFFUSERS_FLUX2_FLAGS
    refused = [f for f in dict.fromkeys(every) if f in flags.REFUSED]
    assert set(flags.REFUSED) <= set(every) and len(refused) == 17 + 11 + 5 + 10
    assert parse_train(BASE + ["--use_dora"]).adapter == "dora"  # (diffusers' SDXL LoRA script's flag)
    # diffusers' Prodigy command lines (its flags take True/False after =)
    args = parse_train(BASE + ["--optimizer=prodigy", "--prodigy_beta3=0.99", "--prodigy_decouple=True",
                               "--prodigy_use_bias_correction=False", "--prodigy_safeguard_warmup"])
    assert (args.optimizer, args.learning_rate, args.prodigy_beta3) == ("prodigy", 1.0, 0.99)
    assert (args.prodigy_decouple, args.prodigy_use_bias_correction, args.prodigy_safeguard_warmup) == (True, False, True)
    for flag in refused:
        with pytest.raises(SystemExit):
            parse_train(BASE + [flag, "x"])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} is not supported: " in err and len(err) > 60


# The SDXL LoRA command of diffusers' examples/dreambooth/README_sdxl.md, paths changed, with the
# --use_lora this suite asks for (the LoRA scripts always train LoRA); --report_to="wandb" and
# --push_to_hub are checked apart.
DIFFUSERS_SDXL_COMMAND = (
    "--use_lora|--pretrained_vae_model_name_or_path=/vae|--mixed_precision=fp16|--instance_prompt=a photo of sks dog|"
    "--resolution=1024|--train_batch_size=1|--gradient_accumulation_steps=4|--learning_rate=1e-4|"
    "--lr_scheduler=constant|--lr_warmup_steps=0|--max_train_steps=500|"
    "--validation_prompt=A photo of sks dog in a bucket|--validation_epochs=25|--seed=0")


def test_the_sdxl_lora_readme_command_parses_and_what_differs_says_what_to_do(capsys):
    argv = ["--pretrained_model_name_or_path=/m", "--instance_data_dir=/i", "--output_dir=/o",
            *DIFFUSERS_SDXL_COMMAND.split("|")]
    args = parse_train(argv)
    assert (args.use_lora, args.vae_dir, args.validation_epochs, args.resolution) == (True, "/vae", 25, 1024)
    assert args.validation_steps is None  # decided from the epoch's steps when the run is planned
    assert "{none,tensorboard,wandb,mlflow,all}" in planning.train_parser().format_help()
    assert parse_train(argv + ["--report_to=wandb"]).report_to == "wandb"  # (as diffusers' command has it)
    assert parse_train(argv + ["--optimizer=prodigy"]).learning_rate == 1e-4  # (the command's own, not Prodigy's 1.0)
    for extra, says in ((["--push_to_hub"], "upload the result yourself"),
                        (["--optimizer=adam"], "invalid choice: 'adam'"),
                        (["--validation_steps=5"], "not both")):
        with pytest.raises(SystemExit):
            parse_train(argv + extra)
        err = capsys.readouterr().err
        assert says in err, extra
    # Its rank without --use_lora would train every weight instead: refused, saying why.
    with pytest.raises(SystemExit):
        parse_train([a for a in argv if a != "--use_lora"] + ["--rank=8"])
    assert "add --use_lora" in capsys.readouterr().err


def test_readme_compatibility_claims_hold():
    """docs/DIFFUSERS.md's lists of train_dreambooth.py flags that train.py takes and refuses (defect 7:
    the README once said every train_dreambooth.py command ran unchanged, and two of them were refused)."""
    import re

    with open(os.path.join(REPO_DIR, "docs", "DIFFUSERS.md")) as f:
        text = f.read()
    paragraph = text[text.index("# Commands written for diffusers'"):text.index("Every flag also answers")]
    taken, refused = paragraph.split("tests/unit/test_flags.py runs")[0].split("or refused with one line", 1)
    taken, refused = re.findall(r"`(--[a-z0-9_]+)`", taken), re.findall(r"`(--[a-z0-9_]+)`", refused)
    assert len(taken) >= 15 and all(o in DIFFUSERS_FLAGS and o not in flags.REFUSED for o in taken), taken
    assert len(refused) >= 5 and all(o in flags.REFUSED for o in refused), refused


def test_a_prompt_with_commas_is_one_prompt_wherever_it_is_given(tmp_path, capsys):
    from dreambooth.generation import prompts

    painted = "photo of unqtkn dog, oil painting, detailed"
    args = parse_train(BASE + ["--validation_prompt", painted, "--validation_prompt", "a dog, asleep"])
    assert args.validation_prompts == (painted, "a dog, asleep")
    parser = flags.make_parser("g", ["prompts", "prompts_file"])
    listed = tmp_path / "prompts.txt"
    listed.write_text("# mine\na cat, in the snow\n\n" + painted + "\n")
    args = parser.parse_args(["--prompts", painted, "a dog", "--prompts", "a fox, red", "--prompts_file", str(listed)])
    assert prompts.prompts_of(args.prompts, args.prompts_file) == [painted, "a dog", "a fox, red", "a cat, in the snow"]
    # --prompts="…" "…": the '=' form takes one value; the word after it is named with the way to give several
    with pytest.raises(SystemExit):
        parser.parse_args([f"--prompts={painted}", "a cat, oil painting"])
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: a cat, oil painting (--prompts=… takes the "
                                            "one value after '='; for several: --prompts \"…\" \"…\")\n")


def test_a_written_config_repeats_the_run_and_the_command_line_wins(tmp_path):
    args = parse_train(BASE + ["--class_images_dir", "/c", "--class_prompt", "q, r", "--max_train_steps", "7",
                               "--validation_prompt", "a, b", "--no-train_text_encoder", "--offset_noise",
                               "--use_lora", "--resume_from_checkpoint", "latest"])
    config = tmp_path / "train_config.toml"
    config.write_text(args.settings_toml)
    again = parse_train(["--config", str(config)])
    def settings(namespace):
        return {k: v for k, v in vars(namespace).items() if k not in ("config", "resume_from_checkpoint")}

    assert settings(again) == settings(args) and again.settings_toml == args.settings_toml
    assert again.resume_from_checkpoint is None  # a repeat starts afresh
    changed = parse_train(["--config", str(config), "--max_train_steps", "9", "--validation_prompt", "c"])
    assert changed.max_train_steps == 9 and changed.validation_prompts == ("c",) and changed.use_lora


def test_a_written_config_works_out_derived_values_again(tmp_path):
    """Values worked out from other flags are comments in the file: a config with flags added gives what
    the same flags typed would (a full run's config + --use_lora --rank 16: LoRA's learning rate, alpha 16)."""
    full = parse_train(BASE + ["--checkpointing_steps", "50"])
    config = tmp_path / "train_config.toml"
    config.write_text(full.settings_toml)
    assert "\n# learning_rate = 5e-06\n" in full.settings_toml and "\ncheckpointing_steps = 50\n" in full.settings_toml
    typed = parse_train(BASE + ["--checkpointing_steps", "50", "--use_lora", "--rank", "16"])
    read = parse_train(["--config", str(config), "--use_lora", "--rank", "16"])
    assert (read.learning_rate, read.lora_alpha, read.validation_steps) == (1e-4, 16.0, 50)
    assert {k: v for k, v in vars(read).items() if k != "config"} == {k: v for k, v in vars(typed).items()
                                                                       if k != "config"}
    edited = tmp_path / "edited.toml"  # a value given in the file is the user's: kept
    edited.write_text(full.settings_toml.replace("# learning_rate = 5e-06", "learning_rate = 3e-06"))
    assert parse_train(["--config", str(edited), "--use_lora"]).learning_rate == 3e-6


def test_a_bad_config_is_one_line(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("max_train_steps = 5\nnot_a_flag = 1\n")
    with pytest.raises(SystemExit):
        parse_train(BASE + ["--config", str(config)])
    assert "unknown key 'not_a_flag'" in capsys.readouterr().err
    config.write_text("max_train_steps = [")
    with pytest.raises(SystemExit):
        parse_train(BASE + ["--config", str(config)])
    assert "not valid TOML" in capsys.readouterr().err


def test_ema_flags_need_use_ema_and_a_decay_under_1(capsys):
    args = parse_train(BASE + ["--use_ema", "--ema_decay", "0.999", "--ema_update_after_step", "20"])
    assert (args.use_ema, args.ema_decay, args.ema_update_after_step) == (True, 0.999, 20)
    assert parse_train(BASE).use_ema is False
    for extra, says in ((["--ema_decay", "0.99"], "add --use_ema"),
                        (["--use_ema", "--ema_decay", "1"], "must be >= 0 and < 1"),
                        (["--use_ema", "--ema_decay", "-0.1"], "must be >= 0 and < 1")):
        with pytest.raises(SystemExit):
            parse_train(BASE + extra)
        assert says in capsys.readouterr().err, extra


def test_prior_prediction_takes_a_class_prompt_and_no_class_images(capsys):
    args = parse_train(BASE + ["--prior_preservation", "prior_prediction", "--class_prompt", "photo of a dog"])
    assert args.prior_prediction and not args.with_prior_preservation
    assert "ignored" not in capsys.readouterr().err  # the class prompt is used
    assert not parse_train(BASE + ["--class_data_dir", "/c", "--class_prompt", "q"]).prior_prediction
    for extra, says in ((["--prior_preservation", "prior_prediction"], "needs --class_prompt"),
                        (["--prior_preservation", "prior_prediction", "--class_prompt", "q", "--class_data_dir", "/c"],
                         "trains without class images"),
                        (["--prior_preservation", "prior_prediction", "--class_prompt", "q",
                          "--num_class_images", "10"], "trains without class images")):
        with pytest.raises(SystemExit):
            parse_train(BASE + extra)
        assert says in capsys.readouterr().err, extra


def test_help_shows_a_switchs_default_and_config_examples_the_script_takes():
    """--train_text_encoder showed no default; generate.py's and sweep.py's --config example named
    max_train_steps, which they refuse in a config file."""
    parser = flags.make_parser("x", ["model_dir", "train_text_encoder", "prompts"], config=True)
    text = " ".join(parser.format_help().split())
    assert "Fine-tune the text encoder together with the UNet. (default: on)" in text
    assert 'model_dir = "..."' in text and 'prompts = ["..."]' in text and "max_train_steps" not in text
    assert "max_train_steps = 400" in " ".join(planning.train_parser("train").format_help().split())




def test_a_flag_is_taken_only_by_its_full_name_and_a_misspelt_one_names_the_nearest(tmp_path, capsys):
    """argparse's prefix matching took --learning_rat for --learning_rate (and --max_train for --max_train_steps): a
    typo became another setting. Every script's parser takes full names only; the error names the nearest flag, on
    the command line and as a --config key."""
    from dreambooth.commands import flagdocs

    for script, (module_name, _) in flagdocs.SCRIPTS.items():
        assert flagdocs.parser_of(module_name).allow_abbrev is False, script
    for typo, nearest in ((["--learning_rat", "1e-4"], "--learning_rate"), (["--max_train", "5"], "--max_train_steps")):
        with pytest.raises(SystemExit):
            parse_train(BASE + typo)
        assert capsys.readouterr().err.strip().endswith(
            f"error: unrecognized arguments: {' '.join(typo)}; did you mean {nearest}?")
    # a misspelt required flag: argparse names the missing one first, and the typo went unsaid
    with pytest.raises(SystemExit):
        parse_train([w.replace("--output_dir", "--ouput_dir") for w in BASE])
    assert capsys.readouterr().err.strip().endswith(
        "error: unrecognized arguments: --ouput_dir; did you mean --output_dir? (and the following arguments are "
        "required: --output_dir)")
    config = tmp_path / "run.toml"
    config.write_text("learning_rat = 1e-4\n")
    with pytest.raises(SystemExit):
        parse_train(BASE + ["--config", str(config)])
    assert capsys.readouterr().err.strip().endswith(
        f"--config {config}: unknown key 'learning_rat' (keys are this script's flags, see --help); "
        "did you mean learning_rate?")

"""docs/FLAGS.md is the text its generator makes from the scripts' own parsers: every flag, its default
and help as `--help` gives them."""

import os

from dreambooth.commands import flagdocs
from dreambooth.files import REPO_DIR


def test_the_flags_page_is_the_one_the_parsers_make():
    with open(os.path.join(REPO_DIR, "docs", "FLAGS.md")) as f:
        page = f.read()
    assert page == flagdocs.flags_markdown(), f"docs/FLAGS.md is out of date: run `{flagdocs.COMMAND}`"


def test_the_page_lists_every_script_and_a_flag_of_each():
    page = flagdocs.flags_markdown()
    for script, words in {"train.py": "`--use_lora`", "generate.py": "`--prompts`", "evaluate.py": "`--holdout`",
                          "sweep.py": "`--sweep_rank`", "export.py": "`--save_precision`",
                          "cache_model.py": "`--eval_models`", "preflight.py": "`--gpu_memory`",
                          "dreambooth_run.sh": "`MAX_TRAIN_STEPS` | 200 (--tiny: 20) |"}.items():
        section = page.split(f"## {script}\n")[1].split("\n## ")[0]
        assert words in section, script
    assert "| `--gradient_checkpointing` | off |" in page
    assert "| `--train_text_encoder`, `--no-train_text_encoder` | on |" in page


def test_help_groups_the_flags_with_the_common_ones_first():
    """--help in sections (data, model, training, ..., cluster), never a flat list; a flag in no section would be
    under 'other', which no script shows."""
    import re

    help_text = flagdocs.parser_of("train").format_help()
    sections = re.findall(r"^([a-z][a-zA-Z ()]*):$", help_text, re.M)
    assert sections == ["options", "data", "model", "training", "reproducibility", "memory and speed",
                        "adapters (LoRA)", "outputs", "image generation", "cluster (Ray)"]
    adapters = help_text.split("\nadapters (LoRA):\n")[1].split("\noutputs:\n")[0]
    assert "--use_lora" in adapters and "--lora_alpha" in adapters and "--learning_rate" not in adapters
    for module_name in ("train", "generate", "evaluate", "sweep", "export", "cache_model", "preflight", "serve"):
        assert "\nother:\n" not in flagdocs.parser_of(module_name).format_help(), module_name

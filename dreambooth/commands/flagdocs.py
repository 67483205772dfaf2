"""docs/FLAGS.md: every flag of every script, from the scripts' own parsers (and dreambooth_run.sh's
settings from its VARIABLES table), so the page cannot drift from `--help`.

    python -m dreambooth.commands.flagdocs > docs/FLAGS.md
"""

import argparse
import importlib
import os
import re
import sys

from dreambooth import families
from dreambooth.config import flags
from dreambooth.files import REPO_DIR

# script: (module whose main(argv) builds its parser, what it is)
SCRIPTS = {
    "train.py": ("train", "Step 4: fine-tuning on Ray Train workers"),
    "generate.py": ("generate", "Steps 3 and 5: drawing images on an actor pool"),
    "evaluate.py": ("evaluate", "Step 6: the scores of a tuned model beside its base model"),
    "sweep.py": ("sweep", "A Ray Tune sweep of train.py, each trial scored; its other flags are train.py's"),
    "export.py": ("export", "One .safetensors file for AUTOMATIC1111, ComfyUI and kohya"),
    "cache_model.py": ("cache_model", "Step 1: the base model (and the scoring models) in the model cache"),
    "preflight.py": ("preflight", "Step 0 of dreambooth_run.sh (the script passes its settings as these flags)"),
    "serve.py": ("serve", "Every trained subject over HTTP from one pool of Ray Serve replicas"),
}
COMMAND = "python -m dreambooth.commands.flagdocs > docs/FLAGS.md"


class _Built(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_of(module_name):
    """The parser a script's main builds, caught as it starts parsing (nothing after that runs)."""
    module = importlib.import_module(f"dreambooth.commands.{module_name}")
    original = flags.OneLineErrorParser.parse_known_args

    def caught(self, args=None, namespace=None):
        raise _Built(self)

    flags.OneLineErrorParser.parse_known_args = caught
    try:
        module.main(["--help"])
    except _Built as built:
        return built.parser
    finally:
        flags.OneLineErrorParser.parse_known_args = original
    raise RuntimeError(f"dreambooth.commands.{module_name}.main built no parser")


def _cell(text):
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action):
    if action.required:
        return "required"
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return "on" if action.default else "off"
    if action.default is None:
        return ""
    if action.default == "":
        return "`''`"
    if isinstance(action.default, (list, tuple)):
        return ", ".join(map(str, action.default))
    return f"`{action.default}`"


def flag_rows(parser):
    """One markdown row per flag: its spellings, default and help (the help as --help expands it)."""
    expand = argparse.HelpFormatter("x")._expand_help  # (%(default)s and the like, no default appended)
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        options = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}` (positional)"
        rows.append(f"| {options} | {_cell(_default(action))} | {_cell(expand(action) if action.help else '')} |")
    return rows


def script_section(script, module_name, what):
    parser = parser_of(module_name)
    lines = [f"## {script}", "", f"{what}. `python {script} --help` says the same.", "",
             "| flag | default | what |", "| --- | --- | --- |", *flag_rows(parser)]
    if parser.epilog:
        lines += ["", _cell(parser.epilog)]
    return lines


def run_sh_section():
    """dreambooth_run.sh's own options (its header) and settings (its VARIABLES table)."""
    text = open(os.path.join(REPO_DIR, "dreambooth_run.sh")).read()
    header = re.search(r"^#   \./dreambooth_run\.sh.*?(?=^#\n)", text, re.M | re.S)[0]
    lines = ["## dreambooth_run.sh", "", "Steps 0-6 as one script. `./dreambooth_run.sh --help` says the same.", "",
             "```", *(line[2:] for line in header.splitlines()), "", *families.listing(), "```", "",
             "Settings are environment variables:", "", "| variable | default | what |", "| --- | --- | --- |"]
    for name, default, meaning in re.findall(r'^  "([A-Z_]+)\|(.*?)\|(.*)"$', text, re.M):
        lines.append(f"| `{name}` | {_cell(default.replace(chr(92), '')) or 'none'} | "
                     f"{_cell(meaning.replace(chr(92), ''))} |")
    return lines


def flags_markdown():
    """The text of docs/FLAGS.md."""
    lines = ["# Every flag", "", f"Generated from the scripts' parsers: `{COMMAND}` writes this page again "
             "(tests/unit/test_flagdocs.py checks it). Every flag also answers to its hyphenated spelling "
             "(`--num-workers`); `train.py`, `generate.py` and `sweep.py` also read them from a `--config` "
             "TOML file, keys named as the flags.", ""]
    lines += run_sh_section() + [""]
    for script, (module_name, what) in SCRIPTS.items():
        lines += script_section(script, module_name, what) + [""]
    return "\n".join(lines)


def main():
    sys.stdout.write(flags_markdown())


if __name__ == "__main__":
    main()

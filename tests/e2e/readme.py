"""The README's shell blocks, the "Each step by hand" block's run on the tiny model and the "Serve your subjects"
blocks, for the tests that run them (test_readme, test_serve)."""

import os
import re
import sys

from support import run_script

from dreambooth.files import REPO_DIR

README = open(os.path.join(REPO_DIR, "README.md")).read()
# The README and the pages of docs/ it links to (the users' pages): their shell blocks are held to the same rules.
PAGES = ["README.md", *sorted(set(re.findall(r"\]\((docs/\w+\.md)", README)))]
TEXTS = {page: open(os.path.join(REPO_DIR, page)).read() for page in PAGES}
BLOCKS = [block for text in TEXTS.values() for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


SERVE_START = "python serve.py --data_prefix=$DATA_PREFIX"  # the first block of "Serve your subjects"
SERVE_ASK = "localhost:8000/v1/images"  # the second: the requests, from another terminal


def serve_blocks():
    """The README's block that starts serve.py and the block that asks it, as written (test_serve runs both)."""
    return next(b for b in BLOCKS if SERVE_START in b), next(b for b in BLOCKS if SERVE_ASK in b)


def by_hand_block():
    return next(b for b in BLOCKS if "# Step 1: cache the pinned model" in b)


def by_hand_run(folder):
    """The "Each step by hand" block as written, on the tiny model: only what needs a GPU or the network is changed
    (the tiny model for sd14 and for the scoring models, the toy photos copied for Step 2's download, fewer images
    and steps)."""
    prompts = folder / "prompts.txt"
    prompts.write_text("a {subject} on a beach\n")
    block = by_hand_block()
    for written, run in by_hand_changes(folder).items():
        block = block.replace(written, run)
    env = {"HF_HUB_OFFLINE": "1", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "DATA_PREFIX": None, "ORIG_MODEL_DIR": None}
    return run_script(["bash", "-euo", "pipefail", "-c", block], folder, env)


def by_hand_changes(folder):
    """{as the README writes it: as by_hand_run runs it}."""
    return {
        "DATA_PREFIX=$PWD/data": f"DATA_PREFIX={folder / 'data'}",
        "--model_name=sd14": "--model_name=tiny",
        "python download_example_dataset.py $INSTANCE_DIR": "mkdir -p $INSTANCE_DIR && cp images/toy/*.jpg $INSTANCE_DIR",
        "--num_samples_per_prompt=200": "--num_samples_per_prompt=4",
        "--max_train_steps=200": "--max_train_steps=2",
        "--num_samples_per_prompt=5": "--num_samples_per_prompt=1",
        "--eval_models |": "--eval_models --tiny |",
        "--subject_type=live": f"--subject_type=live --eval_prompts={folder / 'prompts.txt'} --num_samples_per_prompt=1",
    }

"""The README's commands run as typed (and the docs pages' it links): every shell block parses, every setting it
gives the script is one the script knows, and the "Each step by hand" block runs end to end on the tiny model."""

import json
import os
import re
import shlex
import subprocess
import sys

from readme import BLOCKS
from readme import TEXTS
from readme import by_hand_block
from readme import by_hand_changes
from readme import serve_blocks
from support import foreground_job
from support import model_cache_of

from dreambooth.files import OUTPUT_MARKER
from dreambooth.files import REPO_DIR


def script_variables():
    text = open(os.path.join(REPO_DIR, "dreambooth_run.sh")).read()
    return set(re.findall(r'^  "([A-Z_]+)\|', text, re.M))


def test_every_shell_block_parses_and_sets_only_what_the_script_reads():
    assert len(BLOCKS) >= 6
    known = script_variables() | {"PATH", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "HF_HUB_OFFLINE"}
    for block in BLOCKS:
        proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert proc.returncode == 0, (block, proc.stderr)
        for line in block.splitlines():
            if "./dreambooth_run.sh" in line:
                given = re.findall(r"(?:^|\s)([A-Z_]+)=", line.split("./dreambooth_run.sh")[0])
                assert set(given) <= known, (line, set(given) - known)
    # how long the tiny run takes, said once: the README says what --help says
    said = re.search(r"--tiny .*offline on CPU (\([^)]*\))", open(os.path.join(REPO_DIR, "dreambooth_run.sh")).read())[1]
    assert f"`./dreambooth_run.sh --tiny` runs the same steps on a built-in tiny random model, offline on CPU\n{said}" \
        in TEXTS["README.md"]
    # no placeholder left to fill in, no variable used before any line sets it
    assert not [page for page, text in TEXTS.items() if "<this repository>" in text]


# The blocks no test here runs, each with the reason; every other block is run below. A new block
# must be run or listed.
NOT_RUN = {
    "python3 -m venv .venv": "the install: .ci/run runs this very line; the script's line after it is "
                             "test_dreambooth_run's `./dreambooth_run.sh --tiny`",
    "ORIG_MODEL_NAME=sdxl": "the SDXL model and its VAE are downloads; test_dreambooth_run runs the SDXL LoRA "
                            "script on the tiny SDXL model",
    "ray start --head": "needs other machines; the two_node_cluster tests run the script on a 2-node cluster",
    "RAY_ADDRESS=<head>:6379 DATA_PREFIX=": "needs other machines and a bucket; the two_node_cluster tests run the "
                                           "script on a 2-node cluster, test_dreambooth_run with DATA_PREFIX in a "
                                           "bucket (a real S3 server on 127.0.0.1)",
    "python sweep.py": "test_sweep runs sweeps of every kind on the tiny model",
    "-m pytest": "the test command itself",
    "ray job submit --working-dir": "needs other machines and a bucket; test_recovery submits, stops and resubmits "
                                    "train.py as a Ray Job on a cluster of its own with Ray Jobs' server",
    "AWS_ENDPOINT_URL=http://minio": "needs a bucket: test_storage runs the same flags against a real S3 server on "
                                     "127.0.0.1 (moto's), test_dreambooth_run the script with DATA_PREFIX there",
}
YOUR_OWN = "INSTANCE_DIR=~/photos/rex CLASS_NAME=dog ./dreambooth_run.sh"


def test_every_block_is_run_or_says_why_not():
    for block in BLOCKS:
        run = block == by_hand_block() or YOUR_OWN in block or block in serve_blocks()  # (test_serve's)
        skipped = [marker for marker in NOT_RUN if marker in block]
        assert run != bool(skipped), block


def test_each_step_by_hand_runs_as_written_on_the_tiny_model(by_hand):
    proc = by_hand
    tmp_path = proc.folder
    for written in by_hand_changes(tmp_path):
        assert by_hand_block().count(written) == 1, written  # the README still says it: the test ran what it shows
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Writing model shards" not in proc.stderr  # (a bar for a terminal: none into a pipe or a log)
    data = tmp_path / "data"
    subject = data / "subjects" / "example-dog"
    assert len([f for f in os.listdir(data / "images-reg" / "dog") if f.endswith(".png")]) == 4
    assert os.path.isfile(subject / "model-tuned" / OUTPUT_MARKER)
    assert len([f for f in os.listdir(subject / "images-new") if f.endswith(".png")]) == 1
    scores = json.loads((subject / "eval" / "scores.json").read_text())
    assert set(scores["models"]) == {"tuned", "base"}
    # Step 1 cached the model in the one model cache, $DATA_PREFIX/model-orig
    assert os.path.isdir(data / "model-orig") and str(data / "model-orig") in proc.stderr + str(
        json.loads((subject / "model-tuned" / "dreambooth_training.json").read_text()))


def test_your_own_subject_block_runs_as_typed_and_ctrl_c_in_step_4_says_how_the_same_command_continues(
        tmp_path, toy_images, tiny_model, tiny_eval_models, uninterrupted):
    """`INSTANCE_DIR=~/photos/rex CLASS_NAME=dog ./dreambooth_run.sh -- --gradient_checkpointing --use_8bit_adam` as
    typed, in a home whose ~/photos/rex holds the photos; the only change: --tiny (no GPU, no download here). Fewer
    class images, the logging interval (TRAIN_ARGS) and the model caches (the session's tiny models: Step 1 finds
    them built) come from the environment, as a user's own settings would. The second block is the first with
    train.py flags after `--`: it alone runs, so the first's command line runs too.

    Typed piped into `| tee`, as users keep a copy, then Ctrl-C in Step 4 as a terminal sends it, to the whole
    foreground group (the user's tee, the script, its log's tee, train.py): the user's tee ends at once, so what
    follows reaches the script's own log only; there, training checkpoints the step it is on and says so, the
    script's last line says where it stopped and that the same command continues (it passes
    --resume_from_checkpoint auto); the script exits 130. (Its log's tee once died with the group: train.py's stop
    lines were lost and the script exited 1 without a word; then, of the broken pipe to the user's tee: the log
    ended at the settings line and the script exited 141.) The
    subject's folder holds an earlier model (another run's), which the stopped run leaves in place: a stop once
    counted as the end of the run when the folder held any model ('trained 400 steps; model saved', the stop's
    checkpoint removed). (The script run to its end: test_dreambooth_run's runs; a second run after a first in
    the same DATA_PREFIX: its LoRA run after the full one.)"""
    import glob
    import shutil
    import signal

    home = tmp_path / "home"
    shutil.copytree(toy_images, home / "photos" / "rex")
    subject = tmp_path / "data" / "subjects" / "rex"  # named after the photos' folder
    earlier = subject / "model-tuned"
    shutil.copytree(uninterrupted[0], earlier)
    before = (earlier / OUTPUT_MARKER).read_text()
    env = dict(os.environ, HOME=str(home), DATA_PREFIX=str(tmp_path / "data"), NUM_CLASS_IMAGES="2",
               MAX_TRAIN_STEPS="400", NUM_INFERENCE_STEPS="2", TRAIN_ARGS="--logging_steps 1", PYTHON=sys.executable,
               ORIG_MODEL_DIR=model_cache_of(tiny_model), EVAL_MODELS_CACHE=tiny_eval_models[0])
    env.pop("NUM_WORKERS", None)
    blocks = [b for b in BLOCKS if YOUR_OWN in b]
    assert len(blocks) == 2 and blocks[1] == blocks[0].rstrip() + " -- --gradient_checkpointing --use_8bit_adam\n"
    typed = blocks[1].strip().replace("./dreambooth_run.sh", "./dreambooth_run.sh --tiny")
    # (the shell around it goes on after Ctrl-C to write down the script's own exit status)
    piped = f"trap true INT; {typed} | tee {tmp_path / 'copy.log'}; echo \"${{PIPESTATUS[0]}}\" > {tmp_path / 'rc'}"
    proc = subprocess.Popen(["bash", "-uc", piped], cwd=REPO_DIR, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=foreground_job)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step=3 " in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
    try:
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = re.search(r"^log of this run: (\S+)", "".join(lines), re.M)[1]
    output = open(log).read()  # (the terminal's copy ended with the user's tee)
    assert (tmp_path / "rc").read_text().strip() == "130", output[-3000:]
    assert len([f for f in os.listdir(tmp_path / "data" / "images-reg" / "tiny-sd1" / "dog") if f.endswith(".png")]) == 2
    step = int(re.search(r"stopped at step (\d+) of 400 \(SIGINT\)", output)[1])
    assert 3 <= step < 400 and "stopped; rerun the same command to continue (newest checkpoint: " in output, output[-3000:]
    assert f", step {step})\n" in output  # (the checkpoint's step beside its folder, named by its time)
    # train.py's line, then the script's, nothing between (a bare "interrupted" came after train.py's)
    assert re.search(r"stopped; rerun the same command.*\)\ndreambooth_run\.sh: stopped by SIGINT", output), output[-3000:]
    last = output.strip().splitlines()[-1]
    said = re.fullmatch(r"dreambooth_run\.sh: stopped by SIGINT in Step 4; the finished steps and checkpoints are "
                        r"kept: rerun the same command to continue \((.*)\)", last)
    assert said, output[-3000:]
    # ... the command as typed, with every setting it had from the environment (inline or exported): pasted, it
    # continues this subject's run (with the bare command, a rerun would have trained the example subject)
    words = shlex.split(said[1])
    at = words.index("./dreambooth_run.sh")
    assert words[at:] == ["./dreambooth_run.sh", "--tiny", "--", "--gradient_checkpointing", "--use_8bit_adam"]
    given = dict(word.split("=", 1) for word in words[:at])
    assert given["INSTANCE_DIR"] == f"{home}/photos/rex" and given["CLASS_NAME"] == "dog"
    assert {"DATA_PREFIX", "MAX_TRAIN_STEPS", "TRAIN_ARGS", "PYTHON"} <= set(given)
    assert all(env[name] == value for name, value in given.items() if name not in ("INSTANCE_DIR", "CLASS_NAME"))
    assert "trained " not in output and (earlier / OUTPUT_MARKER).read_text() == before  # not a finished run
    [run] = glob.glob(str(subject / "ray_results" / "model-tuned-*"))
    assert glob.glob(os.path.join(run, "checkpoint_*", "*")), "the stop's checkpoint is kept"
    settings = open(os.path.join(run, "train_config.toml")).read()  # the block's flags reached train.py
    assert "use_8bit_adam = true" in settings and "gradient_checkpointing = true" in settings

"""End to end: the whole Steps 0-6 script on the tiny model, as a user runs it."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from support import model_cache_of
from support import ray_sessions
from support import ray_temp
from support import run_script

from dreambooth.files import LORA_WEIGHTS_FILE
from dreambooth.files import OUTPUT_MARKER
from dreambooth.files import REPO_DIR
from dreambooth.generation.image_records import IMAGES_CONFIG
from dreambooth.generation.image_records import IMAGES_RECORD
from dreambooth.training import score_record


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """Both runs use one DATA_PREFIX, as a user's second run does: the second finds the class images made."""
    return tmp_path_factory.mktemp("dreambooth-run")


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_dreambooth_run_tiny_end_to_end(data_prefix, mode, request, webhook):
    """The full run as a one-GPU user runs it (no NUM_WORKERS: one worker here, on the CPU), on a machine
    where Ray's temp folder names a stranger's cluster; then the LoRA run retrains into the same folders,
    as a user's second run does, after DATA_PREFIX was copied to a bucket (DATA_PREFIX=s3://…), on a 2-node
    cluster with token authentication whose second node cannot see the first node's copies of the bucket's
    files (XDG_CACHE_HOME): 2 workers (DDP of the adapters, compiled by dynamo: its graphs split at DDP's buckets),
    more steps than 4 epochs of its data, and
    Step 6 must score the new model."""
    from dreambooth import storage

    tmp_path = data_prefix
    subject_dir = tmp_path / "subjects" / "example-toy"  # the example's outputs, in a folder of their own
    where = str(tmp_path)  # DATA_PREFIX
    prompts = tmp_path / "eval-prompts.txt"  # Step 6 on 2 of its prompts, not 25
    prompts.write_text("a {subject} on a beach\na {subject} in the snow\n")
    env = dict(os.environ, DATA_PREFIX=str(tmp_path), NUM_CLASS_IMAGES="6", NUM_INFERENCE_STEPS="3",
               PYTHON=sys.executable, EVAL_PROMPTS=str(prompts))
    env.pop("NUM_WORKERS", None)

    stranger = ray_temp("s")  # Ray's temp folder
    os.makedirs(os.path.join(stranger, "ray"))
    with open(os.path.join(stranger, "ray", "ray_current_cluster"), "w") as f:
        f.write("192.0.2.1:6379")  # a cluster no step may join (a plain ray.init() would wait on it)
    env["RAY_TMPDIR"] = stranger
    if mode == "lora":
        assert (tmp_path / "images-reg").is_dir(), "the [lora] arm goes on from the [full] arm's folders: run both"
        # 6 rows over 2 workers at batch 2: 2 steps an epoch; the script once capped a run at 4 epochs (8)
        # NUM_CLASS_IMAGES lowered: train.py trains on 4 of the 6 class images the first run drew
        env.update(NUM_WORKERS="2", MAX_TRAIN_STEPS="10", TRAIN_ARGS="--logging_steps 5", NUM_CLASS_IMAGES="4")
        env["RAY_ADDRESS"], unshared = request.getfixturevalue("two_node_cluster")
        bucket_env, bucket = request.getfixturevalue("s3_endpoint")
        where = f"s3://{bucket}/dreambooth"
        storage.replace_folder(str(tmp_path), where, last=None)  # (the first run's DATA_PREFIX, copied there)
        cache = (unshared or tmp_path) / "cache"  # (removed at the end: the cluster's other tests use unshared)
        request.addfinalizer(lambda: shutil.rmtree(cache, ignore_errors=True))
        env.update(bucket_env, DATA_PREFIX=where, XDG_CACHE_HOME=str(cache))
    else:
        env.update(MAX_TRAIN_STEPS="99", NOTIFY_URL=webhook.url)  # the step count after -- wins, in the banners too
        env["SCORE_STEPS"] = "0"  # no scores while training: the last step's model (the [lora] arm scores them)
        env.pop("RAY_ADDRESS")  # no cluster to join: the script starts one for its steps
        env.pop("RAY_AUTH_MODE", None)  # as in a user's shell: token authentication by default
    # train.py's flags after --: LoRA that way trains at LoRA's learning rate (train.py's default)
    extra = ["--", "--use_lora", "--torch_compile", "eager"] if mode == "lora" else ["--", "--seed", "1", "--max_train_steps", "4",
                                                         "--report_to", "mlflow"]
    heads = os.path.join(os.environ["RAY_TMPDIR"], "dreambooth-ray-*")  # (the suite's clusters' folders)
    sessions, heads_before = ray_sessions(), set(glob.glob(heads))
    if mode == "full":  # as a person runs it: on a terminal, which gets progress bars
        returncode, output = run_in_terminal(["bash", "dreambooth_run.sh", "--tiny", *extra], env, 600)
    else:
        proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny", *extra],
                              cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=600)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    new_sessions = ray_sessions() - sessions
    assert returncode == 0, output[-3000:]
    # a banner with a timestamp per step, the resolved settings once, and a log file of it all
    assert len(re.findall(r"=== \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] Step [0-6]", output)) == 7
    assert re.search(r"NUM_WORKERS +" + ("2" if mode == "lora" else "1") + "\n", output)
    assert (", seed 1\n" in output) == (mode == "full")
    assert re.search(r"MAX_TRAIN_STEPS +" + ("10" if mode == "lora" else "4") + "\n", output)
    scored = ", scored every 5 steps and at the last, the best step's model kept" if mode == "lora" else \
        ", the last step's model kept"
    assert f"Step 4: fine-tune on {2 if mode == 'lora' else 1} worker(s), {10 if mode == 'lora' else 4} steps{scored} " \
        in output
    assert re.search(r"SCORE_STEPS +" + ("5" if mode == "lora" else "0") + "\n", output)
    assert ("best scored step: " in output) == (mode == "lora")
    log = re.search(r"^log of this run: (\S+)", output, re.M)[1]
    assert open(log).read().startswith("dreambooth_run.sh")
    if mode == "full":  # one log a run (its cluster's at its end; the scoring models' fetch said nothing)
        assert [re.sub(r"-\d{8}-\d{6}", "", f) for f in os.listdir(os.path.dirname(log))] == ["dreambooth_run.log"]
    assert "for AUTOMATIC1111/ComfyUI: " in output and "export.py --model_dir" in output  # SD 1.x exports
    if mode == "full":
        # the terminal saw bars redrawn in place (training's, and the actor pools'); the log file has
        # each bar's last state as a plain line
        assert re.search(r"training: 100%.*4(\.00)?/4", output) and re.search(r"\rgenerating on 1 actor\(s\).*6/6", output)
        wait_for_log = time.time() + 10
        while "done: scores" not in open(log).read() and time.time() < wait_for_log:
            time.sleep(0.2)
        logged = open(log).read()
        assert "\r" not in logged and "\x1b" not in logged and re.search(r"training: 100%.*4(\.00)?/4", logged)
    # Progress and results, not library noise; one note per actor pool that drew images that they
    # are noise (Step 6 draws the tuned and the base model's images on one pool).
    assert "requires torchvision" not in output
    assert "no prompt names the subject" not in output  # (Step 5's prompts name unqtkn, which the model learnt)
    assert "Ray: joined the cluster" not in output  # (the script says once which cluster its steps join)
    # Step 4 tops up Step 3's class images with Step 3's steps and guidance (train.py has no flag for them): no
    # line about "this run's 50 steps" that nothing asked for
    assert "(not this run's" not in output
    # Step 6 on one node with one actor ([full]): drawn and embedded in one task; on two nodes, on actor pools ([lora])
    assert re.search(r"scoring \d+ images " + ("in the same task" if mode == "full" else r"on 1 actor\(s\)"), output)
    assert ("generating for 2 models in one task" in output) == (mode == "full")
    step6 = len(re.findall(r"(?:tuned|base): \d+ of \d+ images already there; generating [1-9]", output))
    pools = len(re.findall(r"; generating [1-9]", output)) - step6 + (1 if step6 else 0)
    assert output.count("this model has random weights") == pools >= 1
    assert "loss and learning rate plotted in" in output
    # the last lines: every output of the subject, each in its folder, and the export command
    subject = storage.join(where, "subjects", "example-toy")
    assert f"outputs of subject 'example-toy':\n  model:  {subject}/model-tuned\n  images: {subject}/images-new" in output
    assert f"--output_file {subject}/example-toy.safetensors" in output.splitlines()[-1]
    assert "SUBJECT_TYPE         object (from CLASS_NAME=toy" in output
    # every setting shown with a value: an unset one says what that means (it was a name and a blank)
    assert "ORIG_MODEL_HASH      (not used with --tiny)" in output and "  HOLDOUT              0\n" in output
    assert not re.search(r"^  [A-Z_]+ *$", output, re.M) and "  RETRAIN              (none)\n" in output
    # --tiny builds the scoring models (nothing is fetched), meanwhile
    assert "the scoring models (tiny DINO and CLIP): built in the background" in output
    # One Ray cluster for all the steps: started here and stopped at the end, or the one given joined.
    assert open(os.path.join(stranger, "ray", "ray_current_cluster")).read() == "192.0.2.1:6379"  # untouched
    if mode == "full":
        address = re.search(r"Ray: started a cluster for this run at (\S+):(\d+) \(.*; token authentication, "
                            r"token in ", output)
        import socket

        with pytest.raises(OSError):  # gone with the script
            socket.create_connection((address[1], int(address[2])), timeout=5).close()
        # how to add a node (its metrics server off too)
        assert f"RAY_AUTH_MODE=token RAY_enable_metrics_collection=0 ray start --address={address[1]}:{address[2]}" \
            in output
        assert open(os.environ["RAY_AUTH_TOKEN_PATH"]).read() not in output  # the token itself is never shown
        # its temp folder in Ray's (RAY_TMPDIR here; removed at the end, below)
        assert "(stopped at exit; its own log goes at the end of this run's if the run fails)" in output
        # a run that ended well: its log ends with the outputs (the Ray head's log only after a failure)
        assert "--- the Ray head's own log (" not in open(log).read()
        assert open(log).read().rstrip().splitlines()[-1] == output.rstrip().splitlines()[-1]
        assert "INFO mlflow" not in output  # (MLflow's notes about its database tables)
    else:
        assert "\x1b[" not in output and "(RayTrainWorker pid=" in output  # a pipe: Ray's worker lines uncoloured
        assert f"Ray: joining the cluster at RAY_ADDRESS={env['RAY_ADDRESS']}; token authentication" in output
        assert "(2 node(s)), 2 worker(s)" in output
    # no step started a cluster of its own: [full] started the script's head only, [lora] joined the 2-node cluster;
    # the script's own head kept its session in a folder of its own, removed at the end
    assert len(new_sessions) == (1 if mode == "full" else 0), new_sessions
    assert os.listdir(os.path.join(stranger, "ray")) == ["ray_current_cluster"]
    assert set(glob.glob(heads)) == heads_before and not glob.glob(f"{stranger}/dreambooth-ray-*")

    reg = storage.listdir(storage.join(where, "images-reg", "tiny-sd1", "toy"))  # a folder per base model and class
    assert reg == sorted([f"photo-of-a-toy-{i:05d}.png" for i in range(6)] + ["grid", IMAGES_RECORD, IMAGES_CONFIG])
    new = [f for f in storage.listdir(f"{subject}/images-new") if f.endswith(".png")]
    assert len(new) == 5 and storage.isfile(f"{subject}/images-new/grid/grid.png")
    # the example photos in their own folder: nothing lands where your photos go
    assert storage.listdir(storage.join(where, "images-example")) == [f"toy-{k}.jpg" for k in range(5)]
    assert not storage.exists(storage.join(where, "images-own"))

    evaluation = subject_dir / "eval"
    scores = storage.read_json(f"{subject}/eval/scores.json")
    if mode == "lora":  # adapters only; Step 5 drew with them on the base model; Step 6 scored them
        assert re.search(r"trained 10 steps", output)  # MAX_TRAIN_STEPS, not 4 epochs' worth
        # Step 4 scored steps 5 and 10 while it trained (by default: half the steps) and kept the best one's adapters,
        # in the bucket, its record saying which (Step 6 then scored that model)
        best = int(re.search(r"best scored step: (\d+) \(", output)[1])
        assert best in (5, 10) and "scores of step 5: DINO " in output and "scores of step 10: DINO " in output
        record = storage.read_json(f"{subject}/model-tuned/{OUTPUT_MARKER}")
        assert record["kept"]["step"] == best and record["kept"]["of_steps"] == 10
        # a bucket's run keeps each step's model on the driver's node: its scoring task drew and embedded it there, in
        # its own process (not on the actor pools a 2-node cluster's would otherwise start, on any node)
        run_folder = storage.join(subject, "ray_results", record["run_name"])
        scoring_log = storage.read_bytes(storage.join(run_folder, "scores", "step-5", "scoring.log")).decode()
        assert "scoring 8 images in this process" in scoring_log and "generating in this process" in scoring_log, \
            scoring_log
        assert storage.listdir(f"{subject}/model-tuned") == sorted([LORA_WEIGHTS_FILE, OUTPUT_MARKER, "train_config.toml"])
        assert "LoRA adapters (rank 4, alpha 4)" in output and "lr=0.0001 " in output
        assert "training on the first 4 of the 6 class images" in output and " and 4 class images at" in output
        # a retrained model's images are drawn again (Steps 5 and 6), the base model's kept; the full model's
        # scores and images went with it, right after Step 4 (a stop before Step 6 leaves none beside the LoRA)
        assert f"removed the scores in {subject}/eval and its images of the model this run replaced (the base model's " \
               "images there stay: Step 6 draws them again if this run's base model is another); Step 6 scores the " \
               "new one" in output
        # Step 6 takes the images Step 4's scoring drew of the kept step's adapters, where it was not the last step (the
        # last step's adapters saved in a bucket are not compared with those it scored: drawn again)
        if best == 5:
            assert f"tuned: 3 images taken from {run_folder}/scores/step-5/images/step-5, where the same model drew " \
                   "them with the same settings" in output and "tuned: 3 of 3 images already there; generating 0" in output
        else:
            assert "tuned: 0 of 3 images already there; generating 3" in output
        assert "base: 3 of 3 images already there; generating 0" in output
        # (not "deleting them (--force)": the script passes --force, the user did not)
        assert "the 5 images in" in output and "(trained:" in output and ", not this run's model " in output
        first = json.loads((tmp_path / "scores-of-the-full-run.json").read_text())
        assert scores["models"]["base"] == first["models"]["base"]
        assert scores["models"]["tuned"]["overall"] != first["models"]["tuned"]["overall"]
        from safetensors.torch import load_file

        lora = load_file(os.path.join(storage.cached(f"{subject}/model-tuned"), LORA_WEIGHTS_FILE))
        ups = [v for k, v in lora.items() if ".up." in k or "lora_B" in k]  # zero until trained
        assert {k.split(".")[0] for k in lora} == {"unet", "text_encoder"} and all(v.abs().sum() > 0 for v in ups)
        # In the bucket: the base model the steps read (held there already: not copied again), the run's
        # checkpoints (Ray Train's storage, beside the model) and, at the end, the script's log.
        [base] = [line.split("base model: ")[1] for line in output.splitlines() if line.startswith("base model: ")]
        assert base.startswith(f"{where}/model-orig/models--") and storage.isfile(f"{base}/model_index.json")
        assert "each node caches it from there" not in output
        runs = [r for r in storage.listdir(f"{subject}/ray_results") if r.startswith("model-tuned-")]
        assert len(runs) == 2  # (the first run's, copied, and this one's)
        assert os.path.basename(log) in storage.listdir(f"{where}/logs")
        # what the outputs name is the bucket's: the log's copy there, the settings file a rerun reads from there
        assert f"  log:    {where}/logs/{os.path.basename(log)} (this node's copy: {log})" in output
        assert re.search(rf"settings: ({re.escape(where)}/\S+) \(python train.py --config \1 repeats this run\)", output)
        return
    # Step 6 (evaluate.py): the tuned model scored beside the base model it was trained from, over
    # 2 prompts + the class prompt, 1 image each, generated and embedded on actor pools
    (tmp_path / "scores-of-the-full-run.json").write_text(json.dumps(scores))
    for label in ("tuned", "base"):
        assert len([f for f in os.listdir(evaluation / "images" / label) if f.endswith(".png")]) == 3
        assert len(os.listdir(evaluation / "grids" / label)) == 3
        overall = scores["models"][label]["overall"]
        assert all(-1 <= overall[k] <= 1 for k in ("dino", "clip_i", "clip_t", "pres")) and overall["div"] is None
        per_prompt = scores["models"][label]["per_prompt"]
        assert set(per_prompt) == {"a unqtkn toy on a beach", "a unqtkn toy in the snow"}
        assert per_prompt["a unqtkn toy on a beach"]["dino"] != per_prompt["a unqtkn toy in the snow"]["dino"]
    assert scores["models"]["tuned"]["overall"] != scores["models"]["base"]["overall"]
    report = (evaluation / "report.md").read_text()
    assert "| tuned |" in report and "| base |" in report and "| a unqtkn toy in the snow |" in report
    assert "Random weights (--tiny): every model here draws noise" in report  # (the tiny scores say nothing)
    assert "done: scores of the tuned model beside the base model in" in output
    # NOTIFY_URL heard training start and end, then the scores; the MLflow run of the training has them too.
    assert [body["event"] for _, body in webhook.received] == ["started", "finished", "finished"]
    assert webhook.received[2][1]["scores"]["dino"] == pytest.approx(scores["models"]["tuned"]["overall"]["dino"])
    assert webhook.url not in output and "a webhook URL is not shown" in output
    import mlflow

    run = json.loads((subject_dir / "model-tuned" / OUTPUT_MARKER).read_text())["trackers"]["mlflow"]
    metrics = mlflow.MlflowClient(run["tracking_uri"]).get_run(run["run_id"]).data.metrics
    assert metrics["eval/dino"] == pytest.approx(scores["models"]["tuned"]["overall"]["dino"]) and "train/loss" in metrics
    assert "the tuned model's scores added to its mlflow run" in output
    from diffusers import DiffusionPipeline

    tuned = DiffusionPipeline.from_pretrained(str(subject_dir / "model-tuned"))
    base_dir = output.split("base model: ")[1].splitlines()[0]
    base = DiffusionPipeline.from_pretrained(base_dir)
    for part in ("unet", "text_encoder"):
        a, b = getattr(tuned, part).state_dict(), getattr(base, part).state_dict()
        assert any(not torch.equal(a[k], b[k]) for k in a), part


# The flow families' script run: Steps 0-6 of one subject on a family's tiny model. What differs per family is
# proven in-process (test_families, test_family_*: each family's loss, LoRA, outputs in its pipeline, export); this
# proves the script's path for a flow family, with a full fine-tune and no class images (Step 3 skipped), of a live
# class. (SD 1.x's runs draw class images and train LoRA adapters.)
FAMILY_RUNS = {  # name: (the script's arguments, its environment beyond the common one)
    # scored every 2 steps of 12 while it trains (steps of 5 batches at 128 px, about a second each: each scoring
    # outlasts the next due step, not the run), each checkpoint uploaded in the background
    "sd3": (["--arch", "sd3", "--prior_prediction"], {
        "SCORE_STEPS": "2", "MAX_TRAIN_STEPS": "12", "NUM_NEW_IMAGES": "0", "CLASS_NAME": "dog",
        "TRAIN_ARGS": "--resolution 128 --train_batch_size 1 --gradient_accumulation_steps 5 --checkpoint_upload async "
                      "--logging_steps 1"}),
}
_FAMILY_RUNS = {}  # name: (its DATA_PREFIX, its ScriptRun), once per session


def family_run(request, name):
    """(DATA_PREFIX, ScriptRun) of FAMILY_RUNS[name], run once on the session's cluster, which succeeded. It reads
    the session's built tiny model (its Step 1 finds it in ORIG_MODEL_DIR, and the scoring models in
    EVAL_MODELS_CACHE) and scores one prompt in Step 6 (EVAL_PROMPTS)."""
    if name not in _FAMILY_RUNS:
        argv, extra = FAMILY_RUNS[name]
        where = request.getfixturevalue("tmp_path_factory").mktemp(f"{name}-run")
        prompts = where / "eval-prompts.txt"
        prompts.write_text("a {subject} on a beach\n")
        env = dict(DATA_PREFIX=str(where), NUM_CLASS_IMAGES="2", NUM_INFERENCE_STEPS="2", MAX_TRAIN_STEPS="2",
                   NUM_NEW_IMAGES="1", PYTHON=sys.executable,
                   ORIG_MODEL_DIR=model_cache_of(request.getfixturevalue(f"tiny_{name}_model")),
                   EVAL_MODELS_CACHE=request.getfixturevalue("tiny_eval_models")[0], EVAL_PROMPTS=str(prompts))
        env.update({"SCORE_STEPS": "0", **extra, "NUM_WORKERS": None})
        _FAMILY_RUNS[name] = where, run_script(["bash", "dreambooth_run.sh", "--tiny", *argv], where, env, 600)
    where, run = _FAMILY_RUNS[name]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    return where, run


def assert_step_5_skipped(subject_dir, proc, size=64):
    """A family run's NUM_NEW_IMAGES=0: Step 5 said skipped, drew nothing and named no folder of images; Step 6's images
    of the tuned model (its adapters on the base, or the full model) are at the family's size (64 px; SDXL's 128)."""
    from PIL import Image

    assert "Step 5: skipped (NUM_NEW_IMAGES=0)" in proc.stdout and not (subject_dir / "images-new").exists()
    assert "  images: " not in proc.stdout
    tuned = subject_dir / "eval" / "images" / "tuned"
    drawn = [f for f in os.listdir(tuned) if f.endswith(".png")]
    assert len(drawn) == 2  # (one prompt and the class prompt, one image each)
    for name in drawn:
        with Image.open(tuned / name) as image:
            assert image.size == (size, size)


def run_in_terminal(argv, env, timeout):
    """argv on a pseudo-terminal (its stdin, stdout and stderr), as a person runs it: (return code,
    what the terminal showed, its line ends as \\n)."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, cwd=REPO_DIR, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline, ended = [], time.time() + timeout, None
    while time.time() < deadline:
        if ended is None and proc.poll() is not None:
            ended = time.time()
        if ended is not None and time.time() > ended + 5:
            break  # a leftover process holding the terminal open
        if select.select([master], [], [], 0.5)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:  # every writer is gone
                break
            if not data:
                break
            chunks.append(data)
    if proc.poll() is None:
        proc.kill()
    os.close(master)
    return proc.wait(), b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def test_unknown_argument_is_refused():
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--use-lor"], cwd=REPO_DIR, capture_output=True, text=True)
    assert proc.returncode == 2  # (the nearest of its own flags named, in either spelling)
    assert "unknown argument '--use-lor'; did you mean --use_lora? (see --help" in proc.stderr
    # an --arch typo: at once, before Ray starts (it came after Ray's start, at Step 0; before that, at Step 1)
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny", "--arch", "Flux"], cwd=REPO_DIR, capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 2 and proc.stdout == "" and "Ray" not in proc.stderr
    assert proc.stderr.startswith("dreambooth_run.sh: error: --arch Flux: no tiny model of that family; choose from sd1")
    # a train.py flag mistyped after -- or in TRAIN_ARGS: at once, before Ray starts (it came after Ray's start)
    for argv, extra in ((["--", "--keepbest"], {}), ([], {"TRAIN_ARGS": "--use_lora --keepbest"})):
        proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny", *argv], cwd=REPO_DIR, capture_output=True,
                              text=True, env=dict(os.environ, PYTHON=sys.executable, **extra))
        assert proc.returncode == 2 and proc.stdout == "" and "Ray" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == \
            "train.py flags (TRAIN_ARGS, or after --): error: unrecognized arguments: --keepbest; did you mean --keep_best?"
    # each of its flags in either spelling, as the README says of every flag (parsed, then --help ends it)
    hyphens = subprocess.run(["bash", "dreambooth_run.sh", "--use-lora", "--skip-eval", "--prior-prediction",
                              "--skip-image-setup", "--help"], cwd=REPO_DIR, capture_output=True, text=True)
    assert hyphens.returncode == 0 and "MAX_TRAIN_STEPS" in hyphens.stdout, hyphens.stderr
    if sys.prefix == sys.base_prefix:
        return  # (no virtual environment: no Python at hand without the requirements)
    # a Python without the requirements (the one the venv was made from): one line naming what it lacks
    bare = os.path.join(sys.base_prefix, "bin", "python3")
    proc = subprocess.run(["bash", "dreambooth_run.sh", "--tiny"], cwd=REPO_DIR, capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=bare))
    assert proc.returncode == 1 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1
    assert f"{bare} lacks ray" in proc.stderr and "requirements.txt" in proc.stderr
    listing = subprocess.run(["bash", "dreambooth_run.sh", "--help"], cwd=REPO_DIR, capture_output=True, text=True)
    for variable in ("DATA_PREFIX", "INSTANCE_DIR", "CLASS_NAME", "NUM_WORKERS", "MAX_TRAIN_STEPS", "TRAIN_ARGS"):
        assert re.search(rf"^  {variable} .*\(default: ", listing.stdout, re.M), variable


@pytest.mark.parametrize("env, culprit", [
    ({"INSTANCE_DIR": "{tmp}/empty", "CLASS_NAME": "dog"}, "INSTANCE_DIR="),
    ({"INSTANCE_DIR": "{tmp}/photos"}, "CLASS_NAME is not set"),
    ({"NUM_WORKERS": "3"}, "NUM_WORKERS=3"),
    ({"INSTANCE_DIR": "{tmp}/photos", "CLASS_NAME": "dog", "NUM_WORKERS": "x"}, "NUM_WORKERS=x"),
    ({"EVAL_PROMPTS": "{tmp}/missing.txt"}, "missing.txt: no such file"),  # Step 6's file, at Step 0
    # a loss flag of the other objective for --arch's family (at Step 4 before, after the class images)
    ({"ARGS": "--arch flux", "TRAIN_ARGS": "--snr_gamma 5"}, "--snr_gamma weighs the timesteps"),
    # a typo in a number (it stopped Step 4 or 3, after the download and the class images)
    ({"MAX_TRAIN_STEPS": "2O"}, "MAX_TRAIN_STEPS=2O: must be a whole number"),
    ({"LEARNING_RATE": "1e-4x", "NUM_CLASS_IMAGES": "4"}, "LEARNING_RATE=1e-4x: must be a number"),
])
def test_a_run_that_cannot_work_stops_before_step_1_with_one_line(tmp_path, env, culprit):
    import shutil

    (tmp_path / "empty").mkdir()
    shutil.copytree(os.path.join(REPO_DIR, "images", "toy"), tmp_path / "photos")
    env = dict(os.environ, DATA_PREFIX=str(tmp_path / "data"), PYTHON=sys.executable,
               **{k: v.format(tmp=tmp_path) for k, v in env.items()})
    argv = ["bash", "dreambooth_run.sh", "--tiny", *env.pop("ARGS", "").split()]
    proc = subprocess.run(argv, cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Step 1" not in proc.stdout
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]  # (a check before the log begins: stderr's)
    assert culprit in last and "error: " in last and "Traceback" not in proc.stdout


def test_dreambooth_run_tiny_sd3_end_to_end(request):
    """`--tiny --arch sd3 --prior_prediction` with CLASS_NAME=dog: Steps 0-2, 4 and 6 with the tiny SD 3.5 model (flow
    matching, three text encoders): no class images (the base model's own predictions keep the prior), a live subject,
    from its class; the transformer and both CLIP encoders fine-tuned, no Step 5 (NUM_NEW_IMAGES=0), Step 6's images
    at the training's 128 px, scored; the export hint writes the model in Stability's single-file layout.

    Step 4 scores while it trains (SCORE_STEPS=2 of 12): step 2 and the last scored from their checkpoints by Ray
    Train's validation tasks, each step's scores those evaluate.py (Step 6) gives that step's model. The training
    did not wait: the steps after 2 were logged while step 2 was scored, and rank 0 logged its scores (metrics.jsonl,
    a line) as they came, mid-run; a due step that came while another was still being scored was not (one scoring at
    a time, a line says so); step 12's scores, which came after the last step, the driver added at the end. The base
    model was scored beside them; the saved model is the best-scored step's by the sweep's rule (--keep_best), as the
    lines and its record say, and no other step's model is left. (The scores' bookkeeping: tests/unit/test_checkpoint_scores.py.)"""

    tmp_path, proc = family_run(request, "sd3")
    subject_dir = tmp_path / "subjects" / "example-toy"
    assert "models--dreambooth-ray--tiny-stable-diffusion-3" in re.search(r"base model: (\S+)", proc.stdout)[1]
    assert "training transformer + text encoder" in proc.stdout + proc.stderr
    assert "Step 3: skipped (--prior_prediction" in proc.stdout and not (tmp_path / "images-reg").exists()
    assert "towards the base model's prediction" in proc.stdout + proc.stderr
    assert "SUBJECT_TYPE         live (from CLASS_NAME=dog" in proc.stdout
    assert "ORIG_MODEL_NAME      (--tiny: the built-in tiny sd3 model)" in proc.stdout  # (not sd14's name)
    tuned = json.loads((subject_dir / "model-tuned" / "model_index.json").read_text())
    assert tuned["_class_name"] == "StableDiffusion3Pipeline"
    kept, base = assert_scored_while_training(subject_dir, proc.stdout + proc.stderr)
    assert_step_5_skipped(subject_dir, proc, size=128)
    scores = json.loads((subject_dir / "eval" / "scores.json").read_text())
    assert set(scores["models"]) == {"tuned", "base"} and scores["models"]["tuned"]["overall"]["dino"] is not None
    # Step 6 drew nothing: the kept step's images and the base model's are those Step 4's scoring drew (the last step's
    # model too, its files those it scored)
    for label in ("tuned", "base"):
        assert f"{label}: 2 images taken from " in proc.stdout and f"{label}: 2 of 2 images already there; generating 0" \
            in proc.stdout, proc.stdout[-3000:]
    # ... and the scores Step 6 gives them are those Step 4 logged: the kept step's and the base model's
    for label, logged in (("tuned", kept), ("base", base)):
        overall = scores["models"][label]["overall"]
        assert {k: round(overall[k], 4) for k in score_record.SCORE_KEYS} == \
            {k: round(logged[k], 4) for k in score_record.SCORE_KEYS}, label
    hint = re.search(r"for AUTOMATIC1111/ComfyUI: (.*)", proc.stdout)[1].split()
    export = subprocess.run([sys.executable, *hint[1:]], cwd=REPO_DIR, check=True, capture_output=True,
                            text=True)
    assert "kernels" not in export.stderr  # (bitsandbytes' note on CPUs with AVX-512 BF16: not on the user's console)
    from safetensors import safe_open

    with safe_open(subject_dir / "example-toy.safetensors", "pt") as f:
        assert "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight" in set(f.keys())


def assert_scored_while_training(subject_dir, output):
    """The checks of Step 4's scores while training (SCORE_STEPS=2 of 12, --checkpoint_upload async); (the kept step's
    logged scores, the base model's)."""
    from dreambooth.training import checkpoint_scores

    [run_dir] = glob.glob(str(subject_dir / "ray_results" / "model-tuned-*"))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    scored = {row["step"]: row for row in rows if "dino" in row}
    # one scoring at a time: step 2 and the last are always scored; each due step between them either is, or a line
    # says which scoring was still going (which ones depends on the machine's speed: a scoring takes seconds here, a
    # step about one; the bookkeeping itself is tests/unit/test_checkpoint_scores.py's)
    assert {2, 12} <= set(scored) <= {2, 4, 6, 8, 10, 12}, rows
    for step in sorted({4, 6, 8, 10} - set(scored)):
        passed_over = re.search(rf"step {step} is not scored: step (\d+)'s scoring has not finished", output)
        assert passed_over and int(passed_over[1]) in scored and int(passed_over[1]) < step, (step, output[-3000:])
    assert all(-1 <= scored[s][k] <= 1 for s in scored for k in ("dino", "clip_i")), scored
    said = {step: checkpoint_scores.describe(step, {k: scored[step][k] for k in score_record.SCORE_KEYS})
            for step in scored}
    loss_logged = {row["step"]: row["time"] for row in rows if "loss" in row}
    # each checkpoint (every scored step's: 2, 4, ...) said how long the steps stopped for it, in the next window's row
    assert {row["step"] for row in rows if "checkpoint_s" in row} == set(range(3, 12, 2)), rows
    # the steps went on while step 2 was scored, and its scores were logged by rank 0 before the last step
    assert loss_logged[3] < os.path.getmtime(os.path.join(run_dir, "scores", "step-2", "scores.json"))
    assert scored[2]["time"] < loss_logged[12] and said[2] in output
    assert said[12] in output and "scored steps: 2, " in output  # (the driver's, at the end)
    # the training ended with the last step's scoring still to come: rank 0 said the run waits for it
    assert re.search(r"trained to step 12; the run ends once the scoring of step\(s\) (\d+, )*12 has ended \(one at a "
                     r"time, \d+ images each", output), output[-3000:]
    assert os.path.isfile(os.path.join(run_dir, "scores.png"))
    # the best step by the sweep's rule: the highest DINO among the steps whose CLIP-T is at most 0.02 (the default
    # margin) below the base model's, the earliest of equals; its model saved, and no step's model left behind
    base = json.load(open(os.path.join(run_dir, "scores", "base.json")))
    kept = [s for s in sorted(scored) if scored[s]["clip_t"] >= base["clip_t"] - 0.02]
    best = max(kept or sorted(scored), key=lambda s: scored[s]["dino"])
    # (its DINO at 3 decimals, or at more beside a runner-up's that reads the same at 3)
    line = re.search(rf"best scored step: {best} \(DINO (-?[\d.]+)(, step \d+'s -?[\d.]+)?, CLIP-T "
                     rf"{scored[best]['clip_t']:.3f}; ", output)
    assert line and float(line[1]) == pytest.approx(scored[best]["dino"], abs=5e-4), output[-2000:]
    out = subject_dir / "model-tuned"
    assert (f"saved: step {best}'s model, the best scored, in {out} instead of step 12's (--keep_best)" if best != 12
            else f"saved: the last step's model, the best scored, in {out} (--keep_best)") in output
    record = json.loads((out / OUTPUT_MARKER).read_text())
    assert record["steps"] == best and record["kept"]["step"] == best and record["kept"]["of_steps"] == 12
    assert record["kept"]["why"].startswith(f"best scored step: {best} ") and record["kept"]["scores"]["dino"] == \
        pytest.approx(scored[best]["dino"])
    assert not glob.glob(os.path.join(run_dir, "scores", "step-*", "model"))
    # what scoring said as it went is in the step's log, not among the training's lines (the base model scored as a
    # step is, by a task of its own from the run's start: 2 images and the 5 photos each; on this one-node cluster,
    # drawn and embedded in the task's own process, no actor pool started)
    for scored_model in ("step-2", "base"):
        log = open(os.path.join(run_dir, "scores", scored_model, "scoring.log")).read()
        assert "scoring 7 images in this process" in log and "generating in this process" in log, log
    return scored[best], base

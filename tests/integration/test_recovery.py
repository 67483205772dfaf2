"""Runs that are cut short: resume with every GPU option, a full disk, interrupted generation, a Ray Job stopped. (A
SIGKILLed train worker then SIGTERM: test_storage_ray, in a bucket; a drained node: test_elastic; test_bench's
gpu_check.sh dry run also kills a train worker; test_sweep's long test kills a LoRA trial's.)"""

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image
from support import STOP_OPTIONS
from support import draw_here
from support import logged_losses
from support import train_args

from dreambooth import storage
from dreambooth.commands import generate
from dreambooth.commands import train
from dreambooth.files import REPO_DIR
from dreambooth.planning import checkpoints
from dreambooth.training import runlog


def env():
    """The scripts' environment: this one's at the time (RAY_ADDRESS: the session's cluster), offline."""
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def checkpoint_steps(run_dir):
    """The steps of the whole checkpoints in a run folder (a folder's or a bucket's)."""
    steps = []
    for name in storage.listdir(run_dir):
        state = storage.join(run_dir, name, checkpoints.STATE_FILE)
        if name.startswith("checkpoint_") and storage.isfile(state):
            steps.append(storage.read_json(state)["step"])
    return sorted(steps)


def worker_pids(since):
    """PIDs of Ray Train worker processes started after `since` (epoch seconds)."""
    boot = time.time() - float(open("/proc/uptime").read().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if not open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"ray::RayTrainWorker"):
                continue
            started = boot + int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]) / ticks
        except OSError:
            continue
        if started >= since - 1:
            pids.append(int(pid))
    return pids


def wait_for(predicate, timeout, proc):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.kill()
    pytest.fail("timed out waiting")


def finish(proc, timeout):
    """(stdout, stderr) of proc once it ends; killed after timeout, the test fails with the end of what it printed."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")


def start_train(args):
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO_DIR, env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run_dirs(runs):
    """The run folders under a storage path (a folder's or a bucket's)."""
    return [storage.join(str(runs), d) for d in storage.listdir(str(runs))]


def registered_steps_under(storage):
    """checkpoints.registered_steps of every run under storage."""
    return [s for d in run_dirs(storage) for s in checkpoints.registered_steps(d)]


def test_killed_generation_rerun_gives_exactly_the_uninterrupted_images(ray_session, tiny_model, tmp_path):
    """generate.py SIGTERMed mid-way (a half-written image left as a kill leaves it), one of its images lost too: the
    same command again (prompts given as two flags, another batch size, one actor) draws exactly what is missing,
    pixel for pixel the uninterrupted run's, and leaves the rest untouched; each image its own seed; the folder
    then holds the images, the grid and the records, no temporary file."""
    from dreambooth.generation import drawing
    from dreambooth.generation import image_records

    prompts = ["photo of a dog", "photo of a cat"]

    def flags(folder):
        return ["--model_dir", tiny_model, "--output_dir", str(folder), "--num_samples_per_prompt", "5",
                "--num_inference_steps", "20", "--seed", "3"]

    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "generate.py", *flags(cut), "--prompts", *prompts, "--batch_size", "1",
                             "--use_ray_data"], cwd=REPO_DIR, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.isdir(cut) and len([f for f in os.listdir(cut) if f.endswith(".png")]) >= 3, 180, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    made = sorted(f for f in os.listdir(cut) if f.endswith(".png"))
    assert 3 <= len(made) < 10
    (cut / (made[0] + ".tmp-99999")).write_bytes(b"half an image")  # as a kill mid-write leaves it
    os.remove(cut / made[1])  # (an image lost since)
    kept_mtime = os.path.getmtime(cut / made[2])

    files = generate.main([*flags(cut), "--prompts", prompts[0], "--prompts", prompts[1], "--batch_size", "2",
                           "--num_actors", "1"])  # the rerun, on this session's Ray
    # the uninterrupted run: the same flags' images drawn in this process, without a pool's start
    draw_here(tiny_model, tmp_path / "whole", prompts, 5, drawing.ImageSettings(num_inference_steps=20, seed=3))
    names = sorted(f for f in os.listdir(tmp_path / "whole") if f.endswith(".png"))
    assert files == [drawing.image_file_name(p, i) for p in prompts for i in range(5)]  # (the plan's order)
    assert sorted(files) == names
    assert sorted(os.listdir(cut)) == sorted(names + [drawing.GRID_DIR, image_records.IMAGES_RECORD,
                                                      image_records.IMAGES_CONFIG])  # (no .tmp file left)
    assert os.path.isfile(cut / drawing.GRID_DIR / "grid.png")
    assert os.path.getmtime(cut / made[2]) == kept_mtime
    drawn = {name: np.asarray(Image.open(cut / name).convert("RGB"), dtype=int) for name in names}
    for name in names:
        b = np.asarray(Image.open(tmp_path / "whole" / name).convert("RGB"), dtype=int)
        np.testing.assert_allclose(drawn[name], b, atol=1)
    assert drawn[names[0]].shape == (64, 64, 3) and not np.array_equal(drawn[names[0]], drawn[names[1]])


def final_weights(folder):
    from safetensors.torch import load_file

    parts = (("unet", "diffusion_pytorch_model.safetensors"), ("text_encoder", "model.safetensors"),
             ("text_encoder_2", "model.safetensors"))  # (SDXL's second encoder)
    return {part: load_file(os.path.join(folder, part, name)) for part, name in parts
            if os.path.isfile(os.path.join(folder, part, name))}


@pytest.mark.parametrize("family, compiler, precision", [("sd1", "aot_eager", "bf16"), ("sdxl", "eager", "fp16")])
def test_seeded_run_cut_and_resumed_with_every_gpu_option_ends_with_the_uninterrupted_weights(
        ray_session, family, compiler, precision, request, toy_images, tmp_path, capsys):
    """channels-last, fused AdamW, mixed precision (SD 1.x: bf16, the default on the GPUs that have it; SDXL: fp16 +
    GradScaler, at 64 px; the scale's round trip: test_checkpoint), torch.compile (SD 1.x with AOT autograd, SDXL
    (both text encoders) by dynamo alone; DDP's compiled by dynamo: test_dreambooth_run's LoRA run), gradient checkpointing of
    UNet and text encoder(s), the two-device split, random flips, in this process (--num_workers 0: Ray Train's
    local mode, its checkpoints written by the loop; a resume on 2 DDP workers to the same weights:
    test_storage_ray, and sharded: test_fsdp_ray); and the
    moving average of the weights (--use_ema), which the saved model holds, caption dropout, whose
    draws a resumed run continues, and prior preservation by the base model's prediction (a frozen
    UNet in the autocast precision); SDXL with a VAE of its own, kept in the saved model. (fp16 on a CPU:
    PyTorch's fp16 convolution backward is 25 to 100x slower than bf16's there: SDXL's tiny step at 128 px
    16.7 CPU-s against 0.7, at 64 px 4.9: fp16 in one arm, at 64 px.)

    The same seed gives the same losses (validation sampling in between changes nothing);
    '--resume_from_checkpoint latest' starts fresh when there is nothing to resume, then goes on
    from step 2 with the step count and the LR warm-up where they were; the resumed run ends with
    exactly the weights of the uninterrupted one: the uninterrupted run's own checkpoint of step 2 resumed into a
    new output (two runs). SD 1.x's finished run is then continued to more steps, as the schedule allows."""
    tiny_model = request.getfixturevalue("tiny_sdxl_model" if family == "sdxl" else "tiny_model")
    options = ["--num_workers", "0", "--channels_last", "--fused_adamw", "--mixed_precision", precision,
               "--torch_compile", compiler,
               "--gradient_checkpointing", "--gpus_per_worker", "2", "--random_flip", "--checkpointing_steps", "2",
               "--logging_steps", "1", "--lr", "1e-3", "--lr_warmup_steps", "4", "--seed", "5",
               "--use_ema", "--ema_decay", "0.5", "--ema_update_after_step", "1", "--caption_dropout_rate", "0.5",
               "--prior_preservation", "prior_prediction", "--class_prompt", "photo of a toy"]
    sampling = ["--validation_prompt", "photo of unqtkn toy", "--validation_steps", "1", "--num_validation_images",
                "2", "--validation_inference_steps", "2"]
    if family == "sdxl":  # (its tiny model's default is 128 px) and a VAE of its own, as SDXL's fp16-fix one is
        from support import vae_of_its_own

        own_vae = vae_of_its_own(tiny_model, tmp_path / "own-vae")
        options += ["--resolution", "64", "--pretrained_vae_model_name_or_path", str(own_vae)]
    resume_the_uninterrupted_runs_checkpoint(tiny_model, toy_images, tmp_path, options, sampling, capsys)
    if family == "sdxl":  # kept as given in the saved model (frozen, trained with)
        from safetensors.torch import load_file

        saved, given = (load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
                        for folder in (tmp_path / "whole" / "vae", own_vae))
        assert saved.keys() == given.keys() and all(torch.equal(v, given[k]) for k, v in saved.items())
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    base = final_weights(tiny_model)
    for part in a:
        assert any(not torch.equal(v, base[part][k]) for k, v in a[part].items())  # it trained
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)
    if family == "sd1":  # a finished run continued to more steps (its schedule does not depend on the length)
        more = train.main(train_args(tiny_model, toy_images, tmp_path / "whole", 5, *options,
                                     "--resume_from_checkpoint", "latest"))
        assert "--max_train_steps 4 -> 5: continuing that run" in capsys.readouterr().err
        assert more.metrics["step"] == 5 and [s for s, _ in logged_losses(more)] == [1, 2, 3, 4, 5]


def resume_the_uninterrupted_runs_checkpoint(tiny_model, toy_images, tmp_path, options, sampling, capsys):
    """The uninterrupted 4-step run, drawing validation samples at each step and keeping its checkpoint of step 2;
    that checkpoint resumed into a new output, without samples, to step 4: the same losses and weights."""
    kept = ["--keep_checkpoints", "--checkpoints_total_limit", "2"]
    whole = train.main(train_args(tiny_model, toy_images, tmp_path / "whole", 4, *options, *sampling, *kept,
                                  "--resume_from_checkpoint", "latest"))
    assert "starting fresh" in capsys.readouterr().err  # no checkpoint yet
    assert sorted(os.listdir(os.path.join(whole.path, "validation"))) == [
        "step-1", "step-2", "step-3", "step-4", "timeline.png"]
    step_2 = checkpoints.by_step(os.path.dirname(whole.path), "whole")[2]
    resumed = train.main(train_args(tiny_model, toy_images, tmp_path / "cut", 4, *options,
                                    "--resume_from_checkpoint", step_2))
    err = capsys.readouterr().err
    assert "resuming from" in err and "removed the run's 1 checkpoint(s) (" in err  # (steps 3-4: its own one)
    assert resumed.metrics["step"] == whole.metrics["step"] == 4
    assert logged_losses(resumed) == logged_losses(whole)  # (steps 1-2 carried from the checkpoint's record)
    with open(os.path.join(whole.path, runlog.METRICS_FILE)) as f:  # 4 steps of warm-up in all
        assert [m["lr"] for m in map(json.loads, f)][1] == pytest.approx(1e-3 * 2 / 4)
    assert resumed.metrics["lr"] == pytest.approx(1e-3)
    assert checkpoint_steps(resumed.path) == []  # (its model saved: its checkpoint removed)


def logged_steps(runs):
    """The steps in the metrics.jsonl of the runs under a storage path (a folder's or a bucket's), as far as they can be
    read now: a test polls them while rank 0 writes them, and a copy being uploaded to a bucket can be read half new
    (its lines that do not parse are not counted yet)."""
    steps = []
    for folder in run_dirs(runs):
        path = storage.join(folder, runlog.METRICS_FILE)
        if storage.isfile(path):
            for line in storage.read_bytes(path).decode(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    steps.append(json.loads(line)["step"])
    return steps


def same_weights(a_folder, b_folder):
    a, b = final_weights(a_folder), final_weights(b_folder)
    assert set(a) == {"unet", "text_encoder"}
    for part in a:
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), (part, k)


def test_a_rank_whose_poll_was_sent_before_the_request_still_names_the_signal(ray_session, capsys):
    """Rank 0 can read the stop flag just before the driver's request lands while rank 1 reads it after: the
    all-reduce says stop and rank 0 reads again, so the stop line names SIGTERM, not 'a signal'. The flag's key
    is gone once the run forgets it. Before rank 0's poll exists (the workers starting, loading the model), the
    driver's first Ctrl-C ends the run at once: no step to checkpoint (it asked the workers, and waited for them to
    start and train a step: a minute of silence on a busy machine)."""
    import signal

    from dreambooth.training import stopping

    flag = stopping.make_flag()
    aborted, previous = [], (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    try:
        stopping.install_handlers(flag, lambda *args: aborted.append(args[0]))
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    assert aborted == [signal.SIGINT] and stopping.requested(flag) is None and not stopping.begun(flag)
    assert capsys.readouterr().err == "SIGINT: the workers had not begun training (nothing to checkpoint): the run " \
                                      "stops now, once Ray Train has ended them (seconds)\n"
    poll = stopping.StopPoll(flag, world=1, rank=0)
    assert stopping.begun(flag)  # (from here a stop checkpoints the step the workers are on)
    assert poll.reason() is None  # (this rank's read, before the request)
    stopping.request(flag, "SIGTERM")
    stopping.request(flag, "SIGINT")  # (a later signal does not rename the stop)
    assert stopping.requested(flag) == "SIGTERM" and stopping.requested(stopping.make_flag()) is None
    poll.await_reason()
    assert poll.seen == "SIGTERM"
    stopping.forget(flag)
    assert stopping.requested(flag) is None and not stopping.begun(flag)
    # (the steps rank 0 waits on for their scores once trained, which a Ctrl-C then names: the run's keys too)
    from dreambooth.training import checkpoint_scores

    checkpoint_scores.note_waiting(flag, {8, 6})
    assert checkpoint_scores.waiting_on(flag) == [6, 8]
    checkpoint_scores.forget(flag)
    assert checkpoint_scores.waiting_on(flag) == []


@pytest.fixture()
def jobs_cluster(tmp_path, monkeypatch):
    """A Ray cluster of its own with Ray Jobs' server (the dashboard, on 127.0.0.1, token authentication):
    its http:// address for `ray job` and JobSubmissionClient."""
    from support import free_port

    from dreambooth.cluster import raycluster

    ports = [free_port(), free_port(), free_port()]
    with monkeypatch.context() as started:  # (its job server would look for agents in the session's cluster)
        started.delenv("RAY_ADDRESS", raising=False)
        head, _ = raycluster.start_ray_head(tmp_path / "head.log", ports[0], extra=[
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports[1]}", "--num-cpus=3",
            "--num-gpus=0", f"--dashboard-agent-listen-port={ports[2]}"])  # (not the session cluster's agent's)
    try:
        address = f"http://127.0.0.1:{ports[1]}"
        deadline = time.time() + 60  # (the job agent starts after the head says it is up)
        while why := job_agent_up(address):
            assert time.time() < deadline, why[-2000:]
            time.sleep(1)
        yield address
    finally:
        raycluster.stop_ray_head(head)


def ray_job(address, *args, timeout=300):
    """`ray job <args>` as a user types it, the cluster named by RAY_API_SERVER_ADDRESS (RAY_ADDRESS, which would
    override --address, unset): (exit code, what it printed)."""
    job_env = {k: v for k, v in env().items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "job", *args], capture_output=True,
                          text=True, env=dict(job_env, RAY_API_SERVER_ADDRESS=address), timeout=timeout)
    return proc.returncode, re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # (without its colours)


@functools.lru_cache
def job_client(address):
    """Ray's JobSubmissionClient of the cluster at address (what `ray job` itself calls), for the test's own polling:
    a `ray job` process for each poll would be a Python start each time. Made once an address (one that fails, while
    the server is not up yet, is not kept)."""
    from unittest import mock

    from ray.job_submission import JobSubmissionClient

    with mock.patch.dict(os.environ, {"RAY_API_SERVER_ADDRESS": address}):  # (else RAY_ADDRESS's cluster is asked)
        return JobSubmissionClient(address)


def job_agent_up(address):
    """None once the cluster's Ray Jobs server takes a job (its agent starts after the head: a job of `true`
    submitted), else why not."""
    try:
        job_client(address).submit_job(entrypoint="true")
        return None
    except Exception as err:  # (connection refused, "No available agent" until the agent is up)
        return f"{type(err).__name__}: {err}"


def job_state(address, job_id):
    return str(job_client(address).get_job_status(job_id).value)


def wait_for_job(address, job_id, timeout):
    deadline = time.time() + timeout
    while (state := job_state(address, job_id)) in ("PENDING", "RUNNING") and time.time() < deadline:
        time.sleep(1)
    return state


def test_a_ray_job_stopped_checkpoints_its_step_and_its_resubmission_ends_on_the_uninterrupted_weights(
        ray_session, jobs_cluster, tiny_model, toy_images, tmp_path):
    """train.py as a Ray Job (the working directory shipped by Ray, Ray Jobs' server from ray[serve]'s packages):
    `ray job stop` (SIGTERM to the driver) makes the run checkpoint the step it is on within RAY_JOB_STOP_WAIT_TIME_S,
    the job ends STOPPED, and the same job submitted again with --resume_from_checkpoint latest SUCCEEDS with the
    uninterrupted run's weights. The job trains in its driver (--num_workers 0, Ray Train's local mode): what is
    Ray Jobs' here is the job's life, not the workers (a signal reaches every worker of a run: test_storage_ray). A
    job whose training cannot start FAILS with the one-line cause in its logs and `ray job submit`'s exit code."""
    in_driver, steps = [*STOP_OPTIONS, "--num_workers", "0"], 80  # (steps enough that the stop comes mid-run)
    whole = tmp_path / "whole"  # (the uninterrupted run, here in this process)
    train.main(train_args(tiny_model, toy_images, whole, steps, *in_driver, "--storage_path",
                          str(tmp_path / "whole-runs")))
    storage = tmp_path / "job-runs"
    args = train_args(tiny_model, toy_images, tmp_path / "job", steps, *in_driver, "--storage_path", str(storage))
    submit = ["submit", "--no-wait", f"--working-dir={REPO_DIR}",
              '--runtime-env-json={"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}}', "--", sys.executable, "train.py"]
    code, said = ray_job(jobs_cluster, *submit, *args)
    assert code == 0, said[-3000:]
    job = re.search(r"Job '([^']+)' submitted successfully", said)[1]
    deadline = time.time() + 240
    while len(logged_steps(storage)) < 2:
        assert time.time() < deadline and job_state(jobs_cluster, job) in ("PENDING", "RUNNING"), \
            ray_job(jobs_cluster, "logs", job)[1][-3000:]
        time.sleep(0.5)
    code, said = ray_job(jobs_cluster, "stop", job)
    assert wait_for_job(jobs_cluster, job, 180) == "STOPPED", said
    logs = ray_job(jobs_cluster, "logs", job)[1]
    [step] = checkpoint_steps(run_dirs(storage)[0])
    assert "SIGTERM: every worker checkpoints the step it is on" in logs and f"stopped at step {step} of" in logs, logs[-3000:]
    assert "this process (--num_workers 0: Ray Train's local mode)" in logs
    code, said = ray_job(jobs_cluster, *submit, *args, "--resume_from_checkpoint", "latest")
    again = re.search(r"Job '([^']+)' submitted successfully", said)[1]
    assert wait_for_job(jobs_cluster, again, 300) == "SUCCEEDED", ray_job(jobs_cluster, "logs", again)[1][-3000:]
    assert f"trained {steps} steps" in ray_job(jobs_cluster, "logs", again)[1]
    same_weights(whole, tmp_path / "job")
    # Waiting for it, as `ray job submit` does by default: a failing job's cause in one line, a non-zero exit code.
    code, said = ray_job(jobs_cluster, "submit", f"--working-dir={REPO_DIR}", "--", sys.executable, "train.py",
                         *train_args(tiny_model, str(tmp_path / "no-photos"), tmp_path / "none", 2))
    assert code != 0 and f"error: instance folder not found: {tmp_path / 'no-photos'}" in said, said[-3000:]


# Run inside the full-disk test's mount namespace: STORAGE OUT FOLDER TRAIN_COMMAND... Small file systems on
# STORAGE and OUT, one Ray cluster for three runs of TRAIN_COMMAND (its stderr and exit code in FOLDER/run<n>.err
# and .rc), STORAGE grown after the first run and OUT after the second; `find` listings of both in FOLDER. The first
# run as given (a Ray Train worker); the reruns with --num_workers 0 (in the script's process, which writes its
# checkpoints itself: the second resumes the first's, the third its own).
FULL_DISK_RUNS = """
import os, subprocess, sys
from dreambooth.cluster import raycluster

storage, out, folder, *train = sys.argv[1:]
for size, where in (("18m", storage), ("1m", out)):
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], check=True)
head, os.environ["RAY_ADDRESS"] = raycluster.start_ray_head(os.path.join(folder, "head.log"))
try:
    for n, listed, grown in ((1, storage, storage), (2, None, out), (3, out, None)):
        if n == 2:
            train[train.index("--num_workers") + 1] = "0"
        with open(os.path.join(folder, f"run{n}.err"), "w") as err:
            rc = subprocess.run(train, stderr=err).returncode
        open(os.path.join(folder, f"run{n}.rc"), "w").write(f"rc={rc}")
        if listed:
            with open(os.path.join(folder, "after1.txt" if n == 1 else "out.txt"), "w") as listing:
                subprocess.run(["find", listed], stdout=listing, check=True)
        if grown:
            subprocess.run(["mount", "-o", "remount,size=200m", grown], check=True)
finally:
    raycluster.stop_ray_head(head)
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare (root)")
def test_a_full_disk_stops_at_once_keeps_the_newest_checkpoint_and_its_resume_finishes(tiny_model, toy_images,
                                                                                     tmp_path):
    """Checkpoints and the model on small file systems of their own (tmpfs in a mount namespace, with a
    Ray cluster started inside it for the three runs, so its workers write there too): the second checkpoint
    does not fit, then the model does not; each run stops at once in one line, leaves no half checkpoint, and
    after the room is made the rerun finishes from the newest complete checkpoint (the last: no step left). The
    first run on a Ray Train worker, which Ray Train does not restart (the disk would be as full); the reruns in
    the script's own process (--num_workers 0), which resumes a worker's checkpoint and its own alike."""
    storage, out = tmp_path / "storage", tmp_path / "out"
    storage.mkdir(), out.mkdir()
    args = ["--model_dir", tiny_model, "--output_dir", str(out / "model"), "--storage_path", str(storage),
            "--instance_images_dir", toy_images, "--instance_prompt", "photo of unqtkn toy", "--num_workers", "1",
            "--train_batch_size", "1", "--max_train_steps", "4", "--checkpointing_steps", "2",
            "--checkpoints_total_limit", "1", "--resume_from_checkpoint", "auto", "--seed", "1"]
    environment = {k: v for k, v in env().items() if k != "RAY_ADDRESS"}  # its own Ray, inside the namespace
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", FULL_DISK_RUNS,
                           str(storage), str(out), str(tmp_path), sys.executable, "train.py", *args], cwd=REPO_DIR,
                          env=environment, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]

    def result(n):
        return open(tmp_path / f"run{n}.rc").read().strip(), open(tmp_path / f"run{n}.err").read()

    rc, err = result(1)  # the checkpoint of step 4 did not fit beside step 2's
    last = err.strip().splitlines()[-1]
    assert rc == "rc=1" and "Traceback" not in err, err[-3000:]
    assert f"no space left on the device of {storage}" in last and "checkpoint of step 4" in last
    assert "MB free there, about" in last and "restarting" not in err  # no restart: it would meet the same disk
    left = [line for line in open(tmp_path / "after1.txt").read().split() if "/checkpoint_" in line
            and line.endswith(checkpoints.STATE_FILE)]
    assert len(left) == 1  # step 2's, whole; the half-written step 4 was removed
    folders = {os.path.dirname(p) for p in open(tmp_path / "after1.txt").read().split()
               if os.path.basename(os.path.dirname(p)).startswith("checkpoint_")}
    assert folders == {os.path.dirname(left[0])}
    rc, err = result(2)  # resumed at step 2; step 4's checkpoint fits now, the model does not
    assert rc == "rc=1" and "resuming from" in err and f"no space left on the device of {out / 'model'}" in \
        err.strip().splitlines()[-1] and "Traceback" not in err, err[-3000:]
    assert "this process (--num_workers 0: Ray Train's local mode)" in err
    rc, err = result(3)  # resumed at step 4: nothing to train, the model saved
    assert rc == "rc=0", err[-3000:]
    assert "trained 4 steps; no step left to train after the checkpoint; model saved to" in err
    assert str(out / "model" / "unet") in open(tmp_path / "out.txt").read()


# Another job's placement group holding every CPU of the cluster it joins (sys.argv[1]) until its stdin closes.
HOLD_EVERY_CPU = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], log_to_driver=False)
group = placement_group([{"CPU": n["Resources"]["CPU"]} for n in ray.nodes() if n["Alive"]], strategy="STRICT_SPREAD")
ray.get(group.ready(), timeout=120)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_run_whose_data_stream_has_no_cpu_left_on_two_nodes_ends_in_one_line_naming_what_waits(
        two_node_cluster, tiny_model, toy_images, tmp_path):
    """A CPU-only cluster of two nodes with no resources of its own, every CPU held (another job's placement group; a
    lost node, in a run whose workers held the CPUs left, leaves the same): the data stream's tasks never run. The run
    (the loop in the driver, --num_workers 0) does not wait forever: after --stall_timeout seconds without a batch it
    ends in one line that names what Ray reports as waiting and the nodes' free CPUs. (The default limit and the
    checkpoint named to continue from: tests/unit/test_stall.py; each node keeping a CPU for the data stream
    wherever the workers are packed: tests/unit/test_resources.py.)"""
    address, _ = two_node_cluster
    holder = subprocess.Popen([sys.executable, "-c", HOLD_EVERY_CPU, address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert holder.stdout.readline().strip() == "held"
        began = time.time()
        proc = subprocess.run([sys.executable, "train.py", *train_args(tiny_model, toy_images, tmp_path / "out", 4),
                               "--num_workers", "0", "--stall_timeout", "5"], cwd=REPO_DIR, capture_output=True,
                              text=True, timeout=300, env=dict(env(), RAY_ADDRESS=address))
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: training failed: stalled: no data for step 1 in \d+ s \(--stall_timeout 5\); the "
                        r"cluster cannot run the data stream \(Ray reports waiting: .*\{CPU: 1\}.*; 2 node\(s\), 0 of 3 "
                        r"CPUs free\): free a CPU or add a node; no checkpoint was written yet \(traceback in .*\)", last), last
    assert "Traceback" not in proc.stderr and time.time() - began < 120

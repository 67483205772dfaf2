"""Elastic training (--min_workers) on two nodes: a drain notice checkpoints the step the workers are on, the drained
node's loss leaves the run going on with the workers left, it grows back when the node returns, and ends on the
weights of the run that never changed size."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from support import STOP_OPTIONS
from support import STOP_STEPS
from support import free_port
from support import node_command
from support import ray_temp
from support import start_node
from support import stop_node
from support import train_args
from test_recovery import env
from test_recovery import final_weights
from test_recovery import finish
from test_recovery import registered_steps_under
from test_recovery import run_dirs
from test_recovery import wait_for
from test_recovery import worker_pids

from dreambooth.cluster import raycluster
from dreambooth.files import REPO_DIR
from dreambooth.training import runlog


def logged_rows(storage):
    """[(step, workers, loss)] of the run's metrics.jsonl rows (each step once: a restarted group's repeats are
    dropped)."""
    rows = []
    for folder in run_dirs(storage):
        path = os.path.join(folder, runlog.METRICS_FILE)
        if os.path.isfile(path):
            rows += [(r["step"], r.get("workers"), r["loss"]) for r in map(json.loads, open(path)) if "loss" in r]
    return rows


def logged_workers(storage):
    """[(step, workers)] of the run's metrics.jsonl rows."""
    return [(step, workers) for step, workers, _ in logged_rows(storage)]


def node_id_of(address, cpus):
    """The id of the cluster's live node with cpus CPUs."""
    find = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            f"print(*[n['NodeID'] for n in ray.nodes() if n['Alive'] and n['Resources'].get('CPU') == {cpus}])")
    return subprocess.run([sys.executable, "-c", find, address], capture_output=True, text=True, env=env(),
                          check=True).stdout.strip()


# What the driver says once the workers have checkpointed the step they are on for a drain notice.
DRAINED = re.compile(r"node\(s\) (\w+)… \(ranks? [\d, ]+\) being drained, deadline in \d+ s: step (\d+) checkpointed "
                     r"in [\d.]+ s; training goes on")


def test_an_elastic_run_checkpoints_at_a_drain_notice_goes_on_without_the_lost_node_grows_back_and_ends_on_the_uninterrupted_weights(
        uninterrupted, tiny_model, toy_images, tmp_path, monkeypatch):
    """--num_workers 2 --min_workers 1 on a cluster of two nodes, each with one slot for a worker
    (--resources_per_worker slot=1) and the head with a CPU to spare for the data. After step 2's checkpoint, as a
    spot node is reclaimed: first `ray drain-node` on the second node (the reclaim notice): Ray Train's preemption
    watcher says so, the workers checkpoint the step they are on and train on, on the uninterrupted run's losses
    (the workers are paused (SIGSTOP) from the drain until the watcher has said so: else a fast machine ends the
    run before the workers ask). Then the node is SIGKILLed with its worker: the run goes on with the head's worker
    alone, which trains both blocks of each step. The node started again (that worker paused meanwhile: the tiny run
    would end first), the run grows back to 2 workers. The weights are the uninterrupted 2-worker run's, to float
    rounding (one worker adds the two blocks' gradients where DDP averages two workers'): each step trained the same
    rows with the same noise whoever trained it."""
    whole, whole_losses = uninterrupted
    # (the paused worker answers nothing: the Train controller's wait for its process group to shut down, 30 s by
    # default, 5 here; the cluster's processes have the variable from the head's start)
    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "5")
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")  # (Ray Train's drain watcher: 5 s by default)
    head, address = raycluster.start_ray_head(tmp_path / "head.log", free_port(),
                                              extra=["--num-cpus=2", "--num-gpus=0", '--resources={"slot": 1}'])
    temp = ray_temp("n")  # (the node's own)
    command = ["sh", "-c", node_command(address, temp, ["--num-cpus=1", "--num-gpus=0", '--resources={"slot": 1}'])]
    node = start_node(command, tmp_path / "node.log") or start_node(command, tmp_path / "node.log")
    try:
        assert node is not None, open(tmp_path / "node.log").read()[-2000:]
        storage = tmp_path / "runs"
        args = train_args(tiny_model, toy_images, tmp_path / "elastic", STOP_STEPS, *STOP_OPTIONS,
                          "--storage_path", str(storage), "--checkpointing_steps", "2", "--min_workers", "1",
                          "--resources_per_worker", "slot=1", "--elastic_resize_interval", "2")
        node_id = node_id_of(address, cpus=1)
        said = tmp_path / "train.out", tmp_path / "train.err"
        # (Ray Train's wait for a lost node's resources: 60 s by default, 10 here)
        since = time.time()
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO_DIR, text=True,
                                stdout=open(said[0], "w"), stderr=open(said[1], "w"),
                                env=dict(env(), RAY_ADDRESS=address, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10"))
        wait_for(lambda: 2 in registered_steps_under(storage), 300, proc)
        paused = worker_pids(since)
        assert len(paused) == 2
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            drain = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node",
                                    f"--address={address}", f"--node-id={node_id}",
                                    "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot reclaim",
                                    "--deadline-remaining-seconds=600"], capture_output=True, text=True, env=env())
            assert drain.returncode == 0, drain.stderr[-2000:]
            wait_for(lambda: "preemption detected" in said[1].read_text(), 120, proc)
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: DRAINED.search(said[0].read_text() + said[1].read_text()), 120, proc)
        drained = DRAINED.search(said[0].read_text() + said[1].read_text())
        assert node_id.startswith(drained[1]), drained[0]
        wait_for(lambda: int(drained[2]) in registered_steps_under(storage), 120, proc)
        lost = time.time()
        stop_node(node, signal.SIGKILL)
        wait_for(lambda: 1 in [w for _, w in logged_workers(storage)], 300, proc)
        # The head's worker alone has trained a step; once a checkpoint of its steps is registered (the group that
        # grows back resumes from it: the steps after it are trained again, and logged by the new group), it is
        # paused (SIGSTOP) while the node starts again, so that the run is still there to grow back on it (its
        # 20-odd steps take seconds, the node's start longer). A pause is what a busy machine does to a process:
        # Ray Train's health check waits 10 minutes for a poll.
        first_alone = min(s for s, w in logged_workers(storage) if w == 1)
        wait_for(lambda: max(registered_steps_under(storage), default=0) >= first_alone, 300, proc)
        alone = worker_pids(lost)
        for pid in alone:
            os.kill(pid, signal.SIGSTOP)
        try:
            node = start_node(command, tmp_path / "node.log") or start_node(command, tmp_path / "node.log")  # (again)
            assert node is not None, open(tmp_path / "node.log").read()[-2000:]
            # (the controller goes on meanwhile: it sees the node's slot and restarts the group on both nodes from the
            # newest checkpoint, ending the paused worker; it goes on here at the latest once the new group is up)
            wait_for(lambda: set(worker_pids(lost)) - set(alone), 120, proc)
        finally:
            for pid in alone:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        finish(proc, 400)
        out, err = said[0].read_text(), said[1].read_text()
        assert proc.returncode == 0, err[-4000:]
    finally:
        if node is not None:
            stop_node(node)
        raycluster.stop_ray_head(head)
        shutil.rmtree(temp, ignore_errors=True)
    rows = logged_workers(storage)
    assert [s for s, _ in rows] == list(range(1, STOP_STEPS + 1))
    sizes = [w for _, w in rows]
    changes = [w for k, w in enumerate(sizes) if k == 0 or w != sizes[k - 1]]
    assert changes == [2, 1, 2], rows  # on both nodes, on the head alone, on both again
    # the drain notice's checkpoint changed nothing: the steps of both nodes until the loss, the uninterrupted run's
    first_alone = min(s for s, w in rows if w == 1)
    assert int(drained[2]) < first_alone
    assert [(s, loss) for s, _, loss in logged_rows(storage) if s < first_alone] == whole_losses[:first_alone - 1]
    assert "note: the Ray cluster holds" not in err  # (both nodes there at the start)
    assert "1 to 2 workers (elastic)" in err  # the plan; then each group, and the restart after the lost node
    assert "training on 1 of 2 workers (elastic, at least 1) from step" in out and "training on 2 of 2" in out
    assert ("restarting the workers from the newest checkpoint on the workers the cluster holds now (at least "
            "--min_workers 1)") in out
    # The weights: the uninterrupted run's, to rounding. Measured against what training changed (the distance from
    # the base model): AdamW turns the rounding noise of a gradient that is zero in exact arithmetic (a bias just
    # before a group norm) into steps of the learning rate's size, so one weight may differ by that much (0.14 % of
    # the change, measured); a step lost, repeated or trained on other rows or noise moves them by several %.
    a, b, base = final_weights(whole), final_weights(tmp_path / "elastic"), final_weights(tiny_model)
    assert set(a) == set(b) == {"unet", "text_encoder"}
    for part in a:
        apart = sum(((a[part][k] - b[part][k]) ** 2).sum() for k in a[part]) ** 0.5
        trained = sum(((a[part][k] - base[part][k]) ** 2).sum() for k in a[part]) ** 0.5
        assert apart < 0.01 * trained, (part, float(apart / trained))

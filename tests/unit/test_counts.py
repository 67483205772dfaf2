"""tests/counts.py, the suite's own bookkeeping: what it counts in Ray's session folders and in the processes this
one starts, and the budgets it holds the session to."""

import os

import counts
import pytest


def worker_log(session, name, actor, job="01000000"):
    logs = session / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"worker-{name}-{job}-1.out").write_text(f":actor_name:{actor}\nsome output\n" if actor else "a task\n")


def test_a_session_folder_is_a_cluster_and_its_workers_logs_say_what_ran(tmp_path):
    root = tmp_path / "ray-root"
    head = root / "dreambooth-ray-x" / "session_2026-01-01_00-00-00_000000_1"
    node = root / "node" / head.name  # (a second node: the head's session name)
    other = root / "ray" / "session_2026-01-01_00-00-09_000000_2"
    worker_log(head, "a", "TrainController")
    worker_log(head, "b", "RayTrainWorker")
    worker_log(head, "c", "MapWorker(MapBatches(Drawer))")
    worker_log(node, "d", "MapWorker(MapBatches(Drawer))")  # (the same pool, on the other node)
    worker_log(head, "e", "ImplicitFunc")
    worker_log(other, "f", "TrainController")
    worker_log(other, "g", None)
    counter = counts.Counter([str(root)], str(tmp_path))
    counter.scan()
    assert counter.counts() == {"ray_clusters": 2, "ray_train_runs": 2, "ray_data_pools": 1, "ray_tune_trials": 1,
                                "ray_worker_processes": 7, "script_runs": 0}
    assert counter.by_actor() == {"TrainController": 2, "RayTrainWorker": 1, "MapWorker": 2, "ImplicitFunc": 1,
                                  "(a task worker)": 1}
    with open(other / "logs" / "worker-g-01000000-1.out", "a") as log:  # (an idle worker that became an actor later)
        log.write(":actor_name:TrainController\n")
    counter.scan()
    assert counter.counts()["ray_train_runs"] == 3


def test_only_the_repositorys_scripts_count_as_script_runs(tmp_path):
    (tmp_path / "train.py").write_text("")
    counter = counts.Counter([], str(tmp_path))
    for argv in (["python", "train.py", "--x"], ["bash", str(tmp_path / "train.py")], ["dreambooth-train"],
                 ["python", "-m", "dreambooth.commands.train"], ["ray", "start", "--temp-dir=/t/dreambooth-ray-1"],
                 ["git", "rev-parse"], ["python", "other.py"], ["bash", "-c", "cd x && python train.py --x=1"],
                 ["bash", "-c", "curl -s localhost:8000"]):
        counter.script(argv)
    assert len(counter.scripts) == 5  # (a shell's block that runs a script counts once)


def test_a_count_over_its_budget_is_named_and_an_unknown_budget_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.dreambooth.test_budget]\nray_train_runs = 1\n")
    assert counts.budgets(tmp_path) == {"ray_train_runs": 1}
    (tmp_path / "pyproject.toml").write_text("[tool.dreambooth.test_budget]\nray_trains = 1\n")
    with pytest.raises(ValueError, match="ray_trains"):
        counts.budgets(tmp_path)
    assert os.path.isfile(os.path.join(os.path.dirname(counts.__file__), "..", "pyproject.toml"))

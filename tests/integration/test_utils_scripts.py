"""Every Ray worker of ours runs the setup hook and keeps the user's OMP_NUM_THREADS; a script exits at once after
flushing, waiting for its writing threads."""

import logging
import os

from dreambooth import files


def test_ray_workers_run_the_setup_hook(ray_session):
    @ray_session.remote
    def cleaner_log_level():
        import logging

        return logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").level

    assert ray_session.get(cleaner_log_level.remote()) == logging.ERROR


def test_a_users_omp_num_threads_reaches_every_worker_and_is_kept(ray_session):
    """OMP_NUM_THREADS where the script runs (the suite's 1) is in the job's environment in every worker, and
    share_cpu_threads keeps it there; without it, a node's cores are shared among its workers."""
    import torch

    from dreambooth.cluster import raycluster

    @ray_session.remote(num_cpus=0.5)  # (Ray's own setting: 1 thread)
    def threads_after_sharing():
        import torch

        from dreambooth.cluster import raycluster

        raycluster.share_cpu_threads(1)
        return raycluster.job_env_vars().get("OMP_NUM_THREADS"), torch.get_num_threads()

    assert os.environ["OMP_NUM_THREADS"] == "1" and ray_session.get(threads_after_sharing.remote()) == ("1", 1)
    before = torch.get_num_threads()
    try:
        raycluster.share_cpu_threads(1, env_vars={})
        assert torch.get_num_threads() == os.cpu_count()
        torch.set_num_threads(before)
        raycluster.share_cpu_threads(1, env_vars={"OMP_NUM_THREADS": "1"})
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_script_exits_at_once_after_flushing_and_waits_for_its_writing_threads(tmp_path):
    """run_main's exit skips the interpreter's teardown: what the script printed, logged and
    registered at exit still comes out, and a non-daemon thread still writing is waited for. What native
    code writes to file descriptor 2 comes out too, but for Ray's harmless error-looking note."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, logging, os, sys, threading, time
        sys.path.insert(0, {files.REPO_DIR!r})
        from dreambooth import errors

        def main():
            logging.basicConfig(stream=sys.stderr, format="%(message)s")
            print("printed without a newline flush", end="")
            logging.getLogger("x").warning("logged")
            atexit.register(lambda: print(" at exit"))
            # what Ray's core writes straight to file descriptor 2: its harmless note is dropped, the rest kept
            os.write(2, b"[E core_worker.cc:2465] Actor x has constructor arguments in the object store and "
                        b"max_restarts > 0. If the arguments ...\\n")
            os.write(2, b"a native line\\n")
            if sys.argv[1] == "missing":  # a package of requirements.txt this Python lacks, imported where used
                import not_a_package_of_ours  # noqa: F401
            if sys.argv[1] == "thread":
                def write():
                    time.sleep(0.3)
                    open(sys.argv[2], "w").write("written")
                threading.Thread(target=write).start()

        errors.run_main(main)
    """))
    marker = tmp_path / "marker"
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a script's output to a pipe is
    for mode in ("plain", "thread"):
        done = subprocess.run([sys.executable, str(script), mode, str(marker)], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env=buffered)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "printed without a newline flush at exit\n"
        assert sorted(done.stderr.splitlines()) == ["a native line", "logged"], done.stderr
    assert marker.read_text() == "written"
    missing = subprocess.run([sys.executable, str(script), "missing", str(marker)], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, env=buffered)
    said = [line for line in missing.stderr.splitlines() if line != "logged" and "native line" not in line]
    assert missing.returncode == 1 and said == [
        f"error: {sys.executable} has no not_a_package_of_ours (requirements.txt): run with the Python they are "
        "installed in (. .venv/bin/activate first, or .venv/bin/python script.py)"], missing.stderr

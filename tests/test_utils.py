import logging
import os

import pytest

from dreambooth import errors
from dreambooth import families
from dreambooth import files


def test_slugify_is_file_safe_and_stable():
    assert files.slugify("Photo of a DOG, in a bucket!") == "photo-of-a-dog-in-a-bucket"
    assert files.slugify("???") == "prompt"
    assert len(files.slugify("x" * 500)) <= 60






def test_atomic_write_dir_replaces_whole_or_keeps_previous(tmp_path):
    target = tmp_path / "out"

    def write(version):
        def fn(tmp):
            with open(os.path.join(tmp, "v.txt"), "w") as f:
                f.write(version)
        return fn

    files.atomic_write_dir(str(target), write("1"))
    assert (target / "v.txt").read_text() == "1"

    def broken(tmp):
        write("2")(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError):
        files.atomic_write_dir(str(target), broken)
    assert (target / "v.txt").read_text() == "1"
    assert sorted(os.listdir(tmp_path)) == ["out"]
    files.atomic_write_dir(str(target), write("3"))
    assert (target / "v.txt").read_text() == "3"


def test_check_model_dir_names_missing_component(tiny_model, tmp_path):
    families.check_model_dir(tiny_model)
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    for part in ("unet", "vae", "text_encoder", "tokenizer"):
        (broken / part).mkdir()
    with pytest.raises(errors.UserError, match="scheduler"):
        families.check_model_dir(str(broken))
    with pytest.raises(errors.UserError, match="not found"):
        families.check_model_dir(str(tmp_path / "nope"))


@pytest.mark.slow
def test_ray_workers_run_the_setup_hook(ray_session):
    @ray_session.remote
    def cleaner_log_level():
        import logging

        return logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").level

    assert ray_session.get(cleaner_log_level.remote()) == logging.ERROR


@pytest.mark.slow
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


def test_rays_harmless_error_lines_are_kept_off_the_terminal_and_the_rest_printed():
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from dreambooth import errors
    from dreambooth.cluster import raycluster

    printed, before = [], list(dispatcher.handlers)  # (this session's own Ray printer among them, maybe)
    dispatcher.handlers = [("ray_print_logs", printed.append)]  # (where ray.init puts its printer)
    try:
        raycluster.hide_harmless_ray_lines()
        raycluster.hide_harmless_ray_lines()  # (a second ray.init in one process: still one filter)
        harmless = ("[E core_worker.cc:2465] Actor with class name: 'PreemptionWatcher' and ID: 'ee6d' has constructor "
                    "arguments in the object store and max_restarts > 0. If the arguments …")
        data = harmless.replace("PreemptionWatcher", "MapWorker(MapBatches(ImageGenerator))")
        dispatcher.emit({"pid": 1, "lines": [harmless, "step=1 loss=0.5"]})
        dispatcher.emit({"pid": 1, "lines": [harmless, data]})
        assert printed == [{"pid": 1, "lines": ["step=1 loss=0.5"]}]
        # a split coordinator stopped inside a finaliser (Ray Train restarting the workers), its message over two
        # batches, another process's line between them: that line and what follows the message are printed
        printed.clear()
        dispatcher.emit({"pid": 7, "lines": [
            "Exception ignored in: <function _ClosingIterator.__del__ at 0x7efd7c83fc40>", "Traceback (most recent "
            "call last):", '  File "ray/data/_internal/execution/streaming_executor.py", line 809, in __del__']})
        dispatcher.emit({"pid": 2, "lines": ["step=2 loss=0.4"]})
        dispatcher.emit({"pid": 7, "lines": ["    def __del__(self):", "", "SystemExit: 1", "after it"]})
        dispatcher.emit({"pid": 7, "lines": ["Traceback (most recent call last):", "ValueError: a real one"]})
        assert printed == [{"pid": 2, "lines": ["step=2 loss=0.4"]}, {"pid": 7, "lines": ["after it"]},
                           {"pid": 7, "lines": ["Traceback (most recent call last):", "ValueError: a real one"]}]
        # one whose last line never comes hides at most errors.HARMLESS_BLOCK_MOST_LINES lines
        printed.clear()
        dispatcher.emit({"pid": 8, "lines": ["Exception ignored in: <function _ClosingIterator.__del__ at 0x1>",
                                             *[f"line {k}" for k in range(1, 25)]]})
        assert printed == [{"pid": 8, "lines": [f"line {k}" for k in range(errors.HARMLESS_BLOCK_MOST_LINES, 25)]}]
    finally:
        dispatcher.handlers = before


def test_a_safetensors_file_is_checked_from_its_header_alone(tmp_path):
    import pytest
    import torch
    from safetensors.torch import save_file

    from dreambooth import errors
    from dreambooth import files

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(64), "b": torch.ones(3, 3)}, str(path))
    files.check_safetensors(str(path))  # whole
    data = path.read_bytes()
    for broken, why in ((data[:-4], "bytes where its header says"), (data + b"x", "bytes where its header says"),
                        (b"\x05\x00", "does not parse"), (b"\xff" * 8 + data[8:], "does not parse")):
        path.write_bytes(broken)
        with pytest.raises(errors.UserError, match=why):
            files.check_safetensors(str(path))


def test_an_output_is_never_a_file_or_inside_what_the_run_reads(tmp_path):
    import pytest

    from dreambooth import errors
    from dreambooth import files

    (tmp_path / "f").write_text("x")
    with pytest.raises(errors.UserError, match="is a file, not a folder"):
        files.check_output_path(str(tmp_path / "f"), "--output_dir")
    with pytest.raises(errors.UserError, match="is inside --instance_data_dir"):
        files.check_output_path(str(tmp_path / "photos" / "out"), "--output_dir", [("--instance_data_dir",
                                                                                     str(tmp_path / "photos"))])
    files.check_output_path(str(tmp_path / "photos-out"), "--output_dir", [("--instance_data_dir",
                                                                             str(tmp_path / "photos"))])
    with pytest.raises(errors.UserError, match="is a folder"):
        files.check_output_path(str(tmp_path), "--output_file", is_file=True)


@pytest.mark.slow
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

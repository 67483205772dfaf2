import os

import pytest

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth.cluster import nodes


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


def test_rays_harmless_error_lines_are_kept_off_the_terminal_and_the_rest_printed():
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from dreambooth import errors
    from dreambooth.cluster import raylogs

    printed, before = [], list(dispatcher.handlers)  # (this session's own Ray printer among them, maybe)
    printer = ray_worker.print_to_stdstream
    ray_worker.print_to_stdstream = lambda data, ignore_prefix: printed.append(data)  # (Ray's own, as it is called)
    dispatcher.handlers = [("ray_print_logs", printed.append)]  # (where ray.init puts its printer)
    try:
        raylogs.hide_harmless_ray_lines()
        raylogs.hide_harmless_ray_lines()  # (a second ray.init in one process: still one filter)
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
        # the errors Ray's processes publish ("(raylet) ..."), printed by another path, are kept to the same rule
        printed.clear()
        stopped = "Task ServeController.graceful_shutdown failed. There are infinite retries remaining, so the task …"
        ray_worker.print_to_stdstream({"pid": "raylet", "lines": [stopped], "is_err": False}, ignore_prefix=False)
        ray_worker.print_to_stdstream({"pid": "raylet", "lines": ["a worker died"], "is_err": False}, False)
        assert printed == [{"pid": "raylet", "lines": ["a worker died"], "is_err": False}]
    finally:
        dispatcher.handlers = before
        ray_worker.print_to_stdstream = printer


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




def test_nodes_of_one_machine_in_one_temp_folder_are_named_as_printing_each_worker_line_twice():
    """Two `ray start` on one machine with the same --temp-dir (the default /tmp/ray) share a session folder: each
    node's log monitor tails the same worker logs, and a driver joined through RAY_ADDRESS printed every line twice."""
    def node(host, socket, alive=True):
        return {"NodeManagerAddress": host, "RayletSocketName": socket, "Alive": alive}

    session = "/tmp/ray/session_2026-12-06_14-09-28_081575_26863"
    live = [node("10.0.0.1", f"{session}/sockets/raylet"), node("10.0.0.1", f"{session}/sockets/raylet.1"),
            node("10.0.0.2", f"{session}/sockets/raylet"),  # (another machine: its own logs)
            node("10.0.0.1", "/tmp/other/session_x/sockets/raylet"),  # (its own folder)
            node("10.0.0.1", f"{session}/sockets/raylet.2", alive=False)]
    assert nodes.shared_temp_folders(live) == [("10.0.0.1", session, 2)]
    assert nodes.shared_temp_folders(live[2:]) == []

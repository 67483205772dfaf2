"""serve.py as the README's "Serve your subjects" blocks start and ask it, on the subjects "Each step by hand" left
(example-dog, a full fine-tune of the tiny model) and three more on one base beside it (two LoRAs, one LoHa): every
request answered with generate.py's image, each adapter loaded once, bad requests refused with their status while
the others go on, subjects saved while it runs served at once, a killed replica answered with 503 and restarted,
Ctrl-C (the API key is the ingress's own code: tests/unit/test_serving.py). It joins the session's cluster, as the
script's steps do (serve.py's own local cluster is the code path of every other script's)."""

import base64
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from readme import SERVE_START
from readme import serve_blocks
from support import foreground_job
from support import saved_subject

from dreambooth.files import LORA_WEIGHTS_FILE
from dreambooth.files import OUTPUT_MARKER
from dreambooth.files import REPO_DIR

PROMPT = "photo of a unqtkn {subject}, on a beach"  # (a comma, kept inside the prompt)
OTHERS = (("rex", "lora", 1), ("toy", "lora", 2), ("mug", "loha", 3))
SUBJECTS = tuple(name for name, _, _ in OTHERS)


def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", os.path.join(REPO_DIR, "benchmarks", "serve_load.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOAD = serve_load()


def start_server(folder, port):
    """The README's serve.py block as typed, on a free port and looking for new subjects every second, in a process
    group of its own as a terminal's job: (process, its output's file) once it says it serves."""
    typed = serve_blocks()[0].strip().replace(SERVE_START, f"{SERVE_START} --port={port} --rescan_interval=1")
    env = dict(os.environ, DATA_PREFIX=str(folder / "data"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.pop("DREAMBOOTH_API_KEY", None)  # (no key asked)
    log = folder / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", typed], cwd=REPO_DIR, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=foreground_job)
    deadline = time.time() + 300
    while "; Ctrl-C stops" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return proc, log


def stacks(group):
    """Where each process of the group is: its signal masks (SigIgn bit 2: SIGINT ignored, as a process started in
    the background by a shell without job control has it) and py-spy's dump of its Python threads."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")  # (Ray's dashboard requirements bring it)
    found = []
    for pid in subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split():
        found += [line for line in open(f"/proc/{pid}/status").read().splitlines() if line.startswith(("Name", "Sig"))]
        if os.path.exists(spy):
            found.append(subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60).stdout)
    return "\n".join(found)


def ctrl_c(proc, log):
    """Ctrl-C as a terminal sends it, to the whole group: serve.py takes its applications down and exits 130."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("serve.py still runs 120 s after Ctrl-C:\n" + log.read_text()[-3000:]
                                 + "\nwhere its threads are:\n" + stacks(proc.pid)) from None
        assert proc.returncode == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "stopped by SIGINT" in log.read_text()


def expected(model_dir, prompt, seeds, lora_dir=None, steps=2):
    """generate.py's images (its pipeline and seeds) of prompt: {seed: pixels of image 0 of that --seed}."""
    import torch

    from dreambooth import families
    from dreambooth.generation import drawing

    pipe = drawing.load_pipeline(model_dir, torch.device("cpu"), safety_checker=True, lora_dir=lora_dir)
    settings = drawing.settings_for(drawing.ImageSettings(steps), families.family_of(model_dir), model_dir)
    images, _ = drawing.generate_batch(pipe, [prompt] * len(seeds), [drawing.image_seed(s, prompt, 0) for s in seeds],
                                       settings)
    return {seed: np.asarray(image, dtype=int) for seed, image in zip(seeds, images)}


def pixels(png):
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=int)


def same_image(png, want):
    """generate.py's image to the rounding of a pixel (a batch of another size rounds a few pixels the other way)."""
    got = pixels(png)
    return got.shape == want.shape and np.abs(got - want).max() <= 1 and (got == want).mean() > 0.99


def draw(url, subject, seed=0, **fields):
    status, answer = LOAD.call(url, "/v1/images", {"subject": subject, "prompt": PROMPT.format(subject=subject),
                                                   "seed": seed, "steps": 2, **fields})
    if status == 200 and isinstance(answer, dict):
        answer["png"] = base64.b64decode(answer["data"][0]["b64_json"])
    return status, answer


def replica_pids(app_name="Painter"):
    """The processes of serve.py's replicas of a deployment (Ray names them ServeReplica:<app>:<deployment>)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().decode(errors="replace")
        except OSError:
            continue
        if "ServeReplica:" in command and f":{app_name}" in command:
            found.append(int(pid))
    return found


def test_the_readme_serves_every_subject_as_generate_py_draws_it_and_new_ones_at_once(by_hand, make_plan, capsys):
    """The README's blocks as typed: example-dog (a full fine-tune, a base of its own) drawn as generate.py draws it;
    30 requests from 3 clients over rex, toy (LoRAs) and mug (LoHa) on one base, each generate.py's image of its seed
    and each adapter loaded once; a subject's requests drawn together; the benchmark's figures; bad requests refused
    in one line while the others are answered; subjects saved and retrained while it runs served at once; a killed
    replica answered with 503 and restarted; Ctrl-C. (The API key: tests/unit/test_serving.py, in the ingress's own
    code.)"""
    from dreambooth.cluster import raycluster

    folder = by_hand.folder
    root = folder / "data" / "subjects"
    made = {name: saved_subject(make_plan, root, name, adapter, seed) for name, adapter, seed in OTHERS}
    base = made["rex"].base_model
    port = raycluster.free_port()
    url = f"http://127.0.0.1:{port}"
    proc, log = start_server(folder, port)
    try:
        said = log.read_text()
        assert f"API at http://127.0.0.1:{port}/v1/images: this machine only" in said and "API key" not in said
        assert f"serving the 4 subject(s) in {root} (new ones as they are saved)" in said
        import socket

        import ray._private.services

        with pytest.raises(ConnectionRefusedError):  # (as another host reaches this machine: nothing listens)
            socket.create_connection((ray._private.services.get_node_ip_address(), port), timeout=5)
        # the README's requests as typed (on this server's port), from a folder of the user's
        asks = serve_blocks()[1].replace("localhost:8000", f"localhost:{port}")
        typed = subprocess.run(["bash", "-euo", "pipefail", "-c", asks], cwd=folder, capture_output=True, text=True,
                               timeout=300)
        assert typed.returncode == 0, typed.stderr
        listed = {row["subject"]: row for row in json.loads(typed.stdout)["subjects"]}
        assert set(listed) == {"example-dog", "rex", "toy", "mug"}
        assert (listed["example-dog"]["mode"], listed["mug"]["adapter"], listed["rex"]["base_model"]) == (
            "full", "loha", base)
        assert listed["example-dog"]["scores"]["dino"] is not None  # (Step 6 scored this very model)
        dog = folder / "data" / "subjects" / "example-dog" / "model-tuned"
        prompt = re.search(r'"prompt": "([^"]+)"', asks)[1]
        assert same_image((folder / "dog.png").read_bytes(), expected(str(dog), prompt, [1], steps=50)[1])

        # 30 requests from 3 clients, interleaved over the three subjects of one base: each answered with
        # generate.py's image of its seed, each adapter loaded once on the base's one replica (K=4 >= 3)
        results = LOAD.run_load(url, list(SUBJECTS), 30, 3, steps=2, prompt=PROMPT)
        assert [r[2] for r in results] == [200] * 30, [r for r in results if r[2] != 200][:3]
        for name in SUBJECTS:
            mine = [r for r in results if r[0] == name]
            want = expected(base, PROMPT.format(subject=name), [r[1] for r in mine], made[name].folder)
            for _, seed, _, _, answer in mine:
                assert same_image(base64.b64decode(answer["data"][0]["b64_json"]), want[seed]), (name, seed)
            assert {answer["model_id"] for *_, answer in mine} == {made[name].model_id}
            assert sum(answer["adapter_loaded"] for *_, answer in mine) == 1
        figures, replicas = LOAD.summary(results, 1.0)
        assert figures["hit_share"] == 0.9 and [row["loads"] for row in replicas.values()] == [3]
        assert len({r[4]["data"][0]["b64_json"] for r in results}) == 30  # (every subject and seed its own image)
        # requests for one subject that arrive together are drawn in one call of the pipeline (Serve's batching; the
        # first may go alone, those behind it wait for it together)
        together = LOAD.run_load(url, ["toy"], 4, 4, steps=2, prompt=PROMPT)
        assert [r[2] for r in together] == [200] * 4 and max(r[4]["drawn_together"] for r in together) >= 2
        # the benchmark measures the running server and prints its figures
        LOAD.main(["--url", url, "--requests", "6", "--clients", "2", "--steps", "2", "--subjects", "rex", "toy",
                   "--switch_rounds", "2"])
        printed = capsys.readouterr().out
        assert "6 of 6 requests answered" in printed and re.search(r"requests/s [\d.]+  p50 [\d.]+ s  p95", printed)
        assert re.search(r"replica \S+: 6 requests, 2 subjects, 0 adapter loads, 0 evictions", printed), printed
        assert re.search(r"drawing one request: [\d.]+ s with its subject's adapters fused already .* s a switch",
                         printed), printed

        # bad requests: one line and a status each, and the others go on being answered
        assert draw(url, "nobody")[0] == 404
        status, answer = draw(url, "rex", n=9)
        assert status == 400 and answer["error"] == ("n=9: from 1 to 4 images a request (serve.py "
                                                     "--max_images_per_request)")
        status, answer = draw(url, "rex", width=100)
        assert status == 400 and "multiples of 8" in answer["error"]
        cut = saved_subject(make_plan, root, "cut", seed=6)
        weights = os.path.join(cut.folder, LORA_WEIGHTS_FILE)
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
        status, answer = draw(url, "cut")
        assert status == 422 and weights in answer["error"], answer
        assert draw(url, "toy")[0] == 200

        # a subject saved while it runs: served at once; one retrained: its new model, never the adapter before
        new = saved_subject(make_plan, root, "new", seed=7)
        status, answer = draw(url, "new", seed=3)
        assert status == 200 and same_image(answer["png"], expected(base, PROMPT.format(subject="new"), [3],
                                                                    new.folder)[3])
        again = saved_subject(make_plan, root, "rex", seed=8)
        status, answer = draw(url, "rex", seed=3)
        assert status == 200 and answer["model_id"] == again.model_id != made["rex"].model_id
        assert same_image(answer["png"], expected(base, PROMPT.format(subject="rex"), [3], again.folder)[3])
        # a subject whose base model is not on this node: said by serve.py, and to its requests, never "loading"
        lost = saved_subject(make_plan, root, "lost", seed=9)
        record = json.loads(open(os.path.join(lost.folder, OUTPUT_MARKER)).read())
        with open(os.path.join(lost.folder, OUTPUT_MARKER), "w") as f:
            json.dump({**record, "base_model": str(folder / "gone")}, f)
        deadline = time.time() + 60
        while "not served: lost" not in log.read_text():
            assert time.time() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        status, answer = draw(url, "lost")
        assert status == 503 and answer["error"] == f"lost: not served (its base model {folder / 'gone'} is not on " \
            "this node)", answer

        # every replica killed while one draws: the request in flight gets 503 at once (never a hang), Ray Serve
        # starts the replicas again and the next requests are answered
        before = replica_pids()
        assert before, "no replica process found"
        answers = []
        slow = threading.Thread(target=lambda: answers.append(draw(url, "example-dog", steps=500)))
        slow.start()
        time.sleep(2)  # (500 steps take longer than this here: it is being drawn)
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        slow.join(timeout=120)
        assert not slow.is_alive() and answers[0][0] == 503, answers
        assert "the replica drawing it stopped" in answers[0][1]["error"]
        deadline = time.time() + 120
        while (status := draw(url, "example-dog")[0]) != 200 and time.time() < deadline:
            assert status == 503
            time.sleep(1)
        assert status == 200 and set(replica_pids()).isdisjoint(before)
    finally:
        ctrl_c(proc, log)
    deadline = time.time() + 60  # (Serve takes a replica down after its graceful shutdown: seconds)
    while replica_pids() and time.time() < deadline:
        time.sleep(1)
    assert not replica_pids(), "serve.py left its replicas running:\n" + log.read_text()[-2000:]

"""serve.py's parts that need no Ray, in this process: the catalog of subjects read from their records, a request's
checks, and a replica's shared base drawing several subjects' adapters in turn (each image generate.py's). The
Ray Serve application itself: tests/e2e/test_serve.py."""

import json
import os
import shutil

import pytest
from support import saved_subject

from dreambooth import files
from dreambooth.serving import catalog
from dreambooth.serving import requests
from dreambooth.serving.requests import RequestError

SUBJECTS = (("rex", "lora", 1), ("toy", "lora", 2), ("mug", "loha", 3), ("cup", "dora", 4), ("hat", "lokr", 5))


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory, tiny_model):
    """A subjects folder of the tiny model's adapters of each kind, saved once for the module (each test copies it)."""
    from dreambooth.planning import planning

    def make_plan(**fields):
        return planning.offline_plan(**{"model_dir": tiny_model, "mixed_precision": "no", **fields})

    root = tmp_path_factory.mktemp("saved") / "subjects"
    for name, adapter, seed in SUBJECTS:
        saved_subject(make_plan, root, name, adapter, seed)
    return root


@pytest.fixture()
def subjects(saved_once, tmp_path):
    """(a subjects folder of this test's own, {name: catalog.Subject}): two LoRAs, a LoHa, a DoRA and a LoKr."""
    root = tmp_path / "subjects"
    shutil.copytree(saved_once, root)
    return root, {name: catalog.find(str(root), name) for name, _, _ in SUBJECTS}


def test_the_catalog_lists_each_subject_by_its_record_and_a_retrained_one_by_its_new_id(subjects, make_plan,
                                                                                          tiny_model):
    root, made = subjects
    (root / "notes").mkdir()  # (a folder without a model: not a subject)
    (root / "half" / catalog.MODEL_FOLDER).mkdir(parents=True)
    (root / "half" / catalog.MODEL_FOLDER / files.OUTPUT_MARKER).write_text('{"base_mo')  # (being written)
    found = catalog.scan(str(root))
    assert sorted(found) == ["cup", "hat", "mug", "rex", "toy"]
    rex = found["rex"].describe()
    assert (rex["base_model"], rex["mode"], rex["adapter"], found["mug"].adapter) == (tiny_model, "adapter", "lora",
                                                                                       "loha")
    assert rex["trained"].endswith("+00:00") and rex["scores"] is None
    # the LoRAs, DoRA, LoHa and LoKr share the base's deployment; each is routed by its name and its model's id
    assert len({s.base_key for s in found.values()}) == 1
    assert catalog.split_routing_id(found["rex"].routing_id) == ("rex", found["rex"].model_id)
    assert catalog.find(str(root), "../subjects/rex") is None and catalog.find(str(root), "nobody") is None
    # retrained: a new record, a new id (the time of its files is not what tells)
    again = saved_subject(make_plan, root, "rex", seed=4)
    assert again.model_id != made["rex"].model_id and again.routing_id != made["rex"].routing_id
    # scores: evaluate.py's report counts only where its images were drawn by this model
    evaluated = root / "rex" / "eval"
    (evaluated / "images" / "tuned").mkdir(parents=True)
    (evaluated / "scores.json").write_text(json.dumps({"models": {"tuned": {"overall": {
        "dino": 0.5, "clip_i": 0.6, "clip_t": 0.3}}}}))
    (evaluated / "images" / "tuned" / "dreambooth_images.json").write_text(json.dumps({
        "model": f"base+lora:trained:{made['rex'].model_id}@1"}))
    assert catalog.find(str(root), "rex").scores is None  # (the model before)
    (evaluated / "images" / "tuned" / "dreambooth_images.json").write_text(json.dumps({
        "model": f"base+lora:trained:{again.model_id}@1"}))
    assert catalog.find(str(root), "rex").scores == {"dino": 0.5, "clip_i": 0.6, "clip_t": 0.3}


def test_a_request_is_read_with_generate_pys_defaults_and_refused_in_one_line():
    request = requests.parse_image_request(b'{"subject": "rex", "prompt": "a photo of unqtkn dog, on a beach"}', 4)
    assert (request.prompt, request.seed, request.steps, request.n, request.width) == (
        "a photo of unqtkn dog, on a beach", 0, 50, 1, None)
    assert requests.parse_image_request(b'{"subject": "rex", "prompt": "p"}', 4, "image/png").response_format == "png"

    def refused(body, max_images=4):
        with pytest.raises(RequestError) as caught:
            requests.parse_image_request(json.dumps(body).encode() if not isinstance(body, bytes) else body, max_images)
        assert caught.value.status == 400 and "\n" not in caught.value.message
        return caught.value.message

    assert refused(b"{not json").startswith("the body is not JSON")
    assert refused({"prompt": "p"}) == "'subject' is required: a non-empty string"
    assert refused({"subject": "rex", "prompt": "p", "n": 9}) == ("n=9: from 1 to 4 images a request (serve.py "
                                                                  "--max_images_per_request)")
    assert refused({"subject": "rex", "prompt": "p", "steps": "ten"}) == "'steps' must be an integer, not \"ten\""
    assert refused({"subject": "rex", "prompt": "p", "colour": 1}).startswith("unknown field(s) colour;")
    assert refused({"subject": "rex", "prompt": "p", "n": 2, "response_format": "png"}).startswith("one image/png")
    # a guidance that would draw black or noise: refused, JSON's NaN and Infinity too
    assert refused({"subject": "rex", "prompt": "p", "guidance_scale": 1e30}) == "guidance_scale=1e+30: from 0 to 100"
    assert "NaN is not a number JSON has" in refused(b'{"subject": "rex", "prompt": "p", "guidance_scale": NaN}')
    assert refused(b'{"subject": "rex", "prompt": "p", "guidance_scale": 1e400}') == "guidance_scale=inf: from 0 to 100"
    with pytest.raises(RequestError, match=r"width=100: this model draws sides that are multiples of 8 from 64 to 512"):
        requests.check_size(100, 256, 8, 256)


def test_one_base_draws_each_subject_as_generate_py_does_switching_without_loading_again(subjects, tmp_path,
                                                                                         tiny_model):
    """Two LoRAs, a DoRA, a LoHa and a LoKr on one base, drawn in turn (rex, toy, cup, mug, hat, rex again in one
    batch with toy): each image is the one generate.py's pipeline (its adapters fused into a freshly loaded base) draws
    from the same seed, to the bit, and the base's weights are its own again between subjects."""
    import torch

    from dreambooth.generation import drawing
    from dreambooth.serving import painter

    root, made = subjects
    cpu = torch.device("cpu")
    base = painter.SharedBase(tiny_model, cpu)
    pristine = {name: value.clone() for name, value in base.pipe.unet.state_dict().items()}
    held = {name: base.attach(made[name], str(tmp_path / "held" / name)) for name in made}

    def ask(name, **fields):
        return held[name], requests.ImageRequest(name, "a photo of unqtkn toy, on a beach", **{"steps": 2, "n": 2,
                                                                                                **fields})

    first = base.draw([ask("rex")])[0]
    drawn = {name: base.draw([ask(name)])[0] for name in ("toy", "cup", "mug", "hat")}
    again = base.draw([ask("rex", seed=0), ask("toy")])  # (two subjects in one batch: one pipeline call each)
    assert again[0] == first and again[1] == drawn["toy"]
    assert not base.draw([ask("rex", seed=7)])[0] == first  # (another seed, other images)
    # a request the pipeline refuses fails alone, in one line; the batch's others are drawn
    refused, drawn_too = base.draw([ask("rex", width=100), ask("toy")])
    assert isinstance(refused, RequestError) and refused.status == 400 and drawn_too == drawn["toy"]
    assert "divisible by 8" in refused.message and "\n" not in refused.message
    with pytest.raises(RequestError, match="multiples of 8 from 64 to 128"):
        base.check(ask("rex", width=100)[1])
    base.restore()
    assert all(torch.equal(value, pristine[name]) for name, value in base.pipe.unet.state_dict().items())
    assert first[2] == 2 and again[0][2] == 2  # (the images of each call of the pipeline: a subject's requests)
    both = base.draw([ask("rex"), ask("rex", seed=0, n=1), ask("toy")])  # (two of rex: one call of 3 images)
    assert [answer[2] for answer in both] == [3, 3, 2] and [len(answer[0]) for answer in both] == [2, 1, 2]
    for name, (pngs, flagged, _) in {"rex": first, **drawn}.items():
        pipe = drawing.load_pipeline(tiny_model, cpu, safety_checker=True, lora_dir=made[name].folder)
        settings = drawing.settings_for(drawing.ImageSettings(2), base.family, tiny_model)
        seeds = [drawing.image_seed(0, "a photo of unqtkn toy, on a beach", i) for i in range(2)]
        images, bad = drawing.generate_batch(pipe, ["a photo of unqtkn toy, on a beach"] * 2, seeds, settings)
        assert flagged == bad and pngs == [files.png_bytes(image) for image in images], name
    assert len({pngs[0] for pngs, *_ in (first, *drawn.values())}) == 5  # (each subject's own images)
    # attaching copies the files: a retraining that writes the subject again never changes what a replica holds
    assert os.path.isfile(os.path.join(held["rex"].folder, files.LORA_WEIGHTS_FILE))


def test_an_adapter_cut_short_or_of_another_family_is_refused_naming_its_file_and_a_long_prompt_with_the_limit(
        subjects, tmp_path, tiny_model, tiny_sdxl_model, make_plan):
    import torch

    from dreambooth.serving import painter

    root, made = subjects
    base = painter.SharedBase(tiny_model, torch.device("cpu"))
    # SDXL's adapters copied over an SD 1.x subject's (its record still names the SD 1.x base)
    other = saved_subject(make_plan, tmp_path / "other", "big", model_dir=tiny_sdxl_model)
    shutil.copy(os.path.join(other.folder, files.LORA_WEIGHTS_FILE), os.path.join(made["rex"].folder,
                                                                                   files.LORA_WEIGHTS_FILE))
    with pytest.raises(RequestError) as caught:
        base.attach(made["rex"], str(tmp_path / "rex"))
    assert caught.value.status == 422 and "holds adapters of a model whose text states are" in caught.value.message
    assert os.path.join(made["rex"].folder, files.LORA_WEIGHTS_FILE) in caught.value.message, caught.value.message
    weights = os.path.join(made["toy"].folder, files.LORA_WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(RequestError) as caught:
        base.attach(made["toy"], str(tmp_path / "toy"))
    assert caught.value.status == 422 and weights in caught.value.message, caught.value.message
    assert not os.path.exists(tmp_path / "toy")
    # a full model is a base of its own: another base's deployment never draws it
    full = catalog.Subject("solo", str(tmp_path / "solo"), str(tmp_path / "solo"), "id", None)
    with pytest.raises(RequestError) as caught:
        base.attach(full, str(tmp_path / "solo-held"))
    assert caught.value.status == 409
    shutil.rmtree(tmp_path / "subjects" / "toy")
    assert catalog.find(str(tmp_path / "subjects"), "toy") is None
    with pytest.raises(RequestError, match="the prompt is 8.* tokens; this model reads at most 77"):
        requests.check_prompt_tokens(base.pipe, "dog " * 80)


def test_each_base_models_deployment_takes_its_replicas_gpus_and_sizes_from_the_flags():
    from dreambooth.serving import app

    settings = app.ServeSettings("/s", adapters_per_replica=5, min_replicas=2, max_replicas=6, gpus_per_replica=1,
                                 max_batch_size=3)
    deployment = app.painter_deployment(settings)
    autoscaling = deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.initial_replicas) == (2, 6, 2)
    assert deployment.ray_actor_options["num_gpus"] == 1 and deployment.ray_actor_options["num_cpus"] == 0
    on_cpu = app.painter_deployment(app.ServeSettings("/s"))
    assert on_cpu.ray_actor_options == {"num_gpus": 0, "num_cpus": 1}  # (a CPU replica holds a CPU)
    assert on_cpu._deployment_config.autoscaling_config.max_replicas == 1


def test_a_base_model_the_cluster_has_no_room_for_is_said_not_left_waiting():
    from dreambooth.commands import serve
    from dreambooth.serving import app

    on_cpu = serve.Bases(app.ServeSettings("/s", min_replicas=2))
    assert on_cpu.short_of("/m", {"CPU": 2.0}) is None
    assert on_cpu.short_of("/m", {"CPU": 1.0, "GPU": 4.0}) == (
        "2 replica(s) of /m need 2 CPU(s) and the cluster has 1 free: fewer base models at once, or more nodes")
    on_gpu = serve.Bases(app.ServeSettings("/s", gpus_per_replica=0.5))
    assert on_gpu.short_of("/m", {"CPU": 0.0, "GPU": 0.5}) is None and "need 0.5 GPU(s)" in on_gpu.short_of("/m", {})


def ask_ingress(ingress, path, key=None, method="GET"):
    """ingress's answer (a starlette Response) to an HTTP request of path, with the key as a bearer token if given."""
    import asyncio

    from starlette.requests import Request

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b"",
             "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000)}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    return asyncio.run(ingress(Request(scope, receive)))


def test_with_dreambooth_api_key_every_request_but_healthz_carries_it(subjects, monkeypatch):
    """serve.py with DREAMBOOTH_API_KEY: the ingress keeps the key's hash only and asks every request for it but GET
    /healthz (a load balancer's); no key set, none is asked. The ingress's own code, in this process (Serve's
    routing to it: tests/e2e/test_serve.py)."""
    from dreambooth.commands import serve
    from dreambooth.serving import app

    root, _ = subjects
    monkeypatch.setenv("DREAMBOOTH_API_KEY", "k3y-of-this-test")
    args = serve.parse_args(["--data_prefix", str(root.parent)])
    settings = app.ServeSettings(str(root), api_key_sha256=serve.key_hash(args.api_key))
    assert args.api_key == "k3y-of-this-test" and "k3y-of-this-test" not in repr(settings)
    ingress = app.Ingress.func_or_class(settings)
    assert ask_ingress(ingress, "/healthz").status_code == 200
    for key, path, method in ((None, "/v1/subjects", "GET"), ("wrong", "/v1/subjects", "GET"),
                              (None, "/v1/images", "POST")):
        refused = ask_ingress(ingress, path, key, method)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", (key, path)
        assert json.loads(refused.body)["error"] == "this server asks for its API key: 'Authorization: Bearer <key>'"
    listed = ask_ingress(ingress, "/v1/subjects", "k3y-of-this-test")
    assert listed.status_code == 200 and {row["subject"] for row in json.loads(listed.body)["subjects"]} == {
        name for name, _, _ in SUBJECTS}
    assert serve.reach_line("127.0.0.1", 8000, True) == (
        "API at http://127.0.0.1:8000/v1/images: this machine only (--host 0.0.0.0 opens it to the network). Every "
        "request must carry the API key (Authorization: Bearer).")
    monkeypatch.delenv("DREAMBOOTH_API_KEY")
    open_ingress = app.Ingress.func_or_class(app.ServeSettings(str(root), api_key_sha256=serve.key_hash(
        serve.parse_args(["--data_prefix", str(root.parent)]).api_key)))
    assert ask_ingress(open_ingress, "/v1/subjects").status_code == 200


def test_a_stop_never_waits_on_serve_for_longer_than_its_bound(monkeypatch, capsys):
    """Ctrl-C under serve.py: the applications are taken down in a thread the stop waits for at most wait_s; what is
    left is said in one line (Serve goes on taking it down)."""
    import threading

    from dreambooth.commands import serve
    from dreambooth.serving import app

    hung = threading.Event()
    monkeypatch.setattr(serve.Bases, "take_down", lambda self, said: hung.wait(5))
    bases = serve.Bases(app.ServeSettings("/s"))
    bases.close(wait_s=0.2)
    assert capsys.readouterr().err == ("note: Ray Serve had not taken down this run's applications after 0.2 s; it "
                                       "goes on doing so on the cluster\n")
    hung.set()
    monkeypatch.setattr(serve.Bases, "take_down", lambda self, said: said.append("note: Ray Serve was not stopped"))
    bases.close(wait_s=5)
    assert capsys.readouterr().err == "note: Ray Serve was not stopped\n"

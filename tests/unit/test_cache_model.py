import os
import shutil

import pytest
from support import modes_not_as_umask

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth.commands import cache_model
from dreambooth.files import REPO_DIR
from dreambooth.models import known_models
from dreambooth.models import modelcache
from dreambooth.planning import vae_cache

SD14 = "CompVis/stable-diffusion-v1-4"
SD14_REV = "b95be7d6f134c3a9e62ee616f310733567f069ce"


def test_tiny_is_written_in_hub_layout_and_loads(tiny_model):
    from diffusers import DiffusionPipeline

    name, revision = modelcache.random_model_id("tiny")
    assert tiny_model.endswith(os.path.join("models--" + name.replace("/", "--"), "snapshots", revision))
    refs = os.path.join(tiny_model, "..", "..", "refs", "main")
    assert open(refs).read() == revision  # no trailing newline
    assert {f for f in os.listdir(os.path.join(tiny_model, "unet"))} == {"config.json",
                                                                        "diffusion_pytorch_model.safetensors"}
    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert modes_not_as_umask(tiny_model) == []  # (safetensors' files and mkdtemp's folder: the owner's only)


def test_one_model_cache_for_the_script_and_the_scripts_by_hand(tiny_model, tmp_path, monkeypatch):
    """A short name typed by hand resolves where dreambooth_run.sh's Step 1 caches ($DATA_PREFIX/model-orig,
    or ORIG_MODEL_DIR), and a model already in the user's own hub cache is read from there; a missing
    one is fetched into the model cache (here: offline, so the line names that folder)."""
    monkeypatch.setenv("DATA_PREFIX", str(tmp_path / "data"))
    monkeypatch.delenv("ORIG_MODEL_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "own-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert modelcache.model_cache_dir() == str(tmp_path / "data" / "model-orig")
    with pytest.raises(errors.UserError, match=f"is not in the cache {tmp_path / 'data' / 'model-orig'} and the hub"):
        modelcache.resolve_model_name("sd14")
    step1 = modelcache.hub_snapshot_path(str(tmp_path / "data" / "model-orig"), SD14, SD14_REV)
    shutil.copytree(tiny_model, step1)  # as Step 1 left it
    assert modelcache.resolve_model_name("sd14") == step1
    sd15 = known_models.known_model("sd15")
    own = modelcache.hub_snapshot_path(str(tmp_path / "own-hub"), sd15.hub_name, sd15.revision)
    shutil.copytree(tiny_model, own)  # fetched earlier by other tools: not fetched again
    assert modelcache.resolve_model_name("sd15") == own
    monkeypatch.setenv("ORIG_MODEL_DIR", str(tmp_path / "elsewhere"))
    assert modelcache.model_cache_dir() == str(tmp_path / "elsewhere")


def test_the_sdxl_fp16_fix_vae_resolves_at_its_pinned_commit_only(tiny_sdxl_model, tmp_path, monkeypatch):
    monkeypatch.setenv("ORIG_MODEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "own-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "madebyollin/sdxl-vae-fp16-fix"
    other = modelcache.hub_snapshot_path(str(tmp_path / "cache"), name, "0" * 40)
    shutil.copytree(os.path.join(tiny_sdxl_model, "vae"), other)  # another commit of it: not taken
    with pytest.raises(errors.UserError, match=f"{name}@{vae_cache.KNOWN_VAES[name]} is not in the cache"):
        vae_cache.resolve_vae(name)
    pinned = modelcache.hub_snapshot_path(str(tmp_path / "cache"), name, vae_cache.KNOWN_VAES[name])
    shutil.copytree(os.path.join(tiny_sdxl_model, "vae"), pinned)
    assert vae_cache.resolve_vae(name) == pinned


def test_a_model_name_given_as_the_cache_folder_is_refused_in_one_line(tmp_path, monkeypatch):
    """cache_model.py's --model_dir is the cache (Ray's example's name), every other script's the model: a short or
    hub name there is a mix-up, not a folder to create."""
    monkeypatch.chdir(tmp_path)
    for name in ("sd14", "tiny", "CompVis/stable-diffusion-v1-4"):
        with pytest.raises(errors.UserError, match=rf"^--model_dir {name}: cache_model.py's --model_dir is the folder "
                                                   rf"it caches models in .*; the model is --model_name {name}$"):
            cache_model.main(["--model_dir", name, "--tiny"])
    assert os.listdir(tmp_path) == []


def test_missing_offline_model_is_a_clear_error(tmp_path):
    with pytest.raises(errors.UserError, match="not in .* hub cannot be reached"):
        cache_model.main(["--model_dir", str(tmp_path)])


def test_with_the_hub_out_of_reach_a_missing_model_is_a_clear_error_at_once(tmp_path, monkeypatch, capfd):
    """No HF_HUB_OFFLINE and no network (the hub's address takes no connection): the cache alone is asked, at
    once, not after the hub client's five retries (about 20 s, a 'Retrying in ...' line each)."""
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # (a port nothing listens on)
    started = time.monotonic()
    with pytest.raises(errors.UserError, match="not in .* hub cannot be reached"):
        cache_model.main(["--model_dir", str(tmp_path)])
    assert time.monotonic() - started < 10 and "Retrying" not in capfd.readouterr().err


def test_only_pipeline_files_are_fetched():
    from fnmatch import fnmatch

    def fetched(name):
        return (any(fnmatch(name, p) for p in modelcache.ALLOW_PATTERNS)
                and not any(fnmatch(name, p) for p in modelcache.IGNORE_PATTERNS))

    assert fetched("unet/diffusion_pytorch_model.safetensors") and fetched("model_index.json")
    assert fetched("tokenizer/vocab.json") and fetched("tokenizer/merges.txt")
    # the flow transformers' sharded weights and T5's tokenizer, not their single-file copies at the root or
    # SD 3.5's text_encoders/ (the same encoders again, 15 GB)
    assert fetched("transformer/diffusion_pytorch_model-00001-of-00003.safetensors")
    assert fetched("text_encoder_3/model.safetensors.index.json") and fetched("tokenizer_2/spiece.model")
    for name in ("sd-v1-4.ckpt", "sd-v1-4-full-ema.ckpt", "unet/diffusion_pytorch_model.bin",
                 "unet/diffusion_pytorch_model.fp16.safetensors", "unet/diffusion_flax_model.msgpack",
                 "flux1-dev.safetensors", "ae.safetensors", "sd3.5_large.safetensors",
                 "text_encoders/t5xxl_fp16.safetensors", "text_encoders/clip_g.safetensors"):
        assert not fetched(name), name


def test_the_hubs_refusal_of_a_gated_model_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    """A token that the hub refuses (license not accepted on that account): the hub's 403, which cannot be had
    from here (no hub), is raised by snapshot_download as it would be; the line names the license page."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def refuse(**_):
        url = "https://huggingface.co/api/models/black-forest-labs/FLUX.1-dev/revision/x"
        raise GatedRepoError("403 Forbidden: access to model black-forest-labs/FLUX.1-dev is restricted",
                             response=httpx.Response(403, request=httpx.Request("GET", url)))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_456")
    with pytest.raises(errors.UserError) as err:
        cache_model.main(["--model_dir", str(tmp_path), "--model_name", "flux-dev"])
    line = str(err.value)
    assert line.startswith("the hub refused black-forest-labs/FLUX.1-dev@3de623fc") and "\n" not in line
    assert "accept its license at https://huggingface.co/black-forest-labs/FLUX.1-dev" in line
    assert "hf_not_a_real_token_456" not in line
    with pytest.raises(errors.UserError, match="the hub refused it .* it is gated; accept its license"):
        cache_model.main(["--model_dir", str(tmp_path), "--model_name", "someone/gated-model"])


def test_the_readme_and_the_help_name_each_short_name_with_its_pin():
    """Each known model's row in the README's table (hub name, pinned revision, gated or not), and its short
    name in --model_name's help and in dreambooth_run.sh's --help (the families' listing, which it prints)."""
    import re

    readme = open(os.path.join(REPO_DIR, "README.md")).read()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w.-]+)`(?: \(default\))? \|.*$", readme, re.M)}
    script = open(os.path.join(REPO_DIR, "dreambooth_run.sh")).read()
    assert "print(*families.listing()" in script.split("usage() {")[1].split("\n}")[0]
    listed = next(line for line in families.listing() if line.startswith("Base models by short name"))
    for model in known_models.KNOWN_MODELS:
        row = rows[model.short_name]
        assert f"| `{model.hub_name}` | `{model.revision}` | {model.resolution} |" in row, row
        assert row.endswith("| yes |" if model.gated else "| no |"), row
        assert re.search(rf" {model.short_name}(,|$)", listed), model
    # --help lists them as the families do, the gated ones apart.
    flags = cache_model.flags
    for help_text in (flags.FLAGS["model_name"][1]["help"], flags.FLAGS["model_dir"][1]["help"]):
        assert f"{flags.SHORT_NAMES}" in help_text and f"{flags.GATED}: gated" in help_text
    assert flags.SHORT_NAMES.split(", ") == [m.short_name for m in known_models.KNOWN_MODELS]
    assert flags.GATED.split(", ") == [m.short_name for m in known_models.KNOWN_MODELS if m.gated]


def test_hub_snapshot_path_layout():
    path = modelcache.hub_snapshot_path("/c", "CompVis/stable-diffusion-v1-4", "abc")
    assert path == "/c/models--CompVis--stable-diffusion-v1-4/snapshots/abc"


def test_random_models_and_models_tuned_from_them_are_known(tiny_model, tmp_path):
    assert modelcache.has_random_weights(tiny_model)
    assert not modelcache.has_random_weights(str(tmp_path))
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    files.write_json(str(tuned / files.OUTPUT_MARKER), {"base_model": tiny_model})
    assert modelcache.has_random_weights(str(tuned))
    files.write_json(str(tuned / files.OUTPUT_MARKER), {"base_model": "/data/models--CompVis--sd/snapshots/x"})
    assert not modelcache.has_random_weights(str(tuned))


def test_a_built_random_model_is_reused_and_another_size_gets_its_own_revision(tiny_model):
    """Like a cached download, a second --tiny finds the model already built (same folder, same files)."""
    cache_dir = tiny_model.split(os.sep + "models--")[0]
    weights = os.path.join(tiny_model, "unet", "diffusion_pytorch_model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert cache_model.main(["--model_dir", cache_dir, "--tiny"]) == tiny_model
    assert os.stat(weights).st_mtime_ns == before
    assert len({modelcache.random_model_id(size)[1] for size in ("tiny", "small", "sd15")}) == 3


def test_the_sd2_v_tiny_model_has_its_own_name_and_arch_only_goes_with_a_built_model(tiny_model, tiny_sd2v_model,
                                                                                    tmp_path):
    assert "models--dreambooth-ray--tiny-stable-diffusion-2-v" in tiny_sd2v_model
    assert modelcache.random_model_id("tiny", "sd2-v") != modelcache.random_model_id("tiny")
    assert modelcache.has_random_weights(tiny_sd2v_model)
    for args in (["--model_name", "sd21", "--arch", "sd2-v"], ["--eval_models", "--tiny", "--arch", "sd2-v"]):
        with pytest.raises(errors.UserError, match="--arch is the architecture of a model built here"):
            cache_model.main(["--model_dir", str(tmp_path), *args])


def test_tiny_eval_models_are_built_once_and_load_as_evaluate_reads_them(tmp_path):
    from dreambooth.evaluation import scores

    folder = cache_model.main(["--model_dir", str(tmp_path), "--eval_models", "--tiny"])
    weights = os.path.join(folder, "dino", "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert cache_model.main(["--model_dir", str(tmp_path), "--eval_models", "--tiny"]) == folder
    assert os.stat(weights).st_mtime_ns == before
    embedder = scores.Embedder(os.path.join(folder, "dino"), os.path.join(folder, "clip"))
    assert embedder.clip_texts(["a toy"]).shape[0] == 1


def test_eval_models_resolve_offline_and_pickled_weights_convert_only_when_allowed(tmp_path):
    """A pinned DINO repo with only pytorch_model.bin and a CLIP repo with safetensors, in a hub cache."""
    import torch
    from transformers import AutoModel

    from dreambooth.models import random_models

    built = random_models.build_tiny_eval_models(str(tmp_path / "built"))
    cache, revision = tmp_path / "cache", "0123456789abcdef0123456789abcdef01234567"
    for name, source in (("org/dino", built[0]), ("org/clip", built[1])):
        shutil.copytree(source, modelcache.hub_snapshot_path(str(cache), name, revision))
    dino_snapshot = modelcache.hub_snapshot_path(str(cache), "org/dino", revision)
    original = AutoModel.from_pretrained(built[0])
    os.remove(os.path.join(dino_snapshot, "model.safetensors"))  # as old repos hold it: pickled only
    torch.save(original.state_dict(), os.path.join(dino_snapshot, "pytorch_model.bin"))
    argv = ["--model_dir", str(cache), "--eval_models", "--dino_model", "org/dino", "--dino_revision", revision,
            "--clip_model", "org/clip", "--clip_revision", revision]
    with pytest.raises(errors.UserError, match="org/dino@.* only pickled weights.*--allow_unsafe_weights"):
        cache_model.main(argv)

    folder = cache_model.main(argv + ["--allow_unsafe_weights"])
    assert os.path.isfile(os.path.join(folder, "dino", "model.safetensors"))
    assert files.read_json(os.path.join(folder, "eval_models.json"))["dino"] == {"model": "org/dino",
                                                                                  "revision": revision}
    converted = AutoModel.from_pretrained(os.path.join(folder, "dino"), use_safetensors=True)
    assert all(torch.equal(a, b) for a, b in zip(converted.state_dict().values(), original.state_dict().values()))
    # converted once: the rerun needs no flag
    assert cache_model.main(argv) == folder


def test_a_random_model_larger_than_the_machine_is_refused_before_it_is_built(monkeypatch, tmp_path):
    """Its fp32 weights are counted on the meta device first: Flux.1 dev's 16.8 B parameters are 67 GB."""
    from dreambooth import machine
    from dreambooth.models import random_models

    monkeypatch.setattr(machine, "available_memory", lambda: 60e9)
    with pytest.raises(errors.UserError, match="--random_model flux-dev builds 67 GB of fp32 weights and this "
                                              "machine has 60 GB of memory"):
        random_models.check_room_for("flux-dev", "flux", str(tmp_path))
    random_models.check_room_for("sd15", "sd1", str(tmp_path))  # 4 GB: built

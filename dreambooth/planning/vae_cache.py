"""A VAE of its own (--pretrained_vae_model_name_or_path, e.g. SDXL's madebyollin/sdxl-vae-fp16-fix): found in
the model cache or the hub cache as the base models are (cache_model.py), else fetched once."""

import os

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth import hub
from dreambooth.models import modelcache

VAE_FILES = ["config.json", "diffusion_pytorch_model.safetensors"]


def check_vae_dir(folder, allow_unsafe_weights=False):
    """A UserError unless folder holds a diffusers VAE (config.json and its weights)."""
    files.check_model_files(folder, "fetch or copy the VAE again")  # (a broken link, an empty file, ...: said as such)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise errors.UserError(f"--pretrained_vae_model_name_or_path {folder}: no config.json there (a diffusers "
                               "AutoencoderKL folder, or a hub repository of one, e.g. madebyollin/sdxl-vae-fp16-fix)")
    if not os.path.isfile(os.path.join(folder, VAE_FILES[1])) and not (
            allow_unsafe_weights and os.path.isfile(os.path.join(folder, "diffusion_pytorch_model.bin"))):
        raise errors.UserError(f"--pretrained_vae_model_name_or_path {folder}: no {VAE_FILES[1]} there")
    return folder


# The VAEs people train with, pinned as the base models are, as their families list them: {hub name: commit}
KNOWN_VAES = {name: commit for f in families.FAMILIES.values() for name, commit in f.known_vaes.items()}


def resolve_vae(value, allow_unsafe_weights=False, cache_dir=None):
    """The folder of --pretrained_vae_model_name_or_path: a folder as given, else a hub name found in
    the model cache or your hub cache (a known VAE at its pinned commit, another at any complete
    snapshot: offline works), else fetched once into the model cache (config and safetensors only)."""
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) or value.startswith(("/", ".", "~")) or not modelcache.looks_like_hub_name(value):
        return check_vae_dir(path, allow_unsafe_weights)
    cache_dir = cache_dir or modelcache.model_cache_dir()
    local = modelcache.cache_on_node(cache_dir)  # (a bucket's model cache: this node's copy, the VAE copied there)
    pinned = next((commit for name, commit in KNOWN_VAES.items() if name.lower() == value.lower()), None)
    for folder in dict.fromkeys((local, modelcache.hub_cache_dir())):
        snapshots = os.path.join(modelcache.repo_cache_path(folder, value), "snapshots")
        for revision in sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else ():
            if pinned in (None, revision) and all(os.path.isfile(os.path.join(snapshots, revision, name))
                                                  for name in VAE_FILES):
                return in_bucket(check_vae_dir(os.path.join(snapshots, revision)), cache_dir)
    return in_bucket(check_vae_dir(hub.hub_download(
        f"{value}@{pinned or 'main'}", "run once with network access or give a VAE folder", repo_id=value,
        revision=pinned, cache_dir=local, allow_patterns=VAE_FILES)), cache_dir)


def in_bucket(folder, cache_dir):
    """folder, copied to the bucket first when cache_dir is a bucket's model cache (modelcache.to_bucket)."""
    modelcache.to_bucket(folder, cache_dir, last=VAE_FILES[1])
    return folder

"""`pip install .`: the package, its assets and the dreambooth-* commands, working outside the checkout."""

import os
import shutil
import subprocess
import sys
import sysconfig

from dreambooth import cli
from dreambooth.files import REPO_DIR


def test_pip_install_gives_commands_that_work_outside_the_checkout(tmp_path):
    source = tmp_path / "source"  # (pip builds in the source folder: a copy, not the checkout)
    shutil.copytree(os.path.join(REPO_DIR, "dreambooth"), source / "dreambooth",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(os.path.join(REPO_DIR, name), source)
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--prefix", str(prefix), str(source)], check=True, capture_output=True, text=True)
    site = sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})
    bin_dir = prefix / "bin"
    assert sorted(os.listdir(bin_dir)) == sorted(f"dreambooth-{c.replace('_', '-')}" for c in cli.COMMANDS)
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=site)  # (the installed copy, not the checkout)
    helped = subprocess.run([str(bin_dir / "dreambooth-train"), "--help"], cwd=run_dir, env=env,
                            capture_output=True, text=True)
    assert helped.returncode == 0 and "--instance_data_dir" in helped.stdout, helped.stderr[-2000:]
    # The tiny model needs the package's own tokenizer files; with no DATA_PREFIX, it goes to data/ here.
    for name in ("DATA_PREFIX", "ORIG_MODEL_DIR"):
        env.pop(name, None)
    built = subprocess.run([str(bin_dir / "dreambooth-cache-model"), "--tiny"], cwd=run_dir, env=env,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    path = built.stdout.strip().splitlines()[-1]
    assert path.startswith(str(run_dir / "data" / "model-orig")) and os.path.isfile(os.path.join(path, "model_index.json"))
    imported = subprocess.run([sys.executable, "-c", "import dreambooth; print(dreambooth.__file__)"], cwd=run_dir,
                              env=env, capture_output=True, text=True)
    assert imported.stdout.startswith(site), imported.stdout


def test_the_runtime_requirements_resolve_alone_to_what_both_files_installed(tmp_path):
    """requirements-dev.txt installed after requirements.txt once replaced a runtime package by an older one (its
    mlflow and botocore take older importlib_metadata and python-dateutil than diffusers and pandas get alone): what
    pip resolves for requirements.txt alone is, package by package, what this environment (both files, the README's
    test command) holds. Where the two differ, both files are resolved again now: a release the registry gained after
    this environment was installed is not the files' doing, a package the second file moves is."""
    import importlib.metadata

    def installed(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    alone = _resolve(tmp_path / "alone.json", "requirements.txt")
    assert len(alone) > 20 and "diffusers" in alone
    differ = {name for name, version in alone.items() if installed(name) != version}
    if differ:
        both = _resolve(tmp_path / "both.json", "requirements.txt", "requirements-dev.txt")
        assert {name: (alone[name], both.get(name)) for name in differ if both.get(name) != alone[name]} == {}


def _resolve(report, *files):
    """{package: version} that pip would install for these requirement files into an empty environment."""
    import json

    args = [arg for name in files for arg in ("-r", os.path.join(REPO_DIR, name))]
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--report",
                    str(report), *args], check=True, capture_output=True)
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}

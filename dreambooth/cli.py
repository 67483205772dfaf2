"""The console commands `pip install .` puts on the PATH, each the script of the same name at the repository's
root: dreambooth-train is train.py, dreambooth-generate generate.py, and so on (same flags, same exit codes)."""

import importlib

COMMANDS = ("train", "generate", "evaluate", "sweep", "export", "cache_model", "preflight",
            "download_example_dataset", "serve")


def _run(command):
    from dreambooth import errors

    errors.run_main(importlib.import_module(f"dreambooth.commands.{command}").main)


def train():
    _run("train")


def generate():
    _run("generate")


def evaluate():
    _run("evaluate")


def sweep():
    _run("sweep")


def export():
    _run("export")


def cache_model():
    _run("cache_model")


def preflight():
    _run("preflight")


def download_example_dataset():
    _run("download_example_dataset")


def serve():
    _run("serve")

"""The types of the flags' values: argparse's type= functions, each a one-line ArgumentTypeError for a bad value."""

import argparse
import os

EMPTY = "is empty (a shell variable never set, or set by $(…) from a command that failed?)"


def _not_empty(value):
    """value, unless it is empty: an empty path would mean the current folder, and its error would name that."""
    if not value.strip():
        raise argparse.ArgumentTypeError(EMPTY)
    return value


def abs_path(value):
    """Paths are made absolute on the driver: Ray workers run in another folder."""
    return os.path.abspath(os.path.expanduser(_not_empty(value)))


def storage_location(value):
    """A folder, or an object-storage URI (s3://bucket/prefix, gs://…: storage/) kept as given."""
    if _not_empty(value).startswith(("s3://", "gs://")):
        if not value.split("://", 1)[1].strip("/"):
            raise argparse.ArgumentTypeError(f"needs a bucket: {value}")
        return value.rstrip("/")
    return abs_path(value)


def model_path(value):
    """A model folder, or a short or hub name (sd15, CompVis/stable-diffusion-v1-4), as given: parsing
    never fetches; planning.model_flags.resolve_models turns the names into folders after the parse."""
    return _not_empty(value)


def _bounded(kind, strict):
    """An argparse type: kind(value) > 0 when strict, else >= 0 (NaN fails both)."""
    def parse(value):
        number = kind(value)
        if not (number > 0 if strict else number >= 0):
            wanted = ("a positive integer" if kind is int else "> 0") if strict else ">= 0"
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return number
    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return parse


positive_int, non_negative_int = _bounded(int, strict=True), _bounded(int, strict=False)
positive_float, non_negative_float = _bounded(float, strict=True), _bounded(float, strict=False)


def resolution(value):
    number = positive_int(value)
    if number % 8:
        raise argparse.ArgumentTypeError(f"must be a multiple of 8, got {value}")
    return number


def _list_of(kind, name):
    def parse(value):
        items = [kind(v.strip()) for v in value.split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentTypeError("needs at least one value")
        return list(dict.fromkeys(items))
    parse.__name__ = name
    return parse


def _switch(value):
    words = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    if value.lower() not in words:
        raise argparse.ArgumentTypeError(f"'{value}' is not on or off")
    return words[value.lower()]


float_list = _list_of(positive_float, "comma-separated list of numbers")
int_list = _list_of(positive_int, "comma-separated list of positive integers")
bool_list = _list_of(_switch, "comma-separated list of on/off")


def resource_amounts(value):
    """'NAME=N,NAME=N' (Ray resources beside CPU and GPU) -> {NAME: N}; ArgumentTypeError if it is not that."""
    amounts = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        name, _, amount = item.partition("=")
        if not name.strip() or name.strip() in ("CPU", "GPU", "memory"):
            raise argparse.ArgumentTypeError(f"'{item}': give NAME=AMOUNT of a resource of your own (ray start "
                                             "--resources), not CPU, GPU or memory")
        amounts[name.strip()] = positive_float(amount)
    if not amounts:
        raise argparse.ArgumentTypeError("needs NAME=AMOUNT")
    return amounts


def resources_flag(value):
    """--resources_per_worker's value, checked and kept as text (a settings file repeats it as typed)."""
    resource_amounts(value)
    return value


def fraction(value):
    number = float(value)
    if not 0 <= number <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return number


def ema_decay(value):
    number = float(value)
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 0 and < 1, got {value}")
    return number


def webhook_url(value):
    """--notify_url's value: an http(s) URL (it is never echoed: a webhook URL is a secret)."""
    if not value.startswith(("https://", "http://")):
        raise argparse.ArgumentTypeError("needs an http:// or https:// webhook URL")
    return value


def one_prompt(value):
    """A prompt as given, commas and all: Stable Diffusion prompts are full of them
    ("photo of unqtkn dog, oil painting, detailed"). Several prompts: repeat the flag."""
    if not value.strip():
        raise argparse.ArgumentTypeError("needs a non-empty prompt")
    return value.strip()

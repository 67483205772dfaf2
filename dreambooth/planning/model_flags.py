"""The model flags of a parsed command line (--model_dir, --base_model_dir) turned from a short or hub name into
the model's folder, once, right after the parse: nothing below reads a name."""

from dreambooth.models import modelcache

MODEL_FLAGS = ("model_dir", "base_model_dir")  # the flags that take a model folder or name (flags.model_path)


def resolve_models(args):
    """args with each model flag's short or hub name made the model's folder (modelcache.resolve_model_name: found
    in the caches, else fetched once), after the parse and before anything reads them."""
    for name in MODEL_FLAGS:
        value = getattr(args, name, None)
        if value:
            setattr(args, name, modelcache.resolve_model_name(value))
    return args

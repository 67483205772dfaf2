"""The Ray Data training pipeline (photos decoded once, latents cached on an actor pool, one bucket
per batch) is dreambooth/training/dataset.py; this module hands it on under the name Ray's example uses.
train.py builds it: `dataset.build_train_dataset(...)`."""

from dreambooth.training.dataset import *  # noqa: F401,F403

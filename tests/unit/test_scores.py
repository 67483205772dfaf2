import glob
import os

import pytest
import torch
from PIL import Image

from dreambooth import errors
from dreambooth import files
from dreambooth.evaluation import scores
from dreambooth.models import random_models


def cluster(center, n, spread, seed):
    """n embeddings scattered around a direction: photos of one subject as an ideal embedder sees them."""
    g = torch.Generator().manual_seed(seed)
    return center + spread * torch.randn(n, center.numel(), generator=g)


def test_identical_embeddings_score_one_and_opposite_minus_one():
    x = torch.randn(4, 8)
    assert scores.mean_similarity(x[:1], x[:1]) == pytest.approx(1.0)
    assert scores.mean_similarity(x[:1], -x[:1]) == pytest.approx(-1.0)
    assert scores.paired_similarity(x, 3 * x) == pytest.approx(1.0)


def test_a_subject_scores_higher_against_itself_than_against_another_subject():
    u, v = torch.eye(16)[0], torch.eye(16)[1]
    dog, other_dog = cluster(u, 5, 0.05, 0), cluster(v, 5, 0.05, 1)
    generated = cluster(u, 8, 0.1, 2)
    assert scores.mean_similarity(generated, dog) > scores.mean_similarity(generated, other_dog) + 0.5


def test_clip_t_is_higher_for_the_matching_prompt():
    images = torch.randn(3, 8)
    prompts = images + 0.1 * torch.randn(3, 8)  # prompt i describes image i
    assert scores.paired_similarity(images, prompts) > scores.paired_similarity(images, prompts.roll(1, 0))


def test_mean_similarity_averages_every_pair():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[1.0, 0.0]])
    assert scores.mean_similarity(a, b) == pytest.approx(0.5)  # (1 + 0) / 2


def test_diversity_is_zero_for_copies_and_counts_pairs_within_prompts_only():
    x = torch.randn(1, 8)
    assert scores.diversity([x.repeat(4, 1)]) == pytest.approx(0.0, abs=1e-6)
    e = torch.eye(2)
    # One prompt with two orthogonal images (distance 1), one with two copies (0): pairs 1 and 0.
    assert scores.diversity([e, e[:1].repeat(2, 1)]) == pytest.approx(0.5)
    assert scores.diversity([e[:1], e]) == pytest.approx(1.0)  # a single image adds no pair
    with pytest.raises(errors.UserError, match="at least two images"):
        scores.diversity([e[:1]])


@pytest.mark.parametrize("prompt, expected", [
    ("a photo of unqtkn dog", "a photo of dog"),
    ("unqtkn dog in a bucket, unqtkn's collar", "dog in a bucket, 's collar"),
    ("a unqtknx dog", "a unqtknx dog"),  # only the whole token goes
])
def test_the_unique_token_is_removed_for_clip_t(prompt, expected):
    assert scores.without_token(prompt, "unqtkn") == expected


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    dino_dir, clip_dir = random_models.build_tiny_eval_models(str(tmp_path_factory.mktemp("eval-models")))
    return scores.Embedder(dino_dir, clip_dir)


def test_tiny_models_embed_images_and_prompts_and_identical_images_score_one(embedder):
    photos = [Image.open(p).convert("RGB") for p in sorted(glob.glob(os.path.join(files.REPO_DIR, "images/toy/*.jpg")))]
    dino, clip = embedder.dino_images(photos), embedder.clip_images(photos)
    assert dino.shape == (5, 32) and clip.shape == (5, 16)
    copies = [photos[0].copy() for _ in range(3)]
    assert scores.mean_similarity(embedder.dino_images(copies), dino[:1]) == pytest.approx(1.0, abs=1e-5)
    assert scores.mean_similarity(embedder.clip_images(copies), clip[:1]) == pytest.approx(1.0, abs=1e-5)
    assert scores.mean_similarity(dino, dino) < 1.0  # different photos differ
    texts = embedder.clip_texts(["a photo of toy", "a red car on a beach"])
    assert texts.shape == (2, 16) and not torch.allclose(texts[0], texts[1])

"""The DreamBooth paper's scores (Ruiz et al., 2023, section 4.1) and the models that embed for them.

- DINO: mean cosine similarity of DINO ViT embeddings (the CLS token) of generated images and the
  real subject photos, over every pair. Subject fidelity that tells subjects of a class apart.
- CLIP-I: the same with CLIP image embeddings.
- CLIP-T: mean CLIP similarity of each generated image with its own prompt, the unique token
  removed from the prompt. Prompt fidelity.
- PRES: DINO similarity of images of the *class* prompt to the subject photos: high means the
  class has drifted towards the subject (language drift), low is good.
- DIV: mean pairwise DINO distance (1 - similarity) among images of one prompt: diversity.

Plain NumPy functions on (N, D) embeddings (arrays or CPU tensors; evaluate.py's driver never
imports torch: 1.6 s of every run); the Embedder turns PIL images and prompts into them.
"""

import itertools
import re

import numpy as np

from dreambooth import errors
from dreambooth import files
from dreambooth.models import networks

# The paper's values for SD 1.x DreamBooth (table 1), printed beside ours in report.md.
PAPER_SD = {"dino": 0.668, "clip_i": 0.803, "clip_t": 0.305}
SCORE_NAMES = ("dino", "clip_i", "clip_t", "div")
HOLDOUT_NAMES = ("dino_holdout", "clip_i_holdout")  # --holdout: against the photos kept out of training


def ranking_key(candidates):
    """Which DINO models are ranked by, of their scores ({metric: value} each): against the held-out photos when every
    one has it (--holdout), else against all of them."""
    return "dino_holdout" if all(c.get("dino_holdout") is not None for c in candidates) else "dino"


def best_of(candidates, clip_t_floor):
    """(key, within_margin, ranked_by) of the best of candidates ({key: {metric: value}}), the sweep's rule: the highest
    DINO (ranking_key) among those whose CLIP-T is at least clip_t_floor (the base model's minus the margin: a model
    that only repeats its photos scores high DINO, low CLIP-T), else the highest of all (within_margin False); the
    first in candidates' order of equal ones."""
    ranked_by = ranking_key(candidates.values())
    kept = [key for key, c in candidates.items() if c["clip_t"] >= clip_t_floor]
    best = max(kept or candidates, key=lambda key: candidates[key][ranked_by])
    return best, bool(kept), ranked_by


def _unit(x):
    """x's rows scaled to unit length, in float64."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def mean_similarity(a, b):
    """Mean cosine similarity over every pair (a_i, b_j); a (N, D), b (M, D). DINO, CLIP-I, PRES."""
    return float((_unit(a) @ _unit(b).T).mean())


def paired_similarity(a, b):
    """Mean cosine similarity of a_i with b_i; a, b (N, D). CLIP-T: image i with its own prompt."""
    return float((_unit(a) * _unit(b)).sum(-1).mean())


def diversity(groups):
    """DIV: mean pairwise cosine distance within each group of (N_k, D) embeddings (one group per
    prompt), averaged over the pairs of all groups; groups of one image have no pairs."""
    units = [_unit(g) for g in groups]
    distances = [1 - float((u[i] * u[j]).sum()) for u in units for i, j in itertools.combinations(range(len(u)), 2)]
    if not distances:
        raise errors.UserError("DIV needs at least two images of one prompt")
    return sum(distances) / len(distances)


def without_token(prompt, token):
    """The prompt as CLIP-T reads it: the unique identifier removed ("a unqtkn dog" -> "a dog")."""
    return re.sub(r"\s+", " ", re.sub(rf"(?<!\w){re.escape(token)}(?!\w)", "", prompt)).strip()


class Embedder:
    """DINO and CLIP embeddings from two local transformers folders (a ViT-style model whose
    last_hidden_state[:, 0] is the CLS token, and a CLIPModel), with their own processors."""

    def __init__(self, dino_dir, clip_dir, device="cpu", allow_unsafe_weights=False):
        import torch
        from transformers import AutoImageProcessor
        from transformers import AutoModel
        from transformers import AutoProcessor
        from transformers import CLIPModel

        self.device = torch.device(device)
        with files.unchanged_while(dino_dir, clip_dir, what="loading the scoring models"):
            self.dino = networks.from_pretrained(AutoModel, dino_dir, allow_unsafe_weights).to(self.device).eval()
            self.dino_processor = AutoImageProcessor.from_pretrained(dino_dir)
            self.clip = networks.from_pretrained(CLIPModel, clip_dir, allow_unsafe_weights).to(self.device).eval()
            self.clip_processor = AutoProcessor.from_pretrained(clip_dir)

    def dino_images(self, images):
        """(N, D) CLS embeddings of PIL images."""
        import torch

        pixels = self.dino_processor(images=images, return_tensors="pt")["pixel_values"].to(self.device)
        with torch.no_grad():
            return self.dino(pixel_values=pixels).last_hidden_state[:, 0].cpu()

    def clip_images(self, images):
        """(N, P) CLIP image features of PIL images."""
        import torch

        pixels = self.clip_processor(images=images, return_tensors="pt")["pixel_values"].to(self.device)
        with torch.no_grad():
            return _features(self.clip.get_image_features(pixel_values=pixels)).cpu()

    def clip_texts(self, prompts):
        """(N, P) CLIP text features of prompts."""
        import torch

        tokens = self.clip_processor(text=list(prompts), return_tensors="pt", padding=True, truncation=True)
        with torch.no_grad():
            return _features(self.clip.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                                         attention_mask=tokens["attention_mask"].to(self.device))).cpu()


def _features(output):
    """get_*_features returns a tensor in transformers 4 and a model output in some 5.x versions."""
    return output if hasattr(output, "norm") else output.pooler_output


# ---------------------------------------------------------------- tiny random models (tests, --tiny)



"""FLUX.2 [klein] (4B and 9B; base and step-distilled): the FLUX.2 transformer over its folded VAE latents
(flux2base.py), conditioned on three hidden layers of a Qwen3 text encoder read through
its chat template, side by side (every prompt padded to 512 tokens). No guidance input: the base models draw
with classifier-free guidance against the empty prompt (guidance_scale 4.0); the distilled ones ignore it. The
text encoder is never trained: its states are computed once and it leaves the device, as Flux.1's T5 does.
Trained as diffusers' train_dreambooth_lora_flux2_klein.py trains it: the VAE's mode, not a sample, as the
clean latents; objectives.flow_matching on the scheduler's sigmas; uniform timesteps by default.
"""

from dreambooth.families.shared import builders
from dreambooth.families.shared import flux2base
from dreambooth.families.shared import known

OUT_LAYERS = (9, 18, 27)  # the text encoder's hidden states the pipeline stacks (its text_encoder_out_layers)


class KleinModels(flux2base.Flux2Models):
    note = "FLUX.2 [klein]'s layout: a double/single-stream transformer, a Qwen3 text encoder read at three layers, " \
           "flow matching, 32-channel latents folded 2x2"
    # tiny: 64 px; a Qwen3 32 wide of 28 layers (text_depth: the pipeline reads layers 9, 18 and 27)
    changes = dict(flux2base.TINY, text_depth=28)
    # FLUX.2 [klein] 4B's and 9B's shapes (--random_model flux2-klein-4b|flux2-klein-9b), 1024 px: 5 + 20 and
    # 8 + 24 blocks of 24 and 32 heads of 128 reading Qwen3-4B's and Qwen3-8B's layers 9, 18, 27 (3 x 2560 and
    # 3 x 4096 wide), the VAE of 32 latent channels
    own_sizes = {
        "flux2-klein-4b": dict(flux2base.Flux2Models._vae, layers=5, single_layers=20, head_dim=128, heads=24, rope=(32, 32, 32, 32),
                               text_hidden=2560, text_depth=36, text_heads=32, text_kv_heads=8, text_head_dim=128,
                               text_ff=9728, text_vocab=151936, text_tied=True),
        "flux2-klein-9b": dict(flux2base.Flux2Models._vae, layers=8, single_layers=24, head_dim=128, heads=32, rope=(32, 32, 32, 32),
                               text_hidden=4096, text_depth=36, text_heads=32, text_kv_heads=8, text_head_dim=128,
                               text_ff=12288, text_vocab=151936, text_tied=False)}

    def text_encoders(self, spec, tokenizer):
        from transformers import Qwen3Config
        from transformers import Qwen3ForCausalLM

        arch = {**self.changes, **spec}
        qwen_tokenizer = builders.tiny_qwen3_tokenizer()
        width = arch["text_hidden"]
        config = Qwen3Config(**builders.qwen3_text(arch, qwen_tokenizer, arch["text_depth"], 2 * flux2base.MAX_TOKENS),
                             tie_word_embeddings=arch.get("text_tied", True), bos_token_id=None,
                             eos_token_id=qwen_tokenizer.eos_token_id)
        return {"text_encoder": Qwen3ForCausalLM(config)}, len(OUT_LAYERS) * width, {}

    def pipeline(self, nets, tokenizer, betas, safety_checker):
        from diffusers import Flux2KleinPipeline

        return Flux2KleinPipeline(tokenizer=builders.tiny_qwen3_tokenizer(), scheduler=self.scheduler(), is_distilled=False, **nets)


class Flux2Klein(flux2base.Flux2Family):
    label = "FLUX.2 [klein]"
    order = 70
    pipeline = "Flux2KleinPipeline"
    text_encoders = ("text_encoder",)  # Qwen3 (three of its hidden layers)
    guidance_scale = 4.0  # Flux2KleinPipeline's default (the base models'; the distilled ones ignore it)
    # FLUX.2 [klein] 9B's transformer, Qwen3-8B and the VAE, counted on the meta device (tests/unit/test_memory.py); the
    # 4B's: 3875.54 M, Qwen3-4B 4022.47 M
    released_params = {"transformer": 9078.58e6, "text_encoder": 8190.74e6, "vae": 84.05e6}
    released_size = "flux2-klein-9b"
    memory_rows = (("FLUX.2 [klein] 4B", "flux2-klein-4b", (512, 1024), (4,)),
                   ("FLUX.2 [klein] 9B", "flux2-klein-9b", (512, 1024), (4, 8)))
    random = KleinModels()
    # Its base models by short name (families.KNOWN_MODELS), also --random_model sizes (own_sizes): the undistilled
    # [klein] base models, the ones diffusers' klein script and the trainers fine-tune (the step-distilled FLUX.2-klein-4B
    # and -9B are for drawing), in bf16 safetensors: 4B 16.0 GB (transformer 7.8, Qwen3-4B 8.0, VAE 0.2), 9B 34.7 GB
    # (transformer 18.2, Qwen3-8B 16.4). The 4B is Apache 2.0; the 9B is under the FLUX non-commercial license, served
    # to accounts that accepted it. The revisions could not be checked from here (no hub access): they are the
    # commits people's hub caches show (models--black-forest-labs--FLUX.2-klein-base-*/snapshots/<commit>).
    known_models = (
        known.KnownModel("flux2-klein-4b", "black-forest-labs/FLUX.2-klein-base-4B",
                         "a3b4f4849157f664bdbc776fd7453c2783562f4d", 1024, "flow", 16.0),
        known.KnownModel("flux2-klein-9b", "black-forest-labs/FLUX.2-klein-base-9B",
                         "17c3b160520b7dd44665dbf0b9ed9dd30c15cd06", 1024, "flow", 34.7, gated=True),
    )
    out_layers = OUT_LAYERS  # the text encoder's hidden states read, side by side

    def load_tokenizers(self, model_dir):
        from transformers import Qwen2TokenizerFast

        return [Qwen2TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer")]

    def load_text_encoders(self, model_dir, load):
        from transformers import Qwen3ForCausalLM

        return [load(Qwen3ForCausalLM, "text_encoder")]

    def token_ids(self, tokenizers, prompt):
        """(2, flux2base.MAX_TOKENS): the prompt's ids through the tokenizer's chat template and their attention mask, as
        Flux2KleinPipeline tokenizes it."""
        import numpy as np

        tokenizer = tokenizers[0]
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
        tokens = tokenizer(text, max_length=flux2base.MAX_TOKENS, padding="max_length", truncation=True, return_tensors="np")
        return np.stack([tokens.input_ids[0], tokens.attention_mask[0]]).astype(np.int64)


FAMILY = Flux2Klein()

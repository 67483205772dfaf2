"""Loading a Qwen text encoder and its tokenizer from a model folder, shared by the families whose folder names the
text encoder's class in its model_index.json (Z-Image: Qwen3Model; Ideogram 4: Qwen3VLModel)."""

from dreambooth.families.shared import family


class IndexedQwenText(family.Family):
    """A family reading one Qwen text encoder (text_encoder/, of the transformers class model_index.json names)
    through a Qwen2 tokenizer (tokenizer/)."""

    def load_tokenizers(self, model_dir):
        from transformers import Qwen2TokenizerFast

        return [Qwen2TokenizerFast.from_pretrained(model_dir, subfolder="tokenizer")]

    def load_text_encoders(self, model_dir, load):
        """The class model_index.json names."""
        import os

        import transformers

        from dreambooth import files

        _, name = files.read_json(os.path.join(model_dir, "model_index.json"))["text_encoder"]
        return [load(getattr(transformers, name), "text_encoder")]

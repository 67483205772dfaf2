"""Ideogram 4's packed sequence of text and image tokens: its layout (training's and drawing's), and its pipeline
reading prompt states computed once for validation samples, as the other families' pipelines read prompt_embeds
(Ideogram4Pipeline encodes its prompts itself, with the text encoder that training has released)."""


def layout(mask, h, w):
    """(position_ids (B, L + h x w, 3), segment_ids, indicator) of the packed sequences of text blocks whose tokens
    mask (B, L) marks (left-padded: each prompt's tokens last) and an h x w image: what Ideogram4Pipeline._prepare_ids
    makes of the prompts' lengths. A text token's positions are its index in its prompt on all three axes, an image
    token's (0, row, column) past IMAGE_POSITION_OFFSET; text and image share segment 1, the padding is segment
    SEQUENCE_PADDING_INDICATOR with zero positions and no role."""
    import torch
    from diffusers.models.transformers import transformer_ideogram4 as t4

    b, device = mask.shape[0], mask.device
    text = mask.long()
    position = (text.cumsum(1) - 1).clamp(min=0) * text
    rows = torch.arange(h, device=device).repeat_interleave(w)
    columns = torch.arange(w, device=device).repeat(h)
    image = torch.stack([torch.zeros_like(rows), rows, columns], dim=1) + t4.IMAGE_POSITION_OFFSET
    position_ids = torch.cat([position[..., None].expand(-1, -1, 3), image.expand(b, -1, -1)], dim=1)
    segment_ids = torch.cat([torch.where(text.bool(), 1, t4.SEQUENCE_PADDING_INDICATOR),
                             torch.ones(b, h * w, dtype=torch.long, device=device)], dim=1)
    indicator = torch.cat([text * t4.LLM_TOKEN_INDICATOR,
                           torch.full((b, h * w), t4.OUTPUT_IMAGE_INDICATOR, dtype=torch.long, device=device)], dim=1)
    return position_ids, segment_ids, indicator


def states_pipeline(parts):
    """An Ideogram4Pipeline of parts (its components; the text encoder may be None) whose call takes
    prompt_states=(N, L, D) text states and prompt_mask=(N, L) (the family's encode_text: each prompt's tokens last
    in a block as long as the longest) in place of prompt, and draws from them as the pipeline draws from its own
    encoding: the same text features and packed layout (layout), with the block L tokens long rather than
    max_sequence_length (the padding a segment no token reads: the image tokens' outputs are the same)."""
    from diffusers import Ideogram4Pipeline

    class StatesPipeline(Ideogram4Pipeline):
        def __call__(self, prompt_states, prompt_mask, **kwargs):
            self._states = prompt_states, prompt_mask
            try:
                return super().__call__(prompt=[""] * prompt_states.shape[0],
                                        max_sequence_length=prompt_states.shape[1], **kwargs)
            finally:
                del self._states

        def encode_prompt(self, prompt, grid_h, grid_w, max_sequence_length, device):
            import torch

            states, mask = (t.to(device) for t in self._states)
            image = states.new_zeros(states.shape[0], grid_h * grid_w, states.shape[2])
            return (torch.cat([states, image], dim=1).float(), *layout(mask, grid_h, grid_w))

    return StatesPipeline(**parts)

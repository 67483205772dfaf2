"""The text conditioning of the training step: the prompts a worker hands steps.train_step (one
typed record, StepPrompts), built once from the run's token ids, and turned into each batch's
states: every row's prompt (its photo's caption, or the instance prompt; the empty prompt under
caption dropout), the class prompt for the class rows, the base model's class states for a
predicted prior. A gather on the device: no step waits on the host.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class StepPrompts:
    """What the training step conditions on, on the text encoders' device.

    instance, class_prompt: token ids of the P distinct instance prompts (P, L) and of the class
    prompt (1, L) (SDXL's two tokenizers: (P, 2, L), (1, 2, L)), run through the trained text
    encoders each step; or, with frozen encoders, their states (P, L, D) and (1, L, D) computed once
    (encoded), with the pooled embeddings beside them where the family has them (SDXL).
    """

    instance: torch.Tensor
    class_prompt: torch.Tensor = None  # None: no class rows
    instance_pooled: torch.Tensor = None
    class_pooled: torch.Tensor = None
    image_prompt: torch.Tensor = None  # (N,) index into instance of each instance image's prompt (its caption)
    caption_dropout: tuple = None  # (rate, index of the empty prompt in instance), --caption_dropout_rate
    class_base: torch.Tensor = None  # (1, L, D) the base text encoders' class states: the predicted prior
    class_base_pooled: torch.Tensor = None

    @property
    def encoded(self):
        return self.instance.is_floating_point()


def step_prompts(family, text_encoders, plan, ids, device):
    """The StepPrompts of a plan from its token ids (prompts.run_prompt_ids): ids, or with frozen
    text encoders and --precompute_text_embeddings their states, computed here once."""
    instance = torch.tensor(ids["instance"], device=device)
    class_prompt = torch.tensor(ids["class"], device=device).unsqueeze(0) if "class" in ids else None
    pooled = {}
    if plan.text_encoded_once:
        with torch.no_grad():
            instance, pooled["instance_pooled"] = family.encode_text(text_encoders, instance)
            if class_prompt is not None:
                class_prompt, pooled["class_pooled"] = family.encode_text(text_encoders, class_prompt)
    dropout = (plan.caption_dropout_rate, len(plan.instance_prompts)) if plan.caption_dropout_rate else None
    return StepPrompts(instance, class_prompt, **pooled,
                       image_prompt=torch.tensor(plan.image_prompt or [0], dtype=torch.long, device=device),
                       caption_dropout=dropout)


def with_base_class(prompts, family, text_encoders, ids, device):
    """prompts with the class prompt's states from the base text encoders (ids["class"]): the
    conditioning of the base model's predictions under --prior_preservation prior_prediction. Call
    before trained weights are loaded."""
    tokens = torch.tensor(ids["class"], device=device).unsqueeze(0)
    with torch.no_grad():
        states, pooled = family.encode_text(text_encoders, tokens)
    return dataclasses.replace(prompts, class_base=states, class_base_pooled=pooled)


def batch_states(models, prompts, instance_prompt, num_class):
    """(states (num_instance + num_class, L, D), pooled (same rows, P) or None) of a batch: each
    instance row's prompt (instance_prompt: (num_instance,) index into prompts.instance), then the
    class prompt for the num_class class rows. Ids go through models' text encoders (their family's
    encode_text) together once a step, not once per row."""
    instance = prompts.instance
    cls = prompts.class_prompt if num_class else instance[:0]
    if prompts.encoded:
        pooled = prompts.instance_pooled
        pooled_cls = (prompts.class_pooled if num_class else pooled[:0]) if pooled is not None else None
    else:
        states, pooled_all = models.family.encode_text(models.text_encoders(), torch.cat([instance, cls]))
        instance, cls = states[:len(instance)], states[len(instance):]
        pooled, pooled_cls = ((pooled_all[:len(prompts.instance)], pooled_all[len(prompts.instance):])
                              if pooled_all is not None else (None, None))
    length = max(instance.shape[1], cls.shape[1])  # (prompt states trimmed to their longest: Qwen-Image's)
    instance, pooled = models.family.pad_text(instance, pooled, length)
    cls, pooled_cls = models.family.pad_text(cls, pooled_cls, length)
    index = instance_prompt.to(instance.device)
    states = torch.cat([instance[index], cls.expand(num_class, -1, -1)])
    if pooled is None:
        return states, None
    return states, torch.cat([pooled[index], pooled_cls.expand(num_class, -1)])


def row_prompts(prompts, batch, num_instance):
    """(num_instance,) index of each instance row's prompt: the caption of the row's image
    (batch["instance_image"] through prompts.image_prompt), or prompt 0 for all. Under
    prompts.caption_dropout = (rate, empty) each row takes prompt `empty` (the empty prompt) with
    probability rate, drawn from torch's seeded stream (a checkpoint keeps its state)."""
    if "instance_image" in batch and prompts.image_prompt is not None:
        index = prompts.image_prompt[batch["instance_image"].to(prompts.image_prompt.device)]
    else:
        index = torch.zeros(num_instance, dtype=torch.long, device=prompts.instance.device)
    if prompts.caption_dropout:
        rate, empty = prompts.caption_dropout
        dropped = torch.rand(num_instance, device=index.device) < rate
        index = torch.where(dropped, torch.full_like(index, empty), index)
    return index

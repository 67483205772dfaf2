"""The prompts of a training run: captions beside the instance images, the check that each
names the subject with a word the class prompt lacks, and their CLIP token ids."""

import os
import sys

from dreambooth import errors
from dreambooth import families
from dreambooth import files


def lacks_identifier(instance_prompt, class_prompt):
    """True when the instance prompt adds no word to the class prompt (no 'unqtkn' to learn)."""
    return bool(class_prompt) and set(instance_prompt.lower().split()) <= set(class_prompt.lower().split())


def warn_without_identifier(instance_prompts, instance_prompt, class_prompt):
    """One warning line when instance prompts (captions or --instance_prompt) add no word to the class prompt."""
    generic = [p for p in instance_prompts if lacks_identifier(p, class_prompt)]
    if generic:
        which = "--instance_prompt" if generic == [instance_prompt] else f"{len(generic)} prompt(s)/caption(s)"
        print(f"warning: {which} {'has' if len(generic) == 1 else 'have'} no word that --class_prompt lacks "
              f"(e.g. {generic[0]!r}): the subject has no unique identifier", file=sys.stderr)


def without_the_subject(texts, instance_prompt, class_prompt):
    """The warning line when none of texts (prompts to draw a tuned model with) holds a word of the subject's
    identifier, the words instance_prompt adds to class_prompt ('unqtkn' of 'photo of unqtkn dog'); None when one
    does, or when the identifier is unknown (no class prompt, or none added)."""
    if not instance_prompt or not class_prompt:
        return None

    def words_of(text):
        return set(text.lower().replace(",", " ").split())

    words = words_of(instance_prompt) - words_of(class_prompt)
    if not words or any(words & words_of(text) for text in texts):
        return None
    return (f"warning: no prompt names the subject: the model was trained on {instance_prompt!r}, whose "
            f"{'/'.join(sorted(words))} the prompts lack (e.g. {texts[0]!r}): they draw the class, not your subject")


def read_captions(image_paths, instance_prompt, caption_extension):
    """Each instance image's prompt: the text of the file beside it with the same stem and
    caption_extension (whitespace folded), or instance_prompt where there is none."""
    prompts = []
    for path in image_paths:
        caption = os.path.splitext(path)[0] + caption_extension if caption_extension else ""
        if not os.path.lexists(caption):  # (a broken link or a folder of that name is said, not passed over)
            prompts.append(instance_prompt)
            continue
        text = " ".join(files.read_user_text(caption, "caption file").split())
        if not text:
            raise errors.UserError(f"caption file {caption} is empty; write the image's prompt in it or delete it")
        prompts.append(text)
    return prompts


def prompt_ids(model_dir, instance_prompts, class_prompt, family=None):
    """Token ids of the prompts: per prompt (L,) ids, or with E text encoders (SDXL, SD 3.5, Flux.1) (E, L),
    each tokenizer's (family.token_ids); {"instance": [ids per prompt], "class": ids (with a class_prompt)}."""
    family = family or families.family_of(model_dir)
    tokenizers = family.load_tokenizers(model_dir)

    def tokenize(prompt):
        return family.token_ids(tokenizers, prompt).tolist()

    ids = {"instance": [tokenize(p) for p in instance_prompts]}
    if class_prompt:
        ids["class"] = tokenize(class_prompt)
    return ids


def run_prompt_ids(plan):
    """prompt_ids of a plan.Plan's prompts, tokenised on the workers (the driver does not import
    transformers for it, a second of every run's start): "instance" for each of its instance_prompts,
    then the empty prompt with --caption_dropout_rate; "class" with prior preservation."""
    return prompt_ids(plan.model_dir, list(plan.instance_prompts) + ([""] if plan.caption_dropout_rate else []),
                      plan.class_prompt if plan.with_prior_preservation or plan.prior_prediction else None, plan.family)


def read_prompt_file(path):
    """The prompts of a file, one per line (commas and all); blank lines and '#' lines are skipped."""
    lines = files.read_user_text(path, "the prompts file").splitlines()
    found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not found:
        raise errors.UserError(f"the prompts file {path} holds no prompts (one per line)")
    return found


def prompts_of(prompts, prompts_file):
    """The prompts of --prompts (each value one prompt, commas and all) and --prompts_file, once each."""
    given = list(prompts or [])
    if prompts_file:
        given += read_prompt_file(prompts_file)
    if not given:
        raise errors.UserError("give the prompts: --prompts 'photo of a dog' (repeat the flag for several) "
                               "or --prompts_file FILE (one per line)")
    return list(dict.fromkeys(given))

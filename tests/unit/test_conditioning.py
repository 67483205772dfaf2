"""conditioning.py: the prompts of the training step, each row's prompt, the states a batch is conditioned on."""

import dataclasses

import pytest
import torch

from dreambooth.models import networks
from dreambooth.training import conditioning

CPU = torch.device("cpu")


@pytest.fixture()
def models(tiny_model):
    return networks.load_models(tiny_model, CPU, CPU, train_text_encoder=True)


def test_each_prompt_goes_through_the_text_encoder_once(models, step_prompts):
    te = models.text_encoder
    rows = []
    hook = te.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    first = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        live, no_pooled = conditioning.batch_states(models, step_prompts, first, 3)
        hook.remove()
        states = conditioning.StepPrompts(te(step_prompts.instance)[0], te(step_prompts.class_prompt)[0])
        cached = conditioning.batch_states(models, states, first, 3)[0]
        alone = conditioning.batch_states(models, states, first, 0)[0]
    assert no_pooled is None  # one text encoder: SD 1.x's UNet takes no pooled embedding
    assert rows == [2]  # two prompts, not 2 + 3 copies
    assert live.shape == (5, 77, 32)
    torch.testing.assert_close(cached, live)
    torch.testing.assert_close(alone, live[:2])
    assert not torch.allclose(live[0], live[4])  # instance and class prompts differ


def test_captions_give_each_instance_row_its_own_prompt(models, step_prompts):
    te = models.text_encoder
    captions = torch.cat([step_prompts.instance, step_prompts.class_prompt.flip(1)])  # two instance prompts
    prompts = conditioning.StepPrompts(captions, step_prompts.class_prompt,
                                       image_prompt=torch.tensor([1, 0, 1]))  # three images: the 2nd has --instance_prompt
    batch = {"instance_image": torch.tensor([2, 1, 0, 1])}
    index = conditioning.row_prompts(prompts, batch, 4)
    assert index.tolist() == [1, 0, 1, 0]
    with torch.no_grad():
        hidden = conditioning.batch_states(models, prompts, index, 1)[0]
        expected = te(torch.cat([captions[[1, 0, 1, 0]], step_prompts.class_prompt]))[0]
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    assert conditioning.row_prompts(conditioning.StepPrompts(captions), {}, 3).tolist() == [0, 0, 0]


def test_caption_dropout_trains_a_seeded_share_of_instance_rows_on_the_empty_prompt():
    prompts = conditioning.StepPrompts(torch.zeros(3, 8, dtype=torch.long), image_prompt=torch.tensor([0, 1]),
                                       caption_dropout=(0.3, 2))  # prompts 0 and 1 (captions), 2 the empty one
    batch = {"instance_image": torch.tensor([0, 1] * 2000)}
    torch.manual_seed(7)
    index = conditioning.row_prompts(prompts, batch, 4000)
    dropped = index == 2
    assert 0.27 < dropped.float().mean().item() < 0.33
    kept = ~dropped
    assert torch.equal(index[kept], batch["instance_image"][kept])  # the others keep their caption
    torch.manual_seed(7)
    assert torch.equal(conditioning.row_prompts(prompts, batch, 4000), index)  # the same seed, the same rows
    for rate, share in ((0.0, 0.0), (1.0, 1.0)):
        torch.manual_seed(7)
        out = conditioning.row_prompts(dataclasses.replace(prompts, caption_dropout=(rate, 2)), batch, 4000)
        assert (out == 2).float().mean().item() == share

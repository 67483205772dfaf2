"""A serve.py replica's drawing, without Ray: one base pipeline loaded once and kept; each subject's adapters
(LoRA, DoRA, LoHa, LoKr) attached as a private copy of its files, and fused into the base's weights while that
subject's batch is drawn, exactly as generate.py fuses them (the same image for the same subject, prompt and seed);
before another subject's, the weights they changed are put back from a copy taken before the first fusing. The base is
never loaded again. A full fine-tune is a base of its own (no adapters)."""

import dataclasses
import math
import os
import shutil
import sys
import time
import traceback
import weakref

from dreambooth import errors
from dreambooth import families
from dreambooth import files
from dreambooth.generation import drawing
from dreambooth.models import adapters
from dreambooth.models import outputs
from dreambooth.serving import catalog
from dreambooth.serving.requests import RequestError


@dataclasses.dataclass(eq=False)
class Adapter:
    """A subject as a replica holds it: its routing id, and the private copy of its adapter files (None: a full
    model, the base itself). The copy goes when the adapter is evicted and no batch holds it any more."""

    routing_id: str
    folder: str | None
    kind: str  # "lora", "dora", "loha", "lokr" or "full"
    evicted: list | None = None  # where its routing id goes once it is evicted (Ray Serve calls __del__ then)
    loaded_for: object = None  # the request whose wait loaded it (serve.py's count of loads)

    def __post_init__(self):
        if self.folder:
            weakref.finalize(self, shutil.rmtree, self.folder, True)

    def __del__(self):
        if self.evicted is not None:
            self.evicted.append(self.routing_id)
            self.evicted = None


class SharedBase:
    """The base model's pipeline on device, with at most one subject's adapters fused into it (fused: its routing
    id); kept: {id(layer): (layer, its weight, its bias)} as the base has them, taken before a first fusing changes
    them, on the CPU."""

    def __init__(self, model_dir, device, safety_checker=True):
        self.model_dir, self.family = model_dir, families.family_of(model_dir)
        self.pipe = drawing.load_pipeline(model_dir, device, safety_checker=safety_checker, family=self.family)
        self.kept, self.changed, self.fused = {}, set(), None
        self.native = self.family.native_resolution(model_dir)
        # (the pipelines ask for multiples of 8 at least, whatever the VAE: a tiny model's downscales less)
        self.multiple = math.lcm(self.family.size_multiple(model_dir), 8)

    # --- a subject's adapters
    def attach(self, subject, into):
        """subject's adapters (catalog.Subject) copied into the folder into and checked against this base: an Adapter,
        or RequestError 422 naming the file that cannot be served, 409 when the subject was saved again meanwhile."""
        if subject.adapter is None:
            if os.path.abspath(subject.folder) != os.path.abspath(self.model_dir):
                raise RequestError(409, f"{subject.name}: its model is not this deployment's; ask again")
            return Adapter(subject.routing_id, None, "full")
        weights = os.path.join(subject.folder, files.LORA_WEIGHTS_FILE)
        for attempt in range(2):  # (a folder being replaced by a new save is missing for an instant)
            try:
                record = catalog.private_copy(subject, into)
                break
            except (OSError, ValueError, KeyError) as err:
                shutil.rmtree(into, ignore_errors=True)
                if attempt:
                    raise RequestError(422, f"{subject.name}: its adapters cannot be read ({weights}: "
                                            f"{errors.shorten(errors.one_line(err))})") from None
                time.sleep(0.2)
        if record.model_id != subject.model_id:  # (retrained between the lookup and the copy)
            shutil.rmtree(into, ignore_errors=True)
            raise RequestError(409, f"{subject.name} was saved again while it was loaded; ask again")
        try:
            files.check_model_files(into, "train or copy the adapters again")
            theirs = outputs.lora_width(into)
        except errors.UserError as err:
            shutil.rmtree(into, ignore_errors=True)
            raise RequestError(422, f"{subject.name}: {str(err).replace(into, os.path.dirname(weights))}") from None
        ours = families.part_config(self.model_dir, self.family.denoiser).get("cross_attention_dim")
        if theirs is not None and isinstance(ours, int) and theirs != ours:
            shutil.rmtree(into, ignore_errors=True)
            raise RequestError(422, f"{subject.name}: {weights} holds adapters of a model whose text states are "
                                    f"{theirs} wide, not its base model's ({self.family.label}, {ours} wide: "
                                    f"{self.model_dir}): train or copy the adapters again")
        return Adapter(subject.routing_id, into, subject.adapter)

    def use(self, adapter):
        """The pipeline with adapter's weights fused in (and no other subject's); RequestError 422 where they do not
        fit the base (the base's own weights back)."""
        if adapter.routing_id == self.fused:
            return
        self.restore()
        if adapter.folder:
            try:
                adapters.fuse(self.pipe, adapter.folder, 1.0, before_merge=self.keep)
            except Exception as err:
                self.restore()
                name = catalog.split_routing_id(adapter.routing_id)[0]
                raise RequestError(422, f"{name}: its adapters do not fit the base model {self.model_dir} "
                                        f"({errors.shorten(errors.one_line(err))})") from None
        self.fused = adapter.routing_id

    def keep(self, layer):
        """An adapter layer about to be merged: its base layer's weights kept (once), and marked as changed."""
        base = layer.get_base_layer()
        if id(base) not in self.kept:
            self.kept[id(base)] = (base, *(None if tensor is None else tensor.detach().to("cpu", copy=True)
                                           for tensor in (base.weight, getattr(base, "bias", None))))
        self.changed.add(id(base))

    def restore(self):
        """The base's own weights back where a fused subject changed them."""
        import torch

        with torch.no_grad():
            for key in self.changed:
                base, weight, bias = self.kept[key]
                base.weight.copy_(weight)
                if bias is not None:
                    base.bias.copy_(bias)
        self.changed, self.fused = set(), None

    # --- drawing
    def check(self, request):
        """RequestError 400 for a request this model cannot draw (its size, its prompt's length)."""
        from dreambooth.serving import requests

        requests.check_size(*self.size(request), self.multiple, self.native)
        requests.check_prompt_tokens(self.pipe, request.prompt)
        if request.negative_prompt and not self.family.negative_prompt:
            raise RequestError(400, f"{self.family.label} draws without a negative prompt: leave out negative_prompt")

    def size(self, request):
        """(width, height) of a request's images: the model's native size where it gives none."""
        return request.width or self.native, request.height or self.native

    def settings(self, request):
        """The drawing.ImageSettings of a request, with the model's defaults as generate.py takes them."""
        asked = drawing.ImageSettings(request.steps, request.guidance_scale, request.negative_prompt,
                                      self.size(request)[0], request.seed)
        return drawing.settings_for(asked, self.family, self.model_dir)

    def draw(self, items):
        """[(Adapter, requests.ImageRequest)] drawn: [((png bytes, ...), (flagged, ...), images drawn in that call of
        the pipeline)] for each, in order, or the RequestError of a subject whose adapters do not fit (the others
        drawn). Requests for the same subject with the
        same settings are drawn in one call of the pipeline."""
        groups = {}
        for index, (adapter, request) in enumerate(items):
            key = (adapter.routing_id, request.steps, request.guidance_scale, request.width, request.height,
                   request.negative_prompt)
            groups.setdefault(key, []).append(index)
        answers = [None] * len(items)
        for indices in groups.values():
            adapter, first = items[indices[0]]
            try:
                self.use(adapter)
            except RequestError as err:
                for index in indices:
                    answers[index] = err
                continue
            prompts, seeds, owners = [], [], []
            for index in indices:
                request = items[index][1]
                prompts += [request.prompt] * request.n
                seeds += [drawing.image_seed(request.seed, request.prompt, i) for i in range(request.n)]
                owners += [index] * request.n
            settings, size = self.settings(first), self.size(first)
            try:
                images, flagged = drawing.generate_batch(self.pipe, prompts, seeds, settings,
                                                         self.family.pipeline_kwargs(), self.family.guidance_argument,
                                                         size=size)
            except Exception as err:  # (only these requests fail: one line for the caller, the traceback here)
                traceback.print_exc(file=sys.stderr)
                refusal = RequestError(400 if isinstance(err, ValueError) else 500,
                                       f"the model could not draw this request: {errors.shorten(errors.one_line(err))}")
                for index in indices:
                    answers[index] = refusal
                continue
            for index in indices:
                mine = [i for i, owner in enumerate(owners) if owner == index]
                answers[index] = ([b"" if flagged[i] else files.png_bytes(images[i]) for i in mine],
                                  [bool(flagged[i]) for i in mine], len(prompts))
        return answers

"""serve.py's HTTP API without Ray: a request's body read and checked, the error a request gets (one line and a
status), and what the answer holds."""

import base64
import dataclasses
import json

MAX_PROMPT_CHARS = 2000  # a prompt longer than this is refused before its tokens are counted
MAX_STEPS = 500
MAX_GUIDANCE = 100.0


def _no_constant(name):
    raise ValueError(f"{name} is not a number JSON has")


class RequestError(Exception):
    """A request refused: its HTTP status and one line saying why."""

    def __init__(self, status, message, retry_after=None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after

    def __reduce__(self):  # (raised in a replica, caught in the ingress: the status travels with it)
        return RequestError, (self.status, self.message, self.retry_after)


@dataclasses.dataclass(frozen=True)
class ImageRequest:
    """POST /v1/images' body: image i is drawn from drawing.image_seed(seed, prompt, i), as generate.py's image i of
    the prompt with --seed seed; width, height and guidance None: the model's own."""

    subject: str
    prompt: str
    seed: int = 0
    steps: int = 50  # generate.py's --num_inference_steps default
    guidance_scale: float | None = None
    width: int | None = None
    height: int | None = None
    n: int = 1
    negative_prompt: str | None = None
    response_format: str = "b64_json"  # or "png": the image itself (n = 1)


FIELDS = {field.name: field for field in dataclasses.fields(ImageRequest)}
KINDS = {"subject": str, "prompt": str, "seed": int, "steps": int, "guidance_scale": (int, float), "width": int,
         "height": int, "n": int, "negative_prompt": str, "response_format": str}
KIND_WORDS = {str: "a string", int: "an integer", (int, float): "a number"}


def parse_image_request(body, max_images, accept=""):
    """The ImageRequest of a JSON body (bytes), or RequestError(400) naming the first thing wrong. accept: the
    request's Accept header ("image/png" asks for the image itself)."""
    try:
        data = json.loads(body or b"{}", parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object: {\"subject\": ..., \"prompt\": ...}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field(s) {', '.join(unknown)}; the fields are {', '.join(FIELDS)}")
    for name in ("subject", "prompt"):
        if not isinstance(data.get(name), str) or not data[name].strip():
            raise RequestError(400, f"'{name}' is required: a non-empty string")
    for name, value in data.items():
        kind = KINDS[name]
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise RequestError(400, f"'{name}' must be {KIND_WORDS[kind]}, not {json.dumps(value)}")
    if "png" in (accept or "") and "response_format" not in data:
        data["response_format"] = "png"
    request = ImageRequest(**{name: value for name, value in data.items() if value is not None})
    if len(request.prompt) > MAX_PROMPT_CHARS:
        raise RequestError(400, f"the prompt is {len(request.prompt)} characters; at most {MAX_PROMPT_CHARS}")
    if not 1 <= request.n <= max_images:
        raise RequestError(400, f"n={request.n}: from 1 to {max_images} images a request (serve.py "
                                "--max_images_per_request)")
    if not 1 <= request.steps <= MAX_STEPS:
        raise RequestError(400, f"steps={request.steps}: from 1 to {MAX_STEPS}")
    if not 0 <= request.seed < 2 ** 63:
        raise RequestError(400, f"seed={request.seed}: from 0 to 2**63 - 1")
    if request.guidance_scale is not None and not 0 <= request.guidance_scale <= MAX_GUIDANCE:
        raise RequestError(400, f"guidance_scale={request.guidance_scale}: from 0 to {MAX_GUIDANCE:g}")
    if request.response_format not in ("b64_json", "png"):
        raise RequestError(400, f"response_format {request.response_format!r}: 'b64_json' or 'png'")
    if request.response_format == "png" and request.n != 1:
        raise RequestError(400, f"one image/png answers one image: n={request.n} needs response_format 'b64_json'")
    return request


def check_size(width, height, multiple, native):
    """RequestError(400) for a size the model cannot draw: each side a multiple of its step, from the step (at least
    64) to twice its native size."""
    low, high = max(64, multiple), 2 * native
    for name, value in (("width", width), ("height", height)):
        if not low <= value <= high or value % multiple:
            raise RequestError(400, f"{name}={value}: this model draws sides that are multiples of {multiple} from "
                                    f"{low} to {high} (its native size is {native})")


def check_prompt_tokens(pipe, prompt):
    """RequestError(400) for a prompt longer than the model's first text encoder reads (the rest would be cut off
    without a word)."""
    tokenizer = getattr(pipe, "tokenizer", None)
    limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer is None or not isinstance(limit, int) or limit > 100_000:
        return
    count = len(tokenizer(prompt, truncation=False)["input_ids"])
    if count > limit:
        raise RequestError(400, f"the prompt is {count} tokens; this model reads at most {limit}")


def images_json(subject, pngs, flagged, served):
    """The JSON answer of a drawn request: each image as base64 PNG (a flagged one as null, with its flag), and how it
    was served."""
    return {"subject": subject,
            "data": [{"b64_json": None if bad else base64.b64encode(png).decode(), "flagged": bool(bad)}
                     for png, bad in zip(pngs, flagged)],
            **served}

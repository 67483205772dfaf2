"""A quantised frozen base under LoRA (--base_precision int8|nf4): every linear layer of the denoiser
becomes bitsandbytes' Linear8bitLt (int8 weights, LLM.int8()'s outlier threshold 6) or Linear4bit
(nf4 weights, the run's autocast dtype for compute), holding the layer's own weights; LoRA's fp32
adapters then train on top of them (peft wraps these layers).

Why bitsandbytes: it is already the suite's dependency (--use_8bit_adam), and its layers quantise and
run on CPU as on a GPU (0.50), so the tests run the very code path a GPU run takes: the layers are
built here, then moved to the worker's device, where bitsandbytes quantises them. (diffusers'
BitsAndBytesConfig loading refuses to run without a GPU; torchao is not installed here and was not
tried.)
"""


def quantized(model, precision, compute_dtype, device):
    """model with each torch.nn.Linear replaced by its bitsandbytes layer of precision ("int8", "nf4"),
    moved to device (which quantises the weights); frozen."""
    import bitsandbytes as bnb
    import torch

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            shape = dict(input_features=child.in_features, output_features=child.out_features,
                         bias=child.bias is not None, device="meta")
            if precision == "int8":
                layer = bnb.nn.Linear8bitLt(**shape, has_fp16_weights=False, threshold=6.0)
                layer.weight = bnb.nn.Int8Params(child.weight.data, requires_grad=False, has_fp16_weights=False)
            else:
                layer = bnb.nn.Linear4bit(**shape, compute_dtype=compute_dtype, quant_type="nf4")
                # bitsandbytes' CPU-only repacking for inference (AVX512-bf16) rewrites the weights in place
                # when a layer runs in eval mode and fails for small layers; off, a CPU draws as a GPU does
                layer.support_avx512bf16_for_cpu = False
                layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, name, layer)
    return model.to(device).requires_grad_(False)

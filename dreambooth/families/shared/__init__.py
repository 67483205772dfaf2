"""What several families share, and the interface every family implements (family.py): the bases a family builds
on (unet.py: the UNet families'; fluxblocks.py: Flux.1's transformer layout; flux2base.py: the FLUX.2 transformer
and VAE; qwenvae.py: Qwen-Image's VAE; qwentext.py: a Qwen text encoder), the random models' builders (builders.py),
the original single-file layouts (layouts.py), the training objectives (objectives.py), the steps of diffusers'
scripts the contracts share (scripts.py) and the known base models' record (known.py). Not a family: the table skips
this folder."""

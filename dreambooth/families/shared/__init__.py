"""What several families share, and the interface every family implements (family.py): the bases a family builds
on (unet.py: the UNet families'; fluxblocks.py: Flux.1's transformer layout; flux2base.py: the FLUX.2 transformer; qwenvae.py: Qwen-Image's VAE),
the random models' builders (builders.py), the original single-file layouts (layouts.py), the training objectives
(objectives.py) and the known base models' record (known.py). Not a family: the table skips this folder."""

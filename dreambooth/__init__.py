"""DreamBooth on Ray: the library behind the scripts at the repository root.

Flat inside, one module per concern; docs/ARCHITECTURE.md says where each behaviour lives.
Scripts import this package, never the other way.
"""

import gc as _gc

# Importing torch, transformers and diffusers makes about a million objects, and at Python's default thresholds
# (700, 10, 10) the cycle collector walks all of them about eight times during the imports alone: a second of CPU
# or more in every process that loads a model (each script, each Ray worker: Ray runs this package's worker hook
# first). A first generation of 10,000 leaves the imports without a full collection; cycles are still collected.
_first, *_older = _gc.get_threshold()
_gc.set_threshold(max(_first, 10_000), *_older)

"""specdec: speculative decoding and speculative cascades in JAX.

Layers (docs/design.md), each importing only from those below it: `specdec.core` (1, the math),
`specdec.models` (2), `specdec.decoding` (3, the decode loops and `generate`), `specdec.data` and
`specdec.training` (4), `specdec.evaluation` (5, sweeps and plots); `specdec.cli` holds the commands.
The core modules are importable from the package itself: `from specdec import sampling, targets, verify`
(on first use, so that importing a part of specdec that needs no JAX does not load it).
"""

import importlib

CORE = ("checks", "rng", "sampling", "spectr", "targets", "theory", "tree", "verify")
__all__ = list(CORE)


def __getattr__(name: str):
  if name in CORE:
    module = importlib.import_module(f"specdec.core.{name}")
    globals()[name] = module
    return module
  raise AttributeError(f"module 'specdec' has no attribute {name!r}")

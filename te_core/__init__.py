"""te-core: a multi-vendor Transformer Engine for PyTorch.

`import te_core as te` gives the names Transformer Engine users know; vendor backends plug in
through the registry in te_core.backend.
"""
__version__ = "0.1.0"

from . import ops
from .backend import get_backend, is_fp8_available, list_backends, set_backend

__all__ = ["__version__", "ops", "get_backend", "set_backend", "list_backends", "is_fp8_available"]

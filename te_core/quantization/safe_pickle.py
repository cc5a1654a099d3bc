"""Reading pickled extra state without running code from it: one allow-list for te-core's own
form (extra_state) and Transformer Engine's (compat.te_checkpoint).

Unpickling can call anything the bytes name, so these unpicklers know only: tensors (their
storage read with torch.load(weights_only=True), rebuilt only as views inside that storage, with
no hooks and no autograd state), OrderedDict, and recipe classes (TE's, and te-core's, whose
names a framework's merge of TE's entries pickles through the stand-in), rebuilt as inert
records holding their constructor arguments and state as plain values. Anything else is refused.
"""
from __future__ import annotations

import collections
import io
import pickle
from typing import Dict, Tuple

import torch

RECIPE_MODULES = ("transformer_engine.common.recipe", "te_core.recipe")


class Record:
    """An inert stand-in for a recipe object: constructor arguments and state only."""

    te_name = ""
    member = None  # an enum member pickled by name: getattr(cls, member)

    def __new__(cls, *args):  # pickle's NEWOBJ calls __new__ only, REDUCE calls the class
        record = super().__new__(cls)
        record.args, record.fields = args, {}
        return record

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple):  # (dict, slots) from objects with __slots__
            state = {k: v for part in state if isinstance(part, dict) for k, v in part.items()}
        if isinstance(state, dict):
            self.fields.update(state)


def record_class(name: str):
    return type(name, (Record,), {"te_name": name})


def _reconstructor(cls, base, state):
    if not (isinstance(cls, type) and issubclass(cls, Record)):
        raise pickle.UnpicklingError(f"refusing to rebuild {cls!r}")
    record = cls()
    record.__setstate__(state)
    return record


def _member(cls, name):
    """getattr(cls, name) of a recipe class: how some Python versions (3.11's first releases)
    pickle an enum member, by name. Only a member name of one of the recipe classes."""
    if not (isinstance(cls, type) and issubclass(cls, Record)) or not isinstance(name, str) \
            or not name.isidentifier():
        raise pickle.UnpicklingError(f"refusing getattr({cls!r}, {name!r}): only members of TE's recipe classes")
    record = cls()
    record.member = name
    return record


def _storage_from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """torch's rebuild of a pickled tensor (_rebuild_tensor_v2), allow-listed: only a view that
    lies inside its storage, with no autograd state. torch's own would grow the storage to any
    size the bytes name (memory a checkpoint chooses, its new part uninitialized) and attach the
    bytes' backward hooks."""
    dims = (size, stride) if isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list)) else ((), (None,))
    if not (isinstance(storage, torch.TypedStorage) and isinstance(storage_offset, int) and storage_offset >= 0
            and len(dims[0]) == len(dims[1]) and all(isinstance(n, int) and n >= 0 for d in dims for n in d)):
        raise pickle.UnpicklingError("a pickled tensor's storage, offset, size or stride is malformed")
    if backward_hooks:
        raise pickle.UnpicklingError("a pickled tensor with backward hooks is not a checkpoint's tensor")
    extent = storage_offset + (1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0)
    elements = storage._untyped_storage.nbytes() // storage.dtype.itemsize  # (not .size(): a deprecation warning)
    if extent > elements:
        raise pickle.UnpicklingError(f"a pickled tensor of size {tuple(size)}, stride {tuple(stride)} at offset "
                                     f"{storage_offset} reaches past its storage of {elements} elements")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, tuple(size), tuple(stride), False,
                                           collections.OrderedDict())


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("builtins", "getattr"): _member,
}


class AllowListUnpickler(pickle.Unpickler):
    """The allow-listed unpickler; `what` names the form in its errors, `renamed` maps other
    (module, class) names to the recipe class they stand for (a framework's subclass of one)."""

    what = "extra state"
    renamed: Dict[Tuple[str, str], str] = {}

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module in RECIPE_MODULES and name.isidentifier():
            return record_class(name)
        if (module, name) in self.renamed:
            return record_class(self.renamed[module, name])
        raise pickle.UnpicklingError(f"{module}.{name} is not on the allow-list of {self.what}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"persistent references are not part of {self.what}")

"""How a quantized tensor pickles, so that torch.load(weights_only=True), torch's default, loads it.

torch's own pickling of a tensor subclass names the class and restores its __dict__, which holds
the quantizer: a recipe, scaling state and callables, none of which weights_only may rebuild. Here
a tensor travels as the name of its kind, its nominal shape, dtype and layout, its quantized data
(plain tensors; FP8 bytes as uint8, which plain pickle can rebuild), its own plain attributes (a
parameter's), and its quantizer pickled apart, as bytes.

One stream, two loads. A trusted load (pickle, torch.load(weights_only=False)) imports `rebuild`,
which unpickles the quantizer too. torch.load(weights_only=True) calls what is registered below
under the same names: the same checked rebuild, which never unpickles the quantizer's bytes (they
may name any code), so the tensor loads with its data, scales and value and no quantizer, as
Transformer Engine's Float8Tensor pickles. A module pickled whole gives its tensors back the
quantizers themselves, shared with its scaling state (`quantizer_links`, QuantizedModule).
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_QUAD = ("_data", "_scale_inv", "_data_t", "_scale_inv_t")
# kind -> (the attributes holding its quantized data, its own settings): what a tensor is rebuilt from
_SPECS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "Float8Tensor": (("_data", "_scale_inv", "_transpose"), ()),
    "Float8BlockwiseTensor": (_QUAD, ("_block_2d",)),
    "MXFP8Tensor": (_QUAD, ()),
    "IdentityTensor": (("_hp_data",), ()),
    "HybridQuantizedTensor": (("_rowwise", "_columnwise"), ()),
}
_NOT_ATTRIBUTES = ("_quantizer", "_view_of")  # (a view's link to its parent: it travels as the data it holds)


def _kinds() -> Dict[str, type]:
    from .block_tensor import Float8BlockwiseTensor, MXFP8Tensor
    from .float8_tensor import Float8Tensor
    from .hybrid import HybridQuantizedTensor
    from .identity import IdentityTensor

    return {cls.__name__: cls for cls in (Float8Tensor, Float8BlockwiseTensor, MXFP8Tensor, IdentityTensor,
                                          HybridQuantizedTensor)}


def reduce(t: Tensor, protocol: int) -> Optional[tuple]:
    """QuantizedTensor.__reduce_ex__ of one of te-core's kinds; None for any other class (torch's
    pickling then, as before)."""
    kind = type(t).__name__
    if kind not in _SPECS or _kinds()[kind] is not type(t):
        return None
    names, settings = _SPECS[kind]
    payload = {name: getattr(t, name) for name in names}
    fp8 = {name: v.dtype for name, v in payload.items() if type(v) is Tensor and v.dtype in _FP8}
    payload.update({name: payload[name].view(torch.uint8) for name in fp8})
    attributes = {k: v for k, v in t.__dict__.items() if k not in names + settings + _NOT_ATTRIBUTES}
    quantizer = None
    if t._quantizer is not None:
        buffer = io.BytesIO()
        torch.save(t._quantizer, buffer)  # (its tensors then load where the tensor's data does: _quantizer_from)
        quantizer = buffer.getvalue()
    # (the attributes go with the arguments: torch's weights_only unpickler has no POP, which a state
    # setter needs, and a BUILD it allows only into classes it may also construct from anything)
    return rebuild, (kind, tuple(t.shape), t.dtype, t._view_strides(), t.requires_grad, payload, fp8,
                     {name: getattr(t, name) for name in settings}, attributes, quantizer)


def rebuild(kind, shape, dtype, strides, requires_grad, payload, fp8, settings, attributes, quantizer):
    """A trusted load's rebuild: the tensor, with its quantizer unpickled."""
    t = rebuild_checked(kind, shape, dtype, strides, requires_grad, payload, fp8, settings, attributes, None)
    if quantizer is not None:
        t._quantizer = _quantizer_from(quantizer, t.device)
    return t


def _quantizer_from(data: bytes, device: torch.device):
    # the quantizer's tensors (scaling state) go where the load put the tensor's data (a map_location)
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


def _refuse(what: str) -> None:
    raise pickle.UnpicklingError(f"a pickled te-core quantized tensor is malformed: {what}")


def _ints(value, what: str) -> tuple:
    if not isinstance(value, (tuple, list)) or not all(type(n) is int and n >= 0 for n in value):
        _refuse(f"its {what} {value!r} is not a sequence of non-negative ints")
    return tuple(value)


def rebuild_checked(kind, shape, dtype, strides, requires_grad, payload, fp8, settings, attributes, quantizer):
    """What torch.load(weights_only=True) calls for `rebuild`: every argument checked, the
    quantizer's bytes never read (the tensor loads without one)."""
    kinds = _kinds()
    if kind not in kinds:
        _refuse(f"{kind!r} is not one of te-core's quantized tensor kinds ({', '.join(kinds)})")
    names, setting_names = _SPECS[kind]
    shape = _ints(shape, "shape")
    if strides is not None and len(_ints(strides, "strides")) != len(shape):
        _refuse(f"strides {strides!r} do not match shape {shape}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        _refuse(f"its nominal dtype {dtype!r} is not a floating-point torch.dtype")
    if type(requires_grad) is not bool or quantizer is not None and not isinstance(quantizer, bytes):
        _refuse("requires_grad is not a bool, or the quantizer is not bytes")
    if not isinstance(payload, dict) or set(payload) != set(names):
        _refuse(f"a {kind} holds {names}, the pickle {sorted(payload) if isinstance(payload, dict) else payload!r}")
    parts = _kinds_of_parts(kind, kinds)
    if any(v is not None and not (type(v) is Tensor or isinstance(v, parts)) for v in payload.values()):
        _refuse(f"a {kind}'s data must be tensors or None")
    held = [v for v in payload.values() if v is not None]
    if not held or len({v.device for v in held}) != 1:
        _refuse(f"a {kind} needs its data, on one device")
    if not isinstance(fp8, dict) or any(name not in payload or d not in _FP8 or payload[name] is None
                                        or payload[name].dtype != torch.uint8 for name, d in fp8.items()):
        _refuse("its FP8 bytes are not uint8 data of an FP8 dtype")
    if not isinstance(settings, dict) or set(settings) != set(setting_names) or \
            any(type(v) is not bool for v in settings.values()):
        _refuse(f"a {kind}'s settings are {setting_names} (bools), the pickle's {settings!r}")
    payload = {name: v.view(fp8[name]) if name in fp8 else v for name, v in payload.items()}
    if kind == "Float8Tensor":
        _check_float8(payload, shape)
    cls = kinds[kind]
    t = cls.__new__(cls, torch.Size(shape), dtype, held[0].device, None, *(() if strides is None else (strides,)))
    for name, value in (*payload.items(), *settings.items()):
        setattr(t, name, value)
    _set_attributes(t, attributes, names + setting_names)
    return t.requires_grad_() if requires_grad else t


def _kinds_of_parts(kind: str, kinds: Dict[str, type]) -> tuple:
    # a hybrid tensor's directions are tensors of the other kinds (or plain ones)
    return tuple(cls for name, cls in kinds.items() if name != "HybridQuantizedTensor") \
        if kind == "HybridQuantizedTensor" else ()


def _check_float8(payload: dict, shape: tuple) -> None:
    data, scale_inv, transpose = payload["_data"], payload["_scale_inv"], payload["_transpose"]
    if not (isinstance(scale_inv, Tensor) and scale_inv.dtype == torch.float32 and scale_inv.numel() == 1):
        _refuse("a Float8Tensor's scale_inv must be one float32 element")
    if data is not None and data.numel() != torch.Size(shape).numel():
        _refuse(f"a Float8Tensor of shape {shape} holds data of shape {tuple(data.shape)}")
    if transpose is not None and (transpose.dim() != 2 or transpose.dtype not in _FP8):
        _refuse("a Float8Tensor's transpose must be 2-D FP8 data")


def _set_attributes(t: Tensor, attributes: Dict[str, Any], held: Tuple[str, ...]) -> None:
    """A rebuilt tensor's own attributes (a parameter's: _is_param, tensor-parallel flags, a
    preserved initial value): plain names that neither replace its data, quantizer or settings
    (`held`) nor shadow what its class defines."""
    if not isinstance(attributes, dict):
        _refuse(f"its attributes are {type(attributes).__name__}, not a dict")
    for name, value in attributes.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("__") or \
                name in held + _NOT_ATTRIBUTES or hasattr(type(t), name):
            _refuse(f"attribute {name!r} is not one a pickled tensor may set")
        t.__dict__[name] = value


def quantizer_links(tensors) -> List[tuple]:
    """(tensor, its quantizer) for `tensors` and the quantized tensors they hold (a hybrid's
    directions): what a module pickled whole gives back to its tensors (`relink`), so they share
    its quantizers again rather than each holding a copy of its own."""
    links, todo = [], [t for t in tensors if isinstance(t, Tensor) and hasattr(t, "_quantizer")]
    while todo:
        t = todo.pop()
        links.append((t, t._quantizer))
        todo.extend(v for v in vars(t).values() if isinstance(v, Tensor) and hasattr(v, "_quantizer"))
    return links


def relink(links: List[tuple]) -> None:
    for t, quantizer in links:
        t._quantizer = quantizer


# What torch.load(weights_only=True) may call, under the names a pickle gives them. Registered when
# te-core is imported: a load must not need the user to allow-list te-core's own functions.
try:
    torch.serialization.add_safe_globals([(rebuild_checked, f"{__name__}.rebuild")])
except TypeError:  # a torch whose allow-list takes no (function, name) pairs: such loads keep refusing loudly
    pass

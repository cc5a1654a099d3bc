"""QuantizedTensor: a torch.Tensor holding quantized data, that behaves as its high-precision value.

It is a wrapper subclass (no storage of its own): shape and dtype are the nominal, high-precision
ones. GEMM helpers read its row-wise / column-wise operands directly; every other torch op sees
the dequantized value, and in-place ops (copy_, add_, an optimizer's update) requantize into the
tensor with the quantizer it was made by, so an FP8 parameter stays FP8.
"""
from __future__ import annotations

import copy
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from . import high_precision_init, tensor_pickle
from .lent_scales import is_lent
from .write_back import ViewLink, requantize_all

aten = torch.ops.aten
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_PAYLOAD = "_fp8_payload_dtypes"  # the pickled state's record of the payload's FP8 dtypes

# Operand kinds: how a GEMM operand's scale_inv is laid out.
TENSOR = "tensor"  # one float32 scale_inv
BLOCK_1x128 = "1x128"  # (rows, ceil(cols/128)) float32
BLOCK_128x128 = "128x128"  # (ceil(rows/128), ceil(cols/128)) float32
MX_1x32 = "mx1x32"  # (rows, cols/32) uint8 E8M0


class GemmOperand(NamedTuple):
    """One 2-D FP8 operand of ops.gemm_fp8: data (rows, K), its scale_inv, and their layout kind."""

    data: Tensor
    scale_inv: Tensor
    kind: str


_TENSOR_DATA = torch._C.TensorBase.data  # torch's own `data` descriptor (QuantizedTensor's wraps it)


class QuantizedTensor(Tensor):
    """Base of Float8Tensor, Float8BlockwiseTensor and MXFP8Tensor.

    A view of one (a slice, a select, a split) that writes into its data carries a ViewLink
    (`_view_of`): an in-place op on the view requantizes the tensor it views, whole, with the
    view's part replaced, as an in-place op on that tensor would. Requantizing the view alone
    would give it a scale of its own, which the bytes around it (sharing one per-tensor scale,
    or a column-wise copy) do not follow.
    """

    _quantizer: Any
    _view_of: Optional[ViewLink] = None  # set on a view that writes into the tensor it views
    # The QuantizedOperand class `make` builds instead while torch.compile traces (set per format).
    _traced_twin: Optional[type] = None
    # aten op -> handler that keeps the quantized form (returns NotImplemented where it does not
    # apply): a format's views (see float8_views), and the ops that refuse a format (below).
    _view_ops: dict = {}

    @staticmethod
    def __new__(cls, shape, nominal_dtype: torch.dtype, device: torch.device, quantizer=None, strides=None):
        # `strides`: a view's, which the wrapper reports as torch's view would (torch's reshape,
        # flatten and contiguous choose between a view and a copy by them); None is contiguous
        self = Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=nominal_dtype, device=device,
                                             requires_grad=False)
        self._quantizer = quantizer
        return self

    # --- what subclasses provide
    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The high-precision value, in `dtype` (default: the nominal dtype). Differentiable, as
        Transformer Engine's: while grad mode is on, the result's gradient reaches this tensor
        (a quantize -> dequantize round trip passes gradients through, as TE code expects)."""
        if torch.is_grad_enabled() and self.requires_grad:
            return _Dequantize.apply(self, dtype)
        return self._dequantize(dtype)

    def _dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """dequantize() outside autograd: what each format computes."""
        raise NotImplementedError

    def rowwise(self) -> GemmOperand:
        raise NotImplementedError

    def columnwise(self) -> GemmOperand:
        """The operand of the transposed tensor (K, M), for dgrad/wgrad."""
        raise NotImplementedError

    @property
    def has_columnwise(self) -> bool:
        raise NotImplementedError

    def columnwise_only(self) -> "QuantizedTensor":
        """A twin holding only the column-wise copy: what a backward GEMM reads, so saving it
        for backward instead of this tensor keeps half the bytes."""
        raise NotImplementedError

    def _payload(self) -> dict:
        """The attributes holding the quantized data (shared by detach, replaced by requantize)."""
        raise NotImplementedError

    def _holds_lent_scale(self) -> bool:
        """Whether this tensor's scale is lent to other tensors too (lent_scales): a delayed-
        scaling cast's. Formats whose casts make scales of their own never hold one."""
        return False

    def _own_scales(self) -> None:
        """Before this tensor gets an alias that must see its writes: a copy of its own of a lent
        scale, which the alias then shares (lent_scales). At most once per tensor; no cast pays it."""

    # --- shared behaviour
    @property
    def quantizer(self):
        return self._quantizer

    def _get_quantizer(self):
        """Transformer Engine's accessor: a quantizer with TE's interface (make_empty,
        update_quantized, quantize) that casts as this tensor's own quantizer does (see
        te_quantizers.te_quantizer_of)."""
        from .te_quantizers import te_quantizer_of

        return te_quantizer_of(self)

    @property
    def get_high_precision_init_val(self):
        """Transformer Engine's method of an FP8 primary weight made under
        quantized_model_init(preserve_high_precision_init_val=True): its value from before
        quantization, on the CPU, or None once cleared. Other tensors have no such attribute."""
        return high_precision_init.method(self, "get_high_precision_init_val")

    @property
    def clear_high_precision_init_val(self):
        """Frees what get_high_precision_init_val returns (see there)."""
        return high_precision_init.method(self, "clear_high_precision_init_val")

    def _same_kind(self) -> "QuantizedTensor":
        cls = type(self)
        compiling = torch.compiler.is_compiling()
        if cls._traced_twin is not None and compiling:
            cls = cls._traced_twin  # a primary FP8 weight inside a compiled graph: no subclass made there
        # the same payload, the same layout (a view's strides; dynamo cannot trace a subclass's
        # is_contiguous, and no view is made while it traces)
        strides = None if compiling or not isinstance(self, Tensor) else self._view_strides()
        twin = cls.__new__(cls, self.shape, self.dtype, self.device, self._quantizer,
                           *(() if strides is None else (strides,)))
        for name, value in self._payload().items():
            setattr(twin, name, value)
        link = getattr(self, "_view_of", None)  # (getattr: the traced operands share this code)
        if link is not None:  # a detached view (param.data of one) still writes the tensor it views
            twin._view_of = link
        return twin

    def _view_link(self) -> Optional[ViewLink]:
        """The link this view writes through, while its bytes are still in its parent's data
        (after `parent.data = x` they are not: the view then stands alone, as a plain view of
        the parent's former storage would)."""
        link = getattr(self, "_view_of", None)
        data = self.__dict__.get("_data")
        if link is None or data is None:
            return link
        ptr = data.untyped_storage().data_ptr()
        held = (v for v in link.parent._payload().values() if isinstance(v, Tensor))
        return link if any(v.untyped_storage().data_ptr() == ptr for v in held) else None

    def _writable_value(self, value: Optional[Tensor] = None) -> Tensor:
        """A new high-precision buffer holding `value` (by default this tensor's value), laid out
        as the puts of views of this tensor (ViewLink) address it."""
        if value is None:
            return self._dequantize().contiguous()
        return value.clone(memory_format=torch.contiguous_format)

    def _view_strides(self) -> Optional[tuple]:
        """The strides the wrapper reports where they are a view's (not contiguous), which a tensor
        sharing its payload reports too; None where contiguous."""
        return None if self.is_contiguous() else self.stride()

    def _payload_strides(self) -> Optional[tuple]:
        """The strides the wrapper reports for this tensor's payload (None: contiguous). A format
        whose views are views of its quantized bytes reports theirs (Float8Tensor)."""
        return None

    def _follow_write(self, parent: "QuantizedTensor") -> None:
        """After a write through this view requantized `parent`: make this view's own state
        (what it does not share with the parent) match the parent's new data."""

    def select_rows(self, source: Tensor, blank: Optional[Tensor] = None) -> "QuantizedTensor":
        """A 2-D tensor of this kind (row-wise data only) whose row i is row source[i] of this one,
        its quantized bytes and their scales unchanged: what a token permutation moves. Row i is a
        row of zeros where source[i] < 0 (its scales zero) or blank[i] (its source's scales kept)."""
        raise NotImplementedError(f"rows of a {type(self).__name__} cannot be selected in its quantized form; "
                                  "dequantize() it first")

    def drop_columnwise(self) -> bool:
        """Free the column-wise copy where the row-wise data alone can remake it exactly; a format
        whose column-wise copy has scales of its own (block, MXFP8) keeps it. True when dropped."""
        return False

    def requantize_(self, hp: Tensor) -> "QuantizedTensor":
        """Replace the value with `hp`, quantized by this tensor's quantizer."""
        requantize_all([(self, hp)])
        return self

    def quantize_(self, tensor: Tensor, *, noop_flag: Optional[Tensor] = None) -> "QuantizedTensor":
        """Transformer Engine's in-place cast: `tensor` quantized into this tensor, as copy_ from
        it does. `noop_flag`, a 1-element float32 tensor (an optimizer's overflow flag), skips
        the cast when it holds 1, as TE's cast kernels do."""
        if noop_flag is not None:
            if noop_flag.numel() != 1 or noop_flag.dtype != torch.float32:
                raise ValueError(f"{type(self).__name__}.quantize_: noop_flag must be a 1-element float32 tensor, "
                                 f"got {noop_flag.numel()} elements of {noop_flag.dtype}")
            # read on the host: te-core's casts are torch ops, which cannot skip on a device flag
            if noop_flag.item() == 1.0:
                return self
        with torch.no_grad():  # TE's quantize_ is no autograd op: a trainable weight takes it too
            self.copy_(tensor)
        return self

    # torch returns a tensor itself when asked for the dtype it has, which here would be the
    # quantized tensor: a "float copy" (master weights) would then stay quantized, write into this
    # tensor when updated in place, and have no numpy(). As Transformer Engine's, these dequantize.
    def float(self, memory_format=torch.preserve_format) -> Tensor:
        return _dequantized_copy(self, torch.float32, memory_format)

    def half(self, memory_format=torch.preserve_format) -> Tensor:
        return _dequantized_copy(self, torch.float16, memory_format)

    def bfloat16(self, memory_format=torch.preserve_format) -> Tensor:
        return _dequantized_copy(self, torch.bfloat16, memory_format)

    @property
    def data(self) -> Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        # torch's setter swaps the wrapper's metadata only: the quantized data, held in Python
        # attributes, would stay, so `param.data = x` (module.half(), a user's reload) would be
        # silently ignored. As Transformer Engine's: a tensor of this kind lends its data (both
        # then share it, as plain tensors do), anything else is quantized by this tensor's quantizer.
        if not isinstance(value, Tensor):
            raise TypeError(f"{type(self).__name__}.data must be set to a tensor, got {type(value).__name__}")
        with torch.no_grad():
            source = value if type(value) is type(self) else self._quantized_like(value)
            if source is value:  # both then share its data, and its writes
                value._own_scales()
        # (value's shape: a block format's payload is 2-D under any nominal shape)
        if (value.shape, source.stride(), source.dtype, source.device) != \
                (self.shape, self.stride(), self.dtype, self.device):
            _TENSOR_DATA.__set__(self, type(self).__new__(type(self), value.shape, source.dtype, source.device,
                                                          strides=source.stride()))
        self._view_of = None
        self.__dict__.update(vars(source._same_kind()))

    def _quantized_like(self, value: Tensor) -> "QuantizedTensor":
        """`value` quantized by this tensor's quantizer, in the layouts this tensor holds."""
        if self._quantizer is None:
            raise RuntimeError(f"{type(self).__name__} has no quantizer, so it cannot take a new value; "
                               "assign a tensor of the same kind instead")
        hp = value._dequantize() if isinstance(value, QuantizedTensor) else value.detach()
        if not hp.is_floating_point():
            raise TypeError(f"{type(self).__name__}.data: a {hp.dtype} tensor cannot be quantized; "
                            "assign a floating-point tensor")
        columnwise = self.has_columnwise and hp.dim() >= 2
        # a new value, as a load is: a delayed scale (from other values) could saturate it, so
        # such a quantizer scales it by its own amax, as a checkpoint load does (load_primary)
        load = getattr(self._quantizer, "load_primary", None)
        fresh = None if load is None or hp.dim() == 0 else load(hp)
        if fresh is None:
            fresh = self._quantizer.quantize(hp, columnwise=columnwise)
        elif not columnwise:
            fresh.drop_columnwise()
        if "_data" in self._payload() and self._data is None:  # column-wise only (saved for a backward GEMM)
            fresh = fresh.columnwise_only()
        return fresh

    def _take_payload(self, fresh: "QuantizedTensor") -> None:
        # A tensor holding a lent scale has no alias reading its buffers (one would have taken it a
        # scale of its own: _own_scales), so it takes the new payload whole: a write into the lent
        # scale would change the value of every other tensor it is lent to.
        whole = self._holds_lent_scale()
        for name, value in fresh._payload().items():
            old = getattr(self, name)
            if not whole and _same_layout(old, value):
                old.copy_(value)  # in place: a captured graph keeps reading these buffers
            else:
                setattr(self, name, value)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, nominal_dtype={self.dtype}, "
                f"device={self.device}, value={self._dequantize()})")

    __torch_function__ = torch._C._disabled_torch_function_impl

    def with_nominal_dtype(self, dtype: torch.dtype) -> "QuantizedTensor":
        """A tensor of this kind holding the same quantized data and scales (shared, as a view's
        are) with nominal dtype `dtype`: its value is this one's, read in `dtype`."""
        self._own_scales()  # (the twin shares this tensor's writes)
        same = self._same_kind()
        twin = type(self).__new__(type(self), self.shape, dtype, self.device, self._quantizer, self._view_strides())
        for name, value in same.__dict__.items():  # the payload, and a format's own settings (_block_2d)
            twin.__dict__.setdefault(name, value)
        return twin

    def _with_payload(self, fn) -> "QuantizedTensor":
        """A twin whose quantized data tensors are fn(tensor): a clone, or a move to a device."""
        device = None
        twin = self._same_kind()
        twin._view_of = None  # new buffers: no longer a view
        for name, value in self._payload().items():
            if isinstance(value, Tensor):
                value = fn(value)
                device = device or value.device
            setattr(twin, name, value)
        strides = twin._payload_strides()  # (a clone of a view's bytes may be laid out anew)
        if (device is not None and device != self.device) or strides != self._view_strides():
            # the wrapper's own device and layout must follow
            moved = type(self).__new__(type(self), self.shape, self.dtype, device or self.device, self._quantizer,
                                       strides)
            for name, value in twin.__dict__.items():  # the payload, and a format's own settings (_block_2d)
                moved.__dict__.setdefault(name, value)
            twin = moved
        return twin

    def __getstate__(self) -> dict:
        # torch's pickling of a subclass outside tensor_pickle's kinds (and te-core's earlier pickles,
        # which __setstate__ still reads). Plain pickle (multiprocessing's, not torch.save) cannot
        # rebuild a float8 tensor's storage in torch: the FP8 payload travels as its bytes.
        state = dict(self.__dict__)
        state.pop("_view_of", None)  # (a closure): a view travels as the data it holds
        fp8 = {name: value.dtype for name, value in state.items()
               if type(value) is Tensor and value.dtype in _FP8_DTYPES}
        for name in fp8:
            state[name] = state[name].view(torch.uint8)
        if fp8:
            state[_FP8_PAYLOAD] = fp8
        return state

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple):  # (dict, slots): torch's layout where a class has slots
            state, slots = state
            for name, value in slots.items():
                setattr(self, name, value)
        state = dict(state)
        for name, dtype in state.pop(_FP8_PAYLOAD, {}).items():
            state[name] = state[name].view(dtype)
        for name, value in state.items():
            setattr(self, name, value)

    def __reduce_ex__(self, protocol):
        # through te-core's own rebuild, which torch.load(weights_only=True) may call (tensor_pickle)
        reduced = tensor_pickle.reduce(self, protocol)
        return super().__reduce_ex__(protocol) if reduced is None else reduced

    def __copy__(self):
        # a tensor sharing this one's data and quantizer, as torch's copy of a tensor shares its storage
        # (copy.copy cannot apply the state setter __reduce_ex__ gives)
        twin = type(self).__new__(type(self), self.shape, self.dtype, self.device, self._quantizer,
                                  self._view_strides())
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_view_of"})
        return twin.requires_grad_() if self.requires_grad else twin

    def __deepcopy__(self, memo):
        twin = self._with_payload(lambda t: t.clone())
        twin._quantizer = copy.deepcopy(self._quantizer, memo)
        # a copied model's FP8 primary weights must stay parameters that train (nn.Parameter's
        # own __deepcopy__ does not run for a parameter of this class)
        if getattr(self, "_is_param", False):
            twin = torch.nn.Parameter(twin, requires_grad=self.requires_grad)
        elif self.requires_grad:
            twin.requires_grad_()
        high_precision_init.carry_over(self, twin)  # (quantized_model_init's preserved value)
        memo[id(self)] = twin
        return twin

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view and torch.is_inference_mode_enabled() and not args[0].is_inference():
            # torch's view of a normal tensor stays a normal tensor in inference mode (autograd then
            # shares its version counter); a wrapper made here in that mode would be an inference
            # tensor, which torch refuses as the view (TE's inference loops detach() FP8 weights)
            with torch.inference_mode(False):
                return cls.__torch_dispatch__(func, types, args, kwargs)
        if func in (aten.detach.default, aten.alias.default):
            args[0]._own_scales()  # (a write into either is the other's)
            return args[0]._same_kind()
        handler = cls._view_ops.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func is aten.clone.default:
            return args[0]._with_payload(lambda t: t.clone())
        if func is aten._to_copy.default and kwargs.get("dtype") in (None, args[0].dtype):
            # a move (module.to(device)) keeps the quantized form; a dtype change dequantizes below.
            # torch dispatches it only for a copy (a move, or copy=True): never t's own buffers
            device = kwargs.get("device") or args[0].device
            non_blocking = kwargs.get("non_blocking", False)
            return args[0]._with_payload(lambda t: t.to(device, non_blocking=non_blocking, copy=True))
        if func is aten.empty_like.default and kwargs.get("dtype") in (None, args[0].dtype) \
                and kwargs.get("layout") in (None, torch.strided):
            # module.to_empty(device=...): a quantized tensor of the same kind, uninitialized
            device = kwargs.get("device") or args[0].device
            return args[0]._with_payload(lambda t: torch.empty_like(t, device=device))
        if func._schema.name.endswith("_") or func is aten.copy_.default:
            return _mutate(func, args, kwargs)
        if func._schema.is_mutable and any(isinstance(v, QuantizedTensor) for v in kwargs.values()):
            return _into_out(func, args, kwargs)
        if func.is_view:  # (one the format's handlers cannot hold quantized: a dequantized copy would
            # read right but drop a write through it, which a DequantizedView writes back)
            from .dequantized_view import dequantized_views

            return dequantized_views(func, args, kwargs)
        return func(*tree_map(_dequantized, args), **tree_map(_dequantized, kwargs))


class QuantizedOperand:
    """A quantized value as plain tensors plus scales, without the torch.Tensor subclass: what
    quantizers return while torch.compile traces, since dynamo cannot construct wrapper
    subclasses in a graph. It has the GEMM-facing methods of its QuantizedTensor twin (shared
    through a layout mixin); autograd Functions hold it on ctx rather than saving it."""

    _traced_twin = None

    def __new__(cls, shape, nominal_dtype: torch.dtype, device: torch.device, quantizer=None):
        self = object.__new__(cls)
        # (a torch.Size passes as it is: torch 2.7's dynamo cannot call torch.Size on symbolic sizes)
        shape = shape if isinstance(shape, torch.Size) else torch.Size(shape)
        self.shape, self.dtype, self.device, self._quantizer = shape, nominal_dtype, device, quantizer
        return self

    quantizer = QuantizedTensor.quantizer
    _same_kind = QuantizedTensor._same_kind

    def dim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        return self._dequantize(dtype)  # (held on ctx, outside autograd: nothing to differentiate)


QUANTIZED = (QuantizedTensor, QuantizedOperand)  # what GEMM helpers read as quantized operands


def _refuse_sharding(t, *args, **kwargs):
    """new_zeros is how FSDP2 (fully_shard) pads a parameter's shard: a format without views
    (MXFP8) would be dequantized there, silently, into a high-precision shard, so it is refused
    with the ways out."""
    raise NotImplementedError(
        f"new_zeros on a {type(t).__name__} (what FSDP2's fully_shard calls to shard a parameter): FSDP2 with "
        "FP8 all-gather supports quantized_model_init with DelayedScaling, Float8CurrentScaling or "
        "Float8BlockScaling only. Build "
        "the model without te.quantized_model_init (FSDP2 then all-gathers high-precision weights and the "
        "recipe quantizes them in each forward), or use one of those recipes for the primary weights")


QuantizedTensor._view_ops = {aten.new_zeros.default: _refuse_sharding}


def _same_layout(old, new) -> bool:
    """Whether quantized data `new` can be written into `old`'s buffer (eager only: a traced
    graph must not mutate payloads behind dynamo's back)."""
    return (isinstance(old, Tensor) and isinstance(new, Tensor) and old is not new and old.shape == new.shape
            and old.dtype == new.dtype and old.device == new.device and not torch.compiler.is_compiling())


def gather_rows(t: Tensor, source: Tensor, blank: Optional[Tensor] = None) -> Tensor:
    """Rows `source` of t, bit for bit, in t's dtype and layout kind (contiguous); a row of zeros
    where source < 0 or blank. FP8 rows move as their bytes (few ops take float8 dtypes)."""
    raw = t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t
    out = raw.index_select(0, source.clamp(min=0))
    empty = source < 0 if blank is None else (source < 0) | blank
    return out.masked_fill(empty.view(-1, *([1] * (out.dim() - 1))), 0).view(t.dtype)


def _dequantized(value):
    return value._dequantize() if isinstance(value, QuantizedTensor) else value


class _Dequantize(torch.autograd.Function):
    """dequantize() as an autograd node: the gradient reaches the quantized tensor unchanged."""

    @staticmethod
    def forward(ctx, t: QuantizedTensor, dtype: torch.dtype) -> Tensor:
        ctx.dtype = t.dtype
        return t._dequantize(dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.dtype), None


def _dequantized_copy(t: QuantizedTensor, dtype: torch.dtype, memory_format) -> Tensor:
    out = t.dequantize(dtype)
    return out if memory_format == torch.preserve_format else out.contiguous(memory_format=memory_format)


def _into_out(func, args, kwargs):
    """An op writing into quantized `out=` tensors (torch.mul(a, b, out=w)): computed into
    dequantized copies of them, which are then requantized into them, as an in-place op is; a
    write into a temporary copy alone would be lost."""
    written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    targets = {name: kwargs[name] for name in written if isinstance(kwargs.get(name), QuantizedTensor)}
    copies = {name: _dequantized(t) for name, t in targets.items()}
    others = {k: v for k, v in kwargs.items() if k not in targets}
    func(*tree_map(_dequantized, args), **tree_map(_dequantized, others), **copies)
    requantize_all([(targets[name], copies[name]) for name in targets])
    outs = [kwargs[name] for name in written]
    return outs[0] if len(outs) == 1 else tuple(outs)


# (torch decides which take an overlap; it has no foreach fill_, and its _foreach_zero_ takes one)
_FILLS = (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten._foreach_zero_.default)


def _mutate(func, args, kwargs):
    """In-place op on quantized tensor(s): run it on dequantized copies, then requantize them."""
    target = args[0]
    many = isinstance(target, (list, tuple))
    targets = list(target) if many else [target]
    copies = [_dequantized(t) for t in targets]
    hp_first = copies if many else copies[0]
    rest = tree_map(_dequantized, args[1:])
    rest_kwargs = tree_map(_dequantized, kwargs)
    func(hp_first, *rest, **rest_kwargs)
    # a fill may write through an overlapping view (an expand), as torch's does (write_back._put);
    # a foreach fill is the same fill on each region
    fill = (lambda region: func([region] if many else region, *rest, **rest_kwargs)) if func in _FILLS else None
    requantize_all([(t, hp) for t, hp in zip(targets, copies) if isinstance(t, QuantizedTensor)], fill)
    # in-place foreach ops (a foreach optimizer step) return nothing, and torch checks that
    return target if func._schema.returns else None

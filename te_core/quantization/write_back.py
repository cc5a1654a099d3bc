"""Writes into quantized tensors: how a new high-precision value becomes a quantized tensor's
value again (requantized by its quantizer), and how a write through a view reaches the tensor
whose data the view holds.

A view that writes back carries a ViewLink to that tensor; the write goes into the tensor's
high-precision value at the view's place, and the tensor is requantized whole. Views of one
tensor written in one call write into one value, requantized once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from torch import Tensor

if TYPE_CHECKING:
    from .tensor import QuantizedTensor


class ViewLink(NamedTuple):
    """What a quantized view writes into: `parent`, the tensor whose data it views, and
    `region(parent_value)`, the view's elements of `parent_value` (a buffer from
    parent._writable_value()), as torch's same view of it."""

    parent: "QuantizedTensor"
    region: Callable[[Tensor], Tensor]

    def put(self, parent_value: Tensor, value: Tensor) -> None:
        """Write the view's new high-precision `value` into its place in `parent_value`."""
        self.region(parent_value).copy_(value)


def requantize_all(pairs, fill: Optional[Callable[[Tensor], Any]] = None) -> None:
    """Replace the value of each (QuantizedTensor, hp) pair with hp quantized by the tensor's
    quantizer. A quantizer class with a `quantize_batch([(quantizer, hp, columnwise)])`
    staticmethod quantizes all of its tensors in one call: a foreach optimizer step updates
    every parameter in one op, and the FSDP2 shard quantizer then reduces every shard's amax in
    one collective instead of one per weight. `fill`: the fill op (fill_, zero_, _foreach_zero_) that made hp,
    for a view whose elements overlap (see _put)."""
    requantize_with([(t, hp, t._quantizer) for t, hp in pairs], fill)


def requantize_with(items, fill: Optional[Callable[[Tensor], Any]] = None) -> None:
    """requantize_all for (QuantizedTensor, hp, quantizer) triples. A view (ViewLink) is written
    into the value of the tensor it views, which is requantized whole by the view's quantizer;
    views of one tensor in one call write into one value, requantized once."""
    values: dict = {}  # id -> [tensor, its new value, the quantizer to cast it with]
    followers = []  # (view, parent) written through, each after its parent
    for t, hp, quantizer in items:
        if quantizer is None:
            raise RuntimeError(f"{type(t).__name__} has no quantizer, so it cannot be updated in place; "
                               "dequantize() it and work on the high-precision copy")
        hp = hp.detach().reshape(t.shape).to(t.dtype)
        chain = []
        link = t._view_link()
        while link is not None:
            values[id(t)] = [t, hp, None]  # what a view of this view, later in `items`, writes into
            parent = link.parent
            pending = values.get(id(parent))
            value = parent._writable_value(None if pending is None else pending[1])
            _put(link, value, hp, fill)
            chain.append((t, parent))
            t, hp, link = parent, value, parent._view_link()
        values[id(t)] = [t, hp, quantizer]
        followers.extend(reversed(chain))
    by_kind: dict = {}
    for t, hp, quantizer in values.values():
        if quantizer is not None:  # (None: a view's parent below the tensor holding the data)
            by_kind.setdefault(type(quantizer), []).append((t, hp.contiguous(), quantizer))
    for kind, group in by_kind.items():
        batch = getattr(kind, "quantize_batch", None)
        if batch is not None:
            fresh = batch([(quantizer, hp, t.has_columnwise) for t, hp, quantizer in group])
        else:
            # (a quantizer of another kind than te-core's, a user's: its quantize)
            fresh = [getattr(quantizer, "requantize", quantizer.quantize)(hp, columnwise=t.has_columnwise)
                     for t, hp, quantizer in group]
        for (t, _, _), value in zip(group, fresh):
            t._take_payload(value)
    for view, parent in followers:
        view._follow_write(parent)


def _put(link: ViewLink, value: Tensor, hp: Tensor, fill: Optional[Callable[[Tensor], Any]]) -> None:
    """Write a view's new value `hp` into `value`, its parent's. Where several of the view's elements
    are one element of the parent (an expand) torch refuses every write but a fill (fill_, zero_, _foreach_zero_),
    which gives them all one value: such a fill is done on the view's region of `value`, where
    torch takes it. Other writes (index_put_, masked_fill_, which torch takes with a deprecation
    warning) would write the shared elements one after another, which a requantized value has
    no order for."""
    if not _refused_overlap(lambda: link.put(value, hp)):
        return
    if fill is not None and not _refused_overlap(lambda: fill(link.region(value))):
        return
    raise RuntimeError(f"an in-place write through an expanded (or otherwise self-overlapping) view of a "
                       f"{type(link.parent).__name__}: several of its elements are one element of the tensor it "
                       "views, so torch refuses this write too (it takes only fill_ of a number, zero_ and "
                       "_foreach_zero_); write into that tensor (or a slice of it) instead, or clone() the view first")


def _refused_overlap(write: Callable[[], Any]) -> bool:
    """Run `write`; True where torch refused it for writing one memory location twice."""
    try:
        write()
    except RuntimeError as error:
        if "more than one element" not in str(error):
            raise
        return True
    return False

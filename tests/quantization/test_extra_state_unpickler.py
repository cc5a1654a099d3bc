"""The allow-listed unpicklers of extra state (te-core's and Transformer Engine's forms) rebuild a
pickled tensor only inside its storage: torch's _rebuild_tensor_v2 grows the storage to whatever
size the bytes name, so a few hundred crafted bytes allocated gigabytes, their new part
uninitialized memory that then became the module's scales and histories."""
import collections
import io
import pickle

import pytest
import torch

from te_core.compat.te_checkpoint import read_te_extra_state
from te_core.quantization import extra_state


class _Rebuilt:
    """Pickles as torch pickles a CPU tensor, with the size, stride and hooks given."""

    def __init__(self, storage, offset, size, stride, hooks=None):
        self.args = (storage, offset, size, stride, False, hooks or collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


def _readers(payload):
    data = pickle.dumps(payload, protocol=4)
    return {"te-core": lambda: extra_state._Unpickler(io.BytesIO(data)).load(),
            "transformer_engine": lambda: read_te_extra_state(data)}


@pytest.mark.parametrize("reader", ["te-core", "transformer_engine"])
def test_view_past_its_storage_is_refused(reader):
    storage = torch.randn(2)._typed_storage()
    load = _readers({"scale_fwd": _Rebuilt(storage, 0, (1 << 20,), (1,))})[reader]
    with pytest.raises(pickle.UnpicklingError, match=r"reaches past its storage of 2 elements"):
        load()


@pytest.mark.parametrize("reader", ["te-core", "transformer_engine"])
def test_backward_hooks_are_refused(reader):
    hooks = collections.OrderedDict([(0, collections.OrderedDict)])
    load = _readers({"scale_fwd": _Rebuilt(torch.randn(3)._typed_storage(), 0, (3,), (1,), hooks)})[reader]
    with pytest.raises(pickle.UnpicklingError, match="backward hooks"):
        load()


@pytest.mark.parametrize("reader", ["te-core", "transformer_engine"])
def test_views_inside_their_storage_load_exactly(reader):
    base = torch.randn(5, 7)
    tensors = {"slice": base.reshape(-1)[3:20], "column": base[:, 2], "transposed": base.t(),
               "row": base[4], "scalar": base[1, 1], "empty": base[:0]}
    loaded = _readers(dict(tensors))[reader]()
    for name, tensor in tensors.items():
        assert loaded[name].shape == tensor.shape and loaded[name].stride() == tensor.stride(), name
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
        assert not loaded[name].requires_grad


"""Fixes for bugs of older torch releases that te-core's compiled modules run into, applied at
`import te_core` on those releases only.

Lifted backward inputs (torch 2.7): dynamo traces an autograd.Function's backward into a graph
of its own and makes each tensor the backward reads from the forward an input of that graph,
named after the forward's node. torch 2.7 makes that name unique among the graph's inputs only.
Where one of the backward's own nodes already has the name, FX renames the input's node but keeps
the name of the generated function's parameter, and the generated code's `renamed = parameter`
lines then overwrite one parameter with another: a backward whose forward ran one helper twice
(two scale inverses, the norm's two statistics) reads the wrong tensors and returns wrong
gradients, with no error. torch 2.8 makes the name unique among all the graph's nodes; the fix
here does the same for torch 2.7, so a lifted input keeps its own name.

Attributes of traced tensors (torch 2.7): dynamo cannot trace setting an attribute on a tensor
made inside the graph; `SETS_TRACED_TENSOR_ATTRIBUTES` tells te-core's code to leave such tags
out while tracing there (the compiled code then forgoes what the tag would have let it skip).
"""
from __future__ import annotations

import torch


_TORCH_2_7 = torch.__version__.split("+")[0].split(".")[:2] == ["2", "7"]
SETS_TRACED_TENSOR_ATTRIBUTES = not _TORCH_2_7


def _unique(name: str, taken) -> str:
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def _fix_lifted_input_names() -> None:
    from torch._dynamo.output_graph import SubgraphTracer

    create = SubgraphTracer.create_graph_input
    if getattr(create, "_te_core_fix", False):
        return

    def create_graph_input(self, name, *args, **kwargs):
        taken = {node.name for node in self.graph.nodes}
        return create(self, _unique(name, taken | set(self.input_name_to_proxy)), *args, **kwargs)

    create_graph_input._te_core_fix = True
    SubgraphTracer.create_graph_input = create_graph_input


def apply() -> None:
    """Apply the fixes this torch needs (none on a current release; on torch 2.7 this imports
    torch._dynamo, about a second of `import te_core`)."""
    if _TORCH_2_7:
        _fix_lifted_input_names()


def pad_end(x: torch.Tensor, pad_cols: int, pad_rows: int = 0) -> torch.Tensor:
    """A 2-D `x` zero-padded by `pad_cols` columns and `pad_rows` rows at its end. The rows' pair
    is passed only when it pads: torch 2.7 and 2.8 refuse any pad of a dimension of size 0, even a
    pad of 0 (an empty batch's (0, K) cast)."""
    return torch.nn.functional.pad(x, (0, pad_cols) if pad_rows == 0 else (0, pad_cols, 0, pad_rows))

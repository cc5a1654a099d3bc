"""DotProductAttention(return_max_logit=True): Transformer Engine's max_logit for QK-clip, the
largest logit S = mask(q k^T * scale + bias) of each head over the batch, beside the output,
checked against float64 for every mask type, window, bias and GQA grouping, and packed."""
from __future__ import annotations

import pytest
import torch

import te_core.modules as tm

from ._compare import seeded
from .test_attention import ATTENTION_CASES, _packed_case, case_tensors, te_attention64

TOL = dict(rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("heads, groups, sq, sk", [(4, 4, 5, 5), (4, 2, 4, 6)])
def test_max_logit_matches_float64(case, heads, groups, sq, sk):
    g = seeded(heads * 100 + groups * 10 + sq + 9)
    q, k, v, fwd, ref_kw, dpa_kw = case_tensors(case, heads, groups, sq, sk, g)
    plain = tm.DotProductAttention(heads, q.shape[-1], **dpa_kw)
    dpa = tm.DotProductAttention(heads, q.shape[-1], return_max_logit=True, **dpa_kw)
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out, got = dpa(*args, **fwd)
    want = te_attention64(q, k, v, dpa_kw["softmax_scale"], max_logit=True, **ref_kw)
    assert got.shape == (heads,) and got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got.double(), want, **TOL)
    torch.testing.assert_close(out, plain(*args, **fwd), rtol=0, atol=0)


def test_max_logit_of_packed_sequences():
    g = seeded(61)
    lq, lkv = [3, 5, 1], [4, 5, 2]
    q, k, v, cu_q, cu_kv = _packed_case(lq, lkv, 4, 2, 8, g)
    dpa = tm.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal",
                                 return_max_logit=True)
    _, got = dpa(torch.cat(q), torch.cat(k), torch.cat(v), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    want = torch.stack([
        te_attention64(qi.permute(1, 0, 2)[None], ki.permute(1, 0, 2)[None], vi.permute(1, 0, 2)[None], 8 ** -0.5,
                       "causal", max_logit=True)
        for qi, ki, vi in zip(q, k, v)]).amax(dim=0)
    torch.testing.assert_close(got.double(), want, **TOL)


def test_return_max_logit_must_be_a_bool():
    with pytest.raises(TypeError, match="return_max_logit"):
        tm.DotProductAttention(4, 8, return_max_logit=2)

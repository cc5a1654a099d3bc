"""The availability queries answer as Transformer Engine's: a bool, or (bool, reason) with
return_reason=True, so `if te.is_fp8_available():` means what it says."""
from __future__ import annotations

import pytest

import te_core as te

QUERIES = [te.is_fp8_available, te.is_mxfp8_available, te.is_fp8_block_scaling_available]


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.__name__)
def test_bool_by_default_and_reason_on_request(query):
    answer = query()
    assert type(answer) is bool
    ok, reason = query(return_reason=True)
    assert ok is answer and isinstance(reason, str)
    assert (reason == "") == ok  # a reason exactly when the answer is no


def test_fp8_available_on_reference_is_true():
    assert te.is_fp8_available() is True

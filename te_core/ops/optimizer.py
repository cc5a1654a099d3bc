"""Contract: a multi-tensor Adam / AdamW step, in place, over lists of same-length tensors."""
from __future__ import annotations

from typing import List

from torch import Tensor

from ._spec import contract_op


@contract_op("optimizer", mutates=("params", "exp_avgs", "exp_avg_sqs"))
def multi_tensor_adam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """One step, matching torch.optim.AdamW (adam_w_mode) or torch.optim.Adam (L2 added to the
    gradient) with amsgrad=False; `step` counts this step (1 on the first). Math in float32;
    params and states keep their dtypes. Updates params, exp_avgs and exp_avg_sqs in place."""

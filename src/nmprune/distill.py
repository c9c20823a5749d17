"""The dense model's next-token distribution, kept small, and a pruned model's divergence
from it: the loss of the optional global distillation pass (docs/methods.md "Global
distillation").

Local reconstruction matches each block's outputs; what a user judges is the whole model's
next-token distribution. The global pass trains the kept weights of every pruned layer, the
masks held, to lower the KL divergence of the pruned model's distribution from the dense
model's on the calibration set (as in knowledge distillation, Hinton et al. 2015; after
pruning, e.g. Sanh et al.'s movement pruning, arXiv 2005.07683, and Kurtic et al.,
arXiv 2302.04089). A vocabulary of 50k-260k entries makes the dense logits of every
calibration token hundreds of megabytes per sample, so the dense distribution is kept as its
``k`` most likely tokens per position with their log-probabilities, and the divergence is
taken between the two distributions coarsened to those ``k`` tokens plus one bin for all
others: a true KL divergence (zero only where the coarsened distributions agree), exact when
``k`` is the vocabulary, and never above the full divergence (the data-processing inequality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


#: the dense model's most likely tokens kept per position: 64 of SmolLM2's 49,152 hold 0.92 of
#: the probability on average (64 x 512 tokens of wiki calibration text)
DISTILL_TOPK = 64


@dataclass
class TeacherTopK:
    """The dense model's ``k`` most likely next tokens at each position: their
    log-probabilities ``logp`` (float32, ``(..., k)``) and token ids ``ids`` (``(..., k)``)."""

    logp: Tensor
    ids: Tensor

    def to(self, device: torch.device | str) -> "TeacherTopK":
        return TeacherTopK(self.logp.to(device), self.ids.to(device))


def teacher_topk(logits: Tensor, k: int) -> TeacherTopK:
    """The ``k`` most likely tokens of ``logits`` (``(..., vocab)``) per position, with their
    log-probabilities in float32 (computed in float32 whatever the logits' dtype)."""
    if k < 1:
        raise ValueError(f"the dense distribution needs at least one token per position, got k={k}")
    logp = torch.log_softmax(logits.detach().float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return TeacherTopK(values, ids.to(torch.int32 if logp.shape[-1] < 2**31 else torch.int64))


def topk_kl(student_logits: Tensor, teacher: TeacherTopK) -> tuple[Tensor, int]:
    """The KL divergence of the student's next-token distribution from the teacher's, both
    coarsened to the teacher's ``k`` tokens plus the rest, summed over positions (float32,
    differentiable in ``student_logits``), and the number of positions.

    ``KL = sum_i p_i (log p_i - log q_i) + p_r (log p_r - log q_r)`` over the ``k`` tokens
    ``i`` and the rest ``r`` (``p_r = 1 - sum_i p_i``, likewise ``q_r``)."""
    logq = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, teacher.ids.long())
    p = teacher.logp.exp()
    top = (p * (teacher.logp - logq)).sum(-1)
    # the rest's masses; float32 leaves them about 1e-7 off, a negligible term
    p_rest = (1 - p.sum(-1)).clamp(min=0)
    q_rest = (1 - logq.exp().sum(-1)).clamp(min=1e-30)
    kl = top + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
    return kl.sum(), kl.numel()

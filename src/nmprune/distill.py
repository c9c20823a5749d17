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

from collections.abc import Iterator
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


#: float32 entries of logits one step of :func:`teacher_topk` and :func:`topk_kl` holds at a
#: time: rows of a 50k-260k vocabulary are read a few at a time, so that the whole logits are
#: never copied to float32 (nor their log-probabilities or gradient held in float32)
ROW_CHUNK_ENTRIES = 1 << 20


def _row_chunks(rows: int, width: int) -> Iterator[slice]:
    step = max(1, ROW_CHUNK_ENTRIES // max(width, 1))
    for a in range(0, rows, step):
        yield slice(a, min(a + step, rows))


def teacher_topk(logits: Tensor, k: int) -> TeacherTopK:
    """The ``k`` most likely tokens of ``logits`` (``(..., vocab)``) per position, with their
    log-probabilities in float32 (computed in float32 whatever the logits' dtype, a few rows
    at a time: the top logits less their row's log-sum-exp)."""
    if k < 1:
        raise ValueError(f"the dense distribution needs at least one token per position, got k={k}")
    width = logits.shape[-1]
    k = min(k, width)
    rows = logits.detach().reshape(-1, width)
    logp = torch.empty(rows.shape[0], k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows.shape[0], k, dtype=torch.int32 if width < 2**31 else torch.int64, device=logits.device)
    for chunk in _row_chunks(rows.shape[0], width):
        x = rows[chunk].float()
        values, top = x.topk(k, dim=-1)
        logp[chunk] = values - torch.logsumexp(x, dim=-1, keepdim=True)
        ids[chunk] = top.to(ids.dtype)
    return TeacherTopK(logp.reshape(*logits.shape[:-1], k), ids.reshape(*logits.shape[:-1], k))


class _TopkKL(torch.autograd.Function):
    """The summed divergence of :func:`topk_kl` with its gradient in closed form, the logits
    read a few rows at a time in float32. With ``logq_i = x_i - logsumexp(x)`` at the
    teacher's tokens and ``a_i = dKL/dlogq_i = -p_i + (p_r / q_r) q_i``, the gradient in the
    logits is ``scatter(a) - softmax(x) * sum_i a_i``: what autograd gives through the
    log-softmax, without its float32 copies of the whole logits."""

    @staticmethod
    def forward(ctx, logits: Tensor, logp: Tensor, ids: Tensor) -> Tensor:
        width = logits.shape[-1]
        rows, logp, ids = logits.reshape(-1, width), logp.reshape(-1, logp.shape[-1]), ids.reshape(-1, ids.shape[-1]).long()
        lse = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
        logq = torch.empty(logp.shape, dtype=torch.float32, device=logits.device)
        for chunk in _row_chunks(rows.shape[0], width):
            x = rows[chunk].float()
            lse[chunk] = torch.logsumexp(x, dim=-1)
            logq[chunk] = x.gather(-1, ids[chunk]) - lse[chunk, None]
        p, q = logp.exp(), logq.exp()
        # the rest's masses; float32 leaves them about 1e-7 off, a negligible term
        p_rest = (1 - p.sum(-1)).clamp(min=0)
        q_left = 1 - q.sum(-1)
        q_rest = q_left.clamp(min=1e-30)
        kl = (p * (logp - logq)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
        # no gradient through the clamp, where the student's rest holds no mass
        ratio = torch.where(q_left > 1e-30, p_rest / q_rest, torch.zeros_like(q_rest))
        slope = ratio[:, None] * q - p
        ctx.save_for_backward(logits, lse, slope, ids)
        return kl.sum()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, lse, slope, ids = ctx.saved_tensors
        width = logits.shape[-1]
        rows = logits.reshape(-1, width)
        out = torch.empty_like(rows)
        total = slope.sum(-1)
        for chunk in _row_chunks(rows.shape[0], width):
            g = rows[chunk].float().sub_(lse[chunk, None]).exp_().mul_(-total[chunk, None])
            g.scatter_add_(-1, ids[chunk], slope[chunk])
            out[chunk] = g.mul_(grad)
        return out.reshape(logits.shape), None, None


def topk_kl(student_logits: Tensor, teacher: TeacherTopK) -> tuple[Tensor, int]:
    """The KL divergence of the student's next-token distribution from the teacher's, both
    coarsened to the teacher's ``k`` tokens plus the rest, summed over positions (float32,
    differentiable in ``student_logits``, whose gradient comes in their dtype), and the
    number of positions.

    ``KL = sum_i p_i (log p_i - log q_i) + p_r (log p_r - log q_r)`` over the ``k`` tokens
    ``i`` and the rest ``r`` (``p_r = 1 - sum_i p_i``, likewise ``q_r``)."""
    return _TopkKL.apply(student_logits, teacher.logp, teacher.ids), teacher.logp[..., 0].numel()

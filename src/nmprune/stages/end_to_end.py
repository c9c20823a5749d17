"""The end-to-end check of local reconstruction: after the last block, is the reconstructed
model closer to the dense one than its solved weights alone, through the model's own head, on
the held-out calibration batches? The per-block guard
(:meth:`~nmprune.stages.reconstruction.ReconstructingStatistics.advance`) judges each block by
its own outputs and cannot see what only the whole model shows (the way a plain squared error
once hid Gemma-3's collapse).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import NonFiniteModel
from ..evaluate import perplexity_from_nll, window_kl, window_nll
from .block_runner import BlockInputs, run_block


class ReconstructionWorse(ValueError):
    """Reconstruction left the model worse on held-out calibration text than the solved
    weights alone, although every block it kept lowered that block's held-out error."""


#: The end-to-end check stops a run whose reconstructed model is this many times further (KL
#: divergence from the dense model on the held-out calibration batches) than its solved weights
#: alone: a collapse is orders of magnitude, a few held-out batches vary by a few percent.
END_TO_END_MARGIN = 1.1

#: ``head(batches, last-block outputs)`` yields the ids and logits of each of this process's
#: batches named
Head = Callable[[list[int], list[Tensor]], Iterator[tuple[Tensor, Tensor]]]


class EndToEndCheck:
    """The end-to-end check: it carries the held-out batches through the solved weights alone
    (what ``reconstruct="none"`` gives with dense-input statistics; :meth:`advance`), from
    ``hidden`` (the hidden states entering block 0, this process's batches), and after the
    last block compares the model as reconstructed with them (:meth:`check`). ``held_local``:
    this process's held-out batches (local indices), ``held``: how many all processes hold;
    ``inputs`` holds the blocks' other arguments, ``all_reduce`` sums over processes."""

    def __init__(self, inputs: BlockInputs, hidden: Sequence[Tensor], held_local: list[int], held: int,
                 all_reduce: Callable[[Sequence[Tensor]], None]):
        self.inputs, self.held_local, self.held, self.all_reduce = inputs, held_local, held, all_reduce
        # the reference of the check; unknown after a resume
        self.solved: list[Tensor] | None = [hidden[j] for j in held_local] if hidden else None

    def forget(self) -> None:
        """A resume: the solved-only stream is not in the checkpoint."""
        self.solved = None

    def advance(self, index: int, block: nn.Module) -> None:
        """Move the solved-only stream past block ``index``, which holds its solved weights."""
        if self.solved is not None:
            self.solved = [run_block(block, h, self.inputs.call(index, h)) for h in self.solved]

    def check(self, head: Head, dense: list[Tensor], pruned: list[Tensor]) -> dict[str, Any] | None:
        """How far the model is from the dense one on the held-out calibration batches,
        through ``head`` from the last block's outputs (``dense``, ``pruned``: the two
        streams): perplexities of the dense model, the solved weights alone and the model as
        reconstructed, and the mean KL divergence of the latter two's next-token distributions
        from the dense model's, over all processes. Raises :class:`ReconstructionWorse` when
        the reconstructed model is further from the dense one than the solved weights alone,
        by more than :data:`END_TO_END_MARGIN` (a few held-out batches are noisy). None
        without held-out batches. After a resume the comparison is not made, and the record
        says so, but the dense and reconstructed models are still measured and checked: a
        dense model whose head overflows is refused (:class:`~nmprune.checks.NonFiniteModel`)
        on a resumed run too."""
        if not self.held:
            return None
        sums = self._sums(head, dense, pruned)
        ppl = [perplexity_from_nll(float(s[0] / s[1])) if s[1] > 0 else float("nan") for s in sums]
        kl = [float(s[2] / s[3]) if s[3] > 0 else float("nan") for s in sums]
        if not math.isfinite(ppl[0]):
            raise NonFiniteModel("the dense model's next-token distribution on the held-out calibration "
                                 f"text is not finite (perplexity {ppl[0]}): its last layers or head overflow "
                                 "(a weight too large for its dtype?); check the model's weights, or use "
                                 "--dtype float32")
        if self.solved is None:
            return {"checked": False, "why": "resumed: the held-out batches' stream through the solved weights "
                                             "alone is not in the checkpoint", "batches": self.held,
                    "tokens": int(sums[0, 1]), "dense": ppl[0], "reconstructed": ppl[1], "kl_reconstructed": kl[1]}
        record = {"checked": True, "batches": self.held, "tokens": int(sums[0, 1]),
                  "dense": ppl[0], "solved": ppl[1], "reconstructed": ppl[2],
                  "kl_solved": kl[1], "kl_reconstructed": kl[2]}
        if not kl[2] <= END_TO_END_MARGIN * kl[1]:
            raise ReconstructionWorse(
                f"reconstruction moved the model away from the dense one on the held-out calibration "
                f"batches: KL divergence {kl[2]:.4g} against {kl[1]:.4g} with the solved weights alone "
                f"(more than {END_TO_END_MARGIN:g}x) "
                f"(perplexity {ppl[2]:.4g} against {ppl[1]:.4g}, dense {ppl[0]:.4g}), although every "
                f"block it kept lowered its own held-out error; rerun with --reconstruct none --restart "
                f"for the solved model")
        return record

    def _sums(self, head: Head, dense: list[Tensor], pruned: list[Tensor]) -> Tensor:
        """Per model (dense, solved where known, reconstructed): the summed negative
        log-likelihood, its tokens, the summed KL divergence from the dense model and its
        positions, over all processes' held-out batches (float64)."""
        device = dense[0].device if dense else "cpu"
        streams = 2 if self.solved is None else 3  # dense, (solved,) reconstructed
        sums = torch.zeros(streams, 4, dtype=torch.float64, device=device)  # per model: nll, tokens, kl, positions
        finals = [x for i, j in enumerate(self.held_local)
                  for x in (dense[j], *([] if self.solved is None else [self.solved[i]]), pruned[j])]
        reference = None
        for k, (ids, logits) in enumerate(head([j for j in self.held_local for _ in range(streams)], finals)):
            model = k % streams
            if model == 0:
                reference = logits
            nll, count = window_nll(logits, ids)
            kl, positions = window_kl(reference, logits)
            sums[model] += torch.tensor([float(nll), float(count), float(kl), float(positions)],
                                        dtype=torch.float64, device=device)
            del ids, logits, nll, kl
        del reference
        self.all_reduce([sums])
        return sums

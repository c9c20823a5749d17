"""What a stage will need, stated by the stage itself: the interface of ``prune --dry-run``.

Every stage of a run (:mod:`nmprune.stages`) has a function ``*_needs(run)`` beside its code
that estimates, from a :class:`RunShape` alone (no weight is read), what one rank of it holds
and how long it takes: a :class:`StageNeeds`. :func:`nmprune.resources.plan_run` builds the
:class:`RunShape` from the model's configuration and the settings, asks each stage the run will
have, and adds their answers up into the run's peaks and times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepCosts:
    """What one training step costs one rank beside its floating-point work, which grows with
    the tokens: ``per_parameter`` seconds for each weight it trains (the weight's own passes:
    its cast to the products' dtype and its gradient's back, and the dense gradient's
    compaction to the kept entries), ``per_entry`` seconds for each kept entry (the
    optimiser's step), and the bytes per second of a collective between ranks
    (``link_bytes_per_second``; a sum over ``n`` ranks moves ``2 (n - 1) / n`` of its bytes
    over each rank's link, a broadcast ``(n - 1) / n``)."""

    per_parameter: float
    per_entry: float
    link_bytes_per_second: float

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Seconds of a sum of ``nbytes`` over ``ranks`` ranks (none for one)."""
        return 2.0 * (ranks - 1) / ranks * nbytes / self.link_bytes_per_second

    def broadcast(self, nbytes: float, ranks: int) -> float:
        """Seconds of a broadcast of ``nbytes`` to ``ranks`` ranks (none for one)."""
        return (ranks - 1) / ranks * nbytes / self.link_bytes_per_second


@dataclass(frozen=True)
class RunShape:
    """What every stage's estimate reads: the run's ``settings``
    (:class:`~nmprune.config.PruneSettings`), its ``ranks`` and ``device`` kind (``"cpu"``,
    ``"cuda"``), the bytes of one weight entry in the run's dtype (``itemsize``), each block's
    prunable layers' ``(d_out, d_in)`` by full name (``per_block``) and each layer's
    :class:`~nmprune.stages.plan.LayerPlan` (``plans``; None: left dense), each block's
    parameter count (``block_params``) and the whole model's (``params``), its hidden and
    vocabulary sizes, its attention heads, whether it trains in bfloat16
    (``trains_in_bfloat16``), and the rates of one rank: float32 operations per second of its
    passes (``rate``), of its training passes (``train_rate``: bfloat16 where it trains in it),
    and how many times faster than the reference CPU it solves a layer (``solve_speed``); the
    training steps' other costs (``step_costs``)."""

    settings: Any
    ranks: int
    device: str
    itemsize: int
    per_block: list[dict[str, tuple[int, int]]]
    plans: dict[str, Any]
    block_params: list[int]
    params: int
    hidden_size: int
    vocab_size: int
    attention_heads: int
    trains_in_bfloat16: bool
    rate: float
    train_rate: float
    solve_speed: float
    step_costs: StepCosts

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """Every prunable layer's shape, by full name."""
        return {name: shape for block in self.per_block for name, shape in block.items()}

    @property
    def intermediate(self) -> int:
        """The widest layer output (the MLP's intermediate size in a Llama)."""
        return max((d_out for d_out, _ in self.shapes.values()), default=self.hidden_size)

    @property
    def tokens(self) -> int:
        """The calibration tokens of all ranks."""
        return self.settings.nsamples * self.settings.seqlen

    @property
    def rank_tokens(self) -> int:
        """The calibration tokens of the busiest rank (whole windows are shared out)."""
        return -(-self.settings.nsamples // self.ranks) * self.settings.seqlen

    @property
    def batch_tokens(self) -> int:
        """The tokens of one calibration batch."""
        return self.settings.batch_size * self.settings.seqlen

    @property
    def forward(self) -> float:
        """Floating-point operations of one pass of all calibration tokens through every block
        (2 per parameter and token)."""
        return 2.0 * sum(self.block_params) * self.tokens

    @property
    def kept(self) -> float:
        """The largest share of entries a pattern keeps (``N/M``; 1 with nothing pruned)."""
        return max((p.pattern.n / p.pattern.m for p in self.plans.values() if p is not None), default=1.0)

    def pruned(self, block: dict[str, tuple[int, int]]) -> list[str]:
        """The layers of ``block`` (one of :attr:`per_block`) that are pruned."""
        return [name for name in block if self.plans[name] is not None]


@dataclass(frozen=True)
class StageNeeds:
    """One stage's estimate for one rank: ``block_bytes`` it holds on the compute device while a
    block is worked on (the stages' sum is the block phase), ``stream_bytes`` of calibration
    hidden states it carries from block to block (held from the capture on), ``peak_bytes`` of a
    phase of its own after the blocks (the global distillation's; ``peak_parts``: what they are
    made of, by name), and ``seconds`` by name; ``host_bytes`` that phase holds in CPU memory
    beside the device (the global distillation's state, offloaded)."""

    block_bytes: float = 0
    stream_bytes: int = 0
    peak_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    peak_parts: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0

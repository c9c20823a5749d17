"""Every implementation of a pipeline stage has the methods of the stage's written
interface, with the same parameters: the block source, the sink, the statistics stage and
the executor, and the roles of a prune run's ranks (docs/architecture.md)."""

from __future__ import annotations

import inspect

import pytest

from nmprune.distributed import DistributedExecutor
from nmprune.job import HelperRank, LeadRank, RunRole
from nmprune.stages.executor import Executor, LocalExecutor
from nmprune.stages.reconstruction import ReconstructingStatistics
from nmprune.stages.sink import BlockSink, ModelSink
from nmprune.stages.source import BlockSource, ModelBlocks
from nmprune.stages.statistics import CalibrationStatistics, PrecomputedStatistics, StatisticsStage
from nmprune.streaming import ShardedWriter, StreamingModel

STAGES = {
    "block source": (BlockSource, [ModelBlocks, StreamingModel]),
    "sink": (BlockSink, [ModelSink, ShardedWriter]),
    "statistics": (StatisticsStage, [CalibrationStatistics, PrecomputedStatistics, ReconstructingStatistics]),
    "executor": (Executor, [LocalExecutor, DistributedExecutor]),
    "rank role": (RunRole, [LeadRank, HelperRank]),
}


def _methods(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and (callable(member) or isinstance(member, property))}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_implementations_have_the_interface(stage):
    interface, implementations = STAGES[stage]
    wanted = _methods(interface)
    assert wanted, interface
    for impl in implementations:
        for name, member in wanted.items():
            assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
            if callable(member):
                params = list(inspect.signature(member).parameters)
                assert list(inspect.signature(getattr(impl, name)).parameters) == params, \
                    f"{impl.__name__}.{name}"

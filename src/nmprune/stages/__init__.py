"""The stages of the whole-model pipeline (:mod:`nmprune.pipeline` wires them block by block):
the planner (:mod:`.plan`), the block source (:mod:`.source`), the block runner
(:mod:`.block_runner`), the statistics stage (:mod:`.statistics`), the solver stage
(:mod:`.executor`) and the sink (:mod:`.sink`). Each module states its interface; the
streamed implementations live in :mod:`nmprune.streaming`, the distributed executor in
:mod:`nmprune.distributed`. See docs/architecture.md."""

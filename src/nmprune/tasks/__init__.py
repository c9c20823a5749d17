"""nmprune's offline lm-eval tasks: task YAML files over JSON-lines data built from the
held-out splits of the packaged texts by :mod:`nmprune.tasks.build` (docs/downstream.md).
They are registered with lm-eval by :mod:`nmprune.downstream`."""

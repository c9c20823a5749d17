"""Downstream accuracy with lm-evaluation-harness on a model held in memory.

The paper (Section ``sec:llm_experiments``) reports zero-shot accuracy on lm-eval tasks next
to perplexity. :func:`evaluate_tasks` wraps an in-memory model and tokenizer in lm-eval's
``HFLM`` (no save and reload) and runs ``lm_eval.simple_evaluate`` on task names resolved by
a ``TaskManager`` that knows lm-eval's own tasks, nmprune's offline tasks (the YAML and
JSON-lines files of :mod:`nmprune.tasks`) and the folders of ``include_path``.

:func:`check_tasks` validates everything that can be wrong with the user's request (unknown
task names, task data that cannot be loaded, ``limit`` or ``num_fewshot`` out of range)
before a model is loaded; every problem is a one-line ``ValueError``.

Needs the optional extra ``nmprune[eval]`` (``pip install lm-eval``). See docs/downstream.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
#: nmprune's offline tasks (no download), built from the held-out splits by nmprune.tasks.build.
OFFLINE_TASKS = ("nmprune_wiki_cloze", "nmprune_wiki_next", "nmprune_austen_cloze", "nmprune_austen_next")
#: The metrics a table shows for a task, in order of preference (the first one present).
HEADLINE_METRICS = ("acc_norm", "acc", "exact_match", "mc2", "f1")
LOCAL_DATA_HINT = ("to run it offline, copy its YAML into a folder passed with --include-path and "
                   "point it at local files: dataset_path: json and dataset_kwargs: {data_files: "
                   "{test: /abs/path/test.jsonl}} (or run once online so the Hugging Face cache holds it)")


@dataclass(frozen=True)
class DownstreamSettings:
    """What to evaluate: lm-eval task (or group/tag) names and the pass-through options.

    ``num_fewshot`` ``None`` keeps each task's default (0 for nmprune's tasks); ``limit``
    ``None`` evaluates every item, an integer the first ``limit`` items of each task;
    ``include_path`` adds folders of the user's own task YAML files (lm-eval's ``--include_path``).
    The options are validated even without tasks (so a bad flag fails at once); no tasks means
    no downstream evaluation.
    """

    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 8
    include_path: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        tasks = (self.tasks,) if isinstance(self.tasks, str) else tuple(self.tasks)
        object.__setattr__(self, "tasks", tuple(t.strip() for t in tasks if t and t.strip()))
        object.__setattr__(self, "include_path", tuple(str(p) for p in self.include_path))
        if self.num_fewshot is not None and (not _is_int(self.num_fewshot) or self.num_fewshot < 0):
            raise ValueError(f"--num-fewshot must be an integer >= 0, got {self.num_fewshot!r}")
        if self.limit is not None and (not _is_int(self.limit) or self.limit < 1):
            raise ValueError(f"--limit must be a positive integer (items per task), got {self.limit!r}")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"--batch-size must be a positive integer, got {self.batch_size!r}")
        for p in self.include_path:
            if not Path(p).is_dir():
                raise ValueError(f"--include-path {p!r} is not a folder of lm-eval task YAML files")

    def to_dict(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "num_fewshot": self.num_fewshot, "limit": self.limit,
                "batch_size": self.batch_size, "include_path": list(self.include_path)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_task_list(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"a,b"`` or ``["a,b", "c"]`` -> ``("a", "b", "c")``."""
    if text is None:
        return ()
    parts = [text] if isinstance(text, str) else list(text)
    return tuple(t.strip() for part in parts for t in part.split(",") if t.strip())


class _DropCustomDatasetNotice(logging.Filter):
    """lm-eval logs a notice about ``--metadata`` for every task with a ``custom_dataset``
    (all of nmprune's offline tasks); it says nothing about them, so it is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def _lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError("downstream tasks need lm-evaluation-harness: pip install 'nmprune[eval]' "
                         "(or pip install lm-eval)") from None
    task_logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _DropCustomDatasetNotice) for f in task_logger.filters):
        task_logger.addFilter(_DropCustomDatasetNotice())


@lru_cache(maxsize=4)
def _manager(include_path: tuple[str, ...], defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR), *include_path], include_defaults=defaults)


def task_manager(tasks: Sequence[str] = (), include_path: Sequence[str] = ()):
    """An lm-eval ``TaskManager`` that knows ``tasks``: nmprune's offline tasks and the
    folders of ``include_path`` alone when they hold every name (indexing lm-eval's own
    thousands of task files takes tens of seconds), else lm-eval's tasks too. Cached."""
    _lm_eval()
    small = _manager(tuple(include_path), False)
    if all(t in small.all_tasks for t in tasks):
        return small
    return _manager(tuple(include_path), True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def check_tasks(settings: DownstreamSettings) -> dict[str, str]:
    """Validate ``settings`` before any model is loaded; returns ``{leaf task: version}``.

    Every name must be a task, group or tag lm-eval knows (with nmprune's offline tasks and
    ``include_path``), and every task's data must load (downloaded where the network allows,
    from the local files or the Hugging Face cache otherwise). Raises ValueError naming the
    offending task.
    """
    if not settings.tasks:
        raise ValueError("no lm-eval task given; name at least one, e.g. " + ",".join(OFFLINE_TASKS[:2]))
    manager = task_manager(settings.tasks, settings.include_path)
    known = set(manager.all_tasks)
    for name in settings.tasks:
        if name not in known:
            raise ValueError(f"unknown lm-eval task {name!r}; nmprune's offline tasks are "
                             f"{', '.join(OFFLINE_TASKS)}; list lm-eval's with `lm_eval ls tasks`, or "
                             "pass --include-path DIR holding your own task YAML")
    versions: dict[str, str] = {}
    for name in settings.tasks:
        try:
            loaded = manager.load([name])["tasks"]
        except Exception as e:  # lm-eval and datasets raise many types for "no data"
            raise ValueError(f"the data of lm-eval task {name!r} could not be loaded "
                             f"({_first_line(e)}); {LOCAL_DATA_HINT}") from None
        versions.update({t: _version(task) for t, task in loaded.items()})
    return versions


def _version(task) -> str:
    version = getattr(task, "VERSION", None)
    return "N/A" if version is None else str(version)


def evaluate_tasks(model, tokenizer, settings: DownstreamSettings, *,
                   device=None) -> dict[str, dict[str, Any]]:
    """lm-eval accuracies of an in-memory causal LM: ``{task: {metric: value, ...,
    "version": str, "n": items}}`` with lm-eval's metric names (``acc``, ``acc_norm`` ...)
    and their standard errors (``acc_stderr`` ...).

    ``device``: where to run (default: where the model is); a model elsewhere is moved there
    for the call and back. Eval mode during the call; the training flag is restored.
    """
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from .models import evaluating

    manager = task_manager(settings.tasks, settings.include_path)
    with evaluating(model, device):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size,
                  trust_remote_code=False)
        out = simple_evaluate(model=lm, tasks=list(settings.tasks), num_fewshot=settings.num_fewshot,
                              limit=settings.limit, task_manager=manager, log_samples=False,
                              bootstrap_iters=100)
    return results_of(out)


def results_of(out: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per leaf task: metrics (lm-eval's ``"acc,none"`` keys without the filter suffix),
    ``version`` and ``n`` (items evaluated), from a ``simple_evaluate`` result."""
    groups = set(out.get("groups", {}))
    result: dict[str, dict[str, Any]] = {}
    for task, metrics in out["results"].items():
        if task in groups:
            continue
        row: dict[str, Any] = {}
        for key, value in metrics.items():
            metric, sep, filt = key.partition(",")
            if sep and filt == "none" and isinstance(value, (int, float)):
                row[metric] = float(value)
        row["version"] = str(out.get("versions", {}).get(task, "N/A"))
        n = out.get("n-samples", {}).get(task, {})
        row["n"] = int(n.get("effective", n.get("original", 0))) if isinstance(n, Mapping) else 0
        result[task] = row
    return result


def headline(metrics: Mapping[str, Any]) -> tuple[str, float] | None:
    """The metric a table shows for one task (:data:`HEADLINE_METRICS`), or None."""
    for name in HEADLINE_METRICS:
        value = metrics.get(name)
        if isinstance(value, float) and math.isfinite(value):
            return name, value
    return None


def accuracy_columns(result: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Table columns of :func:`evaluate_tasks`' result: ``{"TASK METRIC% vVERSION": percent}``,
    one per task (its :func:`headline` metric), to sit beside the perplexity columns of
    :func:`nmprune.evaluate.perplexity_table`."""
    columns = {}
    for task, metrics in result.items():
        h = headline(metrics)
        if h is not None:
            columns[f"{task} {h[0]}% v{metrics.get('version', 'N/A')}"] = 100 * h[1]
    return columns

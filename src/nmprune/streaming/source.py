"""The model skeleton of a safetensors checkpoint, with weights materialised on demand.

:class:`StreamingModel` builds the causal LM from its configuration under accelerate's
``init_empty_weights`` (parameters on the meta device, no memory; buffers such as rotary
tables are computed as usual) and fills parameters in from the checkpoint only while they
are needed: one decoder block at a time (:meth:`load` / :meth:`release`, a per-block API,
so a process reads only the blocks it works on), and the modules outside the blocks
(embeddings, final norm, LM head: :meth:`load_outside`) for the input capture and the
evaluation's head. Releasing puts the parameters back on the meta device. Parameters
shared between modules (tied embeddings) are filled in once, for every holder. It is a
block source for :func:`nmprune.pipeline.prune_model` like the in-memory one. The
checkpoint must hold every parameter of the skeleton, each with the skeleton's shape and
floating point where the parameter is (and so must the buffers it stores), which is
checked from the files' headers before any weight is read.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ..devices import products_in
from ..distill import TeacherTopK, teacher_topk
from ..memory import release_memory
from ..progress import bar as progress_bar
from ..stages.block_runner import BlockInputs, capture_block_inputs, head_logits, run_block
from ..stages.distillation import pass_attention
from ..models import ModelSource, check_causal, parse_dtype
from ..validate import check_finite_tensors
from ..stages.sink import BlockSink, OutputSink
from ..stages.source import STREAMED_TASKS, DecoderBlocks
from .files import CheckpointFileError, SafetensorsFiles, check_no_extra_blocks, missing_tensors


def _resolve_dtype(dtype: str | torch.dtype | None, config, files: SafetensorsFiles) -> torch.dtype:
    """The model dtype ``from_pretrained`` would pick: ``auto`` is the config's ``dtype``,
    else the first floating tensor's in the checkpoint."""
    parsed = parse_dtype(dtype)
    if parsed != "auto":
        return parsed
    if getattr(config, "dtype", None) is not None:
        return parse_dtype(config.dtype)
    for key in files.keys():
        t = files.get(key)
        if t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


def _move_buffers(modules: list[nn.Module], device: torch.device | str) -> None:
    """Move the buffers held directly by ``modules`` (not their children's)."""
    for m in modules:
        for name, buf in m._buffers.items():
            if buf is not None and buf.device != torch.device(device):
                m._buffers[name] = buf.to(device)


class StreamingModel(DecoderBlocks):
    """A causal LM whose weights stay in its safetensors checkpoint until asked for.

    ``directory``: a Hugging Face model directory with ``config.json`` (read by
    :func:`nmprune.models.check_causal`) and safetensors weights (checked by
    :meth:`SafetensorsFiles.open` and :meth:`SafetensorsFiles.check_fits`); ``dtype`` as in
    :func:`nmprune.models.load_model`. ``model`` is the skeleton (use it like a loaded
    model once the parts a computation needs are loaded); ``blocks_name`` / ``blocks``
    its decoder blocks. It is a :class:`nmprune.stages.source.BlockSource`; blocks and prunable
    layers are found by :class:`nmprune.stages.source.DecoderBlocks` on the skeleton, tied weights
    by the same rule as in memory.
    """

    streamed = True

    def __init__(self, directory: str | os.PathLike, dtype: str | torch.dtype | None = "auto"):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.directory = Path(directory)
        self.files = SafetensorsFiles.open(self.directory)
        config = check_causal(ModelSource(str(self.directory)))
        self.dtype = _resolve_dtype(dtype, config, self.files)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, trust_remote_code=False)
        model.tie_weights()  # the meta context re-creates parameters, which unties them
        if (self.directory / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(self.directory)
        super().__init__(model.eval())
        check_no_extra_blocks(self.directory, self.files.keys(), self.blocks_name, len(self.blocks))
        self._holders: dict[str, list[tuple[nn.Module, str]]] = {}
        self._key: dict[str, str] = {}
        self._aliases: dict[str, list[str]] = {}
        first: dict[int, str] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                full = f"{module_name}.{attr}" if module_name else attr
                canonical = first.setdefault(id(p), full)
                if (module, attr) not in self._holders.setdefault(canonical, []):
                    self._holders[canonical].append((module, attr))
                self._aliases.setdefault(canonical, []).append(full)
                if full in self.files and canonical not in self._key:
                    self._key[canonical] = full
        missing = [c for c in self._holders if c not in self._key]
        if missing:
            raise CheckpointFileError(missing_tensors(self.directory, missing) + ": the checkpoint is "
                                      "incomplete or belongs to another configuration, or it names "
                                      "its tensors unlike transformers' saves of this model class "
                                      "(then loading it whole, without offload, may work)")
        self._canonical_of = {key: canonical for canonical, key in self._key.items()}
        buffers = self._stored_buffers()
        self.files.check_fits({**{key: self._parameter(c) for c, key in self._key.items()},
                               **{key: module._buffers[attr] for key, (module, attr) in buffers.items()}})
        self._checked: set[str] = set()  # tensors found finite: each is checked once
        self._buffer_keys = self._load_buffers(buffers)
        prefix = f"{self.blocks_name}."
        self._block_params: list[list[str]] = [[] for _ in self.blocks]
        self._outside: list[str] = []
        for canonical, aliases in self._aliases.items():
            inside = [a for a in aliases if a.startswith(prefix)]
            if inside:
                self._block_params[int(inside[0][len(prefix):].split(".", 1)[0])].append(canonical)
            if len(inside) < len(aliases):
                self._outside.append(canonical)
        self._alias_of = {alias: c for c, aliases in self._aliases.items() for alias in aliases}

    @property
    def config(self):
        """The model's transformers configuration (as a loaded model's ``config``)."""
        return self.model.config

    def _parameter(self, canonical: str) -> nn.Parameter:
        """The parameter ``canonical`` names, as its holders hold it now."""
        module, attr = self._holders[canonical][0]
        return module._parameters[attr]

    def _stored_buffers(self) -> dict[str, tuple[nn.Module, str]]:
        """The buffers the checkpoint stores (``state_dict`` entries): name -> (module, attribute)."""
        persistent = set(self.model.state_dict())
        stored = {}
        for module_name, module in self.model.named_modules():
            for attr, buf in module._buffers.items():
                full = f"{module_name}.{attr}" if module_name else attr
                if buf is not None and full in persistent and full in self.files:
                    stored[full] = (module, attr)
        return stored

    def _check_finite(self, values: dict[str, Tensor]) -> None:
        """Refuse NaN or Inf in tensors read for the first time (:func:`check_finite_tensors`:
        the same check as a model loaded whole, as each tensor is first read)."""
        fresh = {key: v for key, v in values.items() if key not in self._checked}
        check_finite_tensors(fresh.items(), self.directory)
        self._checked.update(fresh)

    def check_finite(self) -> None:
        """Read every tensor the model uses once, before any work, refusing NaN or Inf
        (:func:`check_finite_tensors`, the check of a model loaded whole): the tensors a run
        will save, pruned, skipped or outside the blocks. One tensor is in memory at a time."""
        for key in [*self._key.values(), *self._buffer_keys]:
            if key not in self._checked:
                self._check_finite({key: self.files.get(key)})

    def _load_buffers(self, buffers: dict[str, tuple[nn.Module, str]]) -> list[str]:
        """Read the stored ``buffers`` once and keep them; returns their names."""
        for key, (module, attr) in buffers.items():
            value = self.files.get(key)
            self._check_finite({key: value})
            if value.is_floating_point():
                value = value.to(module._buffers[attr].dtype)
            module._buffers[attr] = value
        return list(buffers)

    # -- the block source interface ---------------------------------------------------------

    def capture(self, batches, device: torch.device, keep_hidden: bool = True) -> BlockInputs:
        """Hidden states entering block 0 and every block's call arguments
        (:func:`capture_block_inputs`), with the modules outside the blocks and block 0
        loaded for the capture only."""
        with self.outside(device), self.block(0, device):
            return capture_block_inputs(self.model, self.blocks_name, self.blocks, list(batches),
                                        device, keep_hidden=keep_hidden, place=False)

    def head_logits(self, template: Any, batches: Sequence[Tensor], finals: Sequence[Tensor],
                    device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
        """Each batch's ids and logits from its last-block output (:func:`head_logits`), the
        modules outside the blocks loaded meanwhile."""
        with self.outside(device):
            yield from head_logits(self.model, self.blocks_name, self.blocks, template, batches, finals,
                                   device, place=False)

    # -- what a job asks of its model ---------------------------------------------------------

    def perplexity(self, input_ids: Tensor, seqlen: int, device: Any, progress: bool,
                   prefix: Sequence[int], desc: str) -> float:
        """Perplexity on a ``(1, N)`` token stream, block by block
        (:func:`nmprune.streaming.evaluate.streaming_perplexity`)."""
        from .evaluate import streaming_perplexity

        return streaming_perplexity(self, input_ids, seqlen=seqlen, device=device, progress=progress,
                                    prefix=prefix, desc=desc)

    def whole_model(self, flag: str) -> nn.Module:
        """Refused: lm-eval needs every weight in memory at once."""
        raise ValueError(STREAMED_TASKS.format(flag=flag))

    def block_outputs(self, batches: list[Tensor], device: torch.device, progress: bool = False,
                      desc: str = "perplexity") -> BlockInputs:
        """The last block's outputs for each token batch (``hidden``), with the per-block call
        arguments and the output template of the capture: one block loaded at a time."""
        inputs = self.capture(batches, device)
        for i in progress_bar(range(len(self)), enabled=progress, desc=f"{desc} (blocks)"):
            with self.block(i, device) as block:
                inputs.hidden = [run_block(block, h, inputs.call(i, h)) for h in inputs.hidden]
            release_memory(collect=False)  # else the heap fragments: about +5 MiB a block on SmolLM2
        return inputs

    @torch.no_grad()
    def dense_teachers(self, batches: Sequence[Tensor], k: int, device: torch.device,
                       dtype: torch.dtype | None) -> list[TeacherTopK]:
        """The dense model's ``k`` most likely tokens on ``batches``, block by block
        (:meth:`block_outputs`, every batch's hidden states held), the products under autocast
        to ``dtype`` and attention as the pass computes it, as
        :func:`~nmprune.stages.distillation.dense_teachers` does on a model held whole."""
        tokens = max((b.shape[-1] for b in batches), default=0)
        with products_in(device, dtype), pass_attention(self.model, device, dtype, tokens):
            inputs = self.block_outputs(list(batches), device)
            return [teacher_topk(logits, k).to("cpu") for _, logits in
                    self.head_logits(inputs.output_template, batches, inputs.hidden, device)]

    @contextmanager
    def whole_pruned(self, sink: BlockSink) -> Iterator[nn.Module]:
        """The whole model in CPU memory for the global distillation: every block and the
        modules outside them read from the checkpoint, the prunable layers given the weights
        ``sink`` wrote (:meth:`~nmprune.streaming.ShardedWriter.read`); on a normal exit every
        block's trained weights are written to ``sink`` again. Released afterwards."""
        try:
            self.load_outside("cpu")
            for i in range(len(self)):
                self.load(i, "cpu")
                with torch.no_grad():
                    for name, weight in sink.read(i).items():
                        self.layers(i)[name].weight.copy_(weight)
            yield self.model
            for i in range(len(self)):
                sink.write(i, {name: m.weight.detach() for name, m in self.layers(i).items()})
        finally:
            for i in range(len(self)):
                self.release(i)
            self.release_outside()
            release_memory()

    def output(self, out: str | os.PathLike, writes: bool) -> OutputSink:
        """Shards written as blocks finish (:class:`~nmprune.streaming.ShardedWriter`) on the
        process that ``writes``; on the others, nothing is written, and a block's pruned weights
        are read from rank 0's shards (:class:`~nmprune.streaming.sink.RankZeroShards`)."""
        from .sink import RankZeroShards, ShardedWriter

        return ShardedWriter(self, out) if writes else RankZeroShards(self, out)

    # -- sizes and names ------------------------------------------------------------------

    def block_keys(self, index: int) -> list[str]:
        """Checkpoint tensor names of block ``index`` (parameters and stored buffers)."""
        prefix = f"{self.blocks_name}.{index}."
        return [self._key[c] for c in self._block_params[index]] + \
            [k for k in self._buffer_keys if k.startswith(prefix)]

    def outside_keys(self) -> list[str]:
        """Checkpoint tensor names outside the blocks (embeddings, norms, LM head)."""
        prefix = f"{self.blocks_name}."
        return [self._key[c] for c in self._outside] + \
            [k for k in self._buffer_keys if not k.startswith(prefix)]

    def output_dtype(self, key: str) -> torch.dtype:
        """The dtype tensor ``key`` has in the model (what a saved model stores)."""
        canonical = self._canonical_of.get(key)
        if canonical is None:
            return self.model.get_buffer(key).dtype
        return self._parameter(canonical).dtype

    def weight_key(self, layer: str) -> str:
        """The checkpoint tensor name of layer ``layer``'s weight (full module name)."""
        return self._key[self._alias_of[f"{layer}.weight"]]

    # -- materialising --------------------------------------------------------------------

    def _load(self, canonicals: list[str], device: torch.device | str) -> None:
        values = self.files.read([self._key[c] for c in canonicals])
        self._check_finite({self._key[c]: values[self._key[c]] for c in canonicals})
        for canonical in canonicals:
            value = values.pop(self._key[canonical]).to(device=device, dtype=self._parameter(canonical).dtype)
            new = nn.Parameter(value, requires_grad=False)
            for module, attr in self._holders[canonical]:
                module._parameters[attr] = new

    def _release(self, canonicals: list[str]) -> None:
        for canonical in canonicals:
            old = self._parameter(canonical)
            new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False)
            for module, attr in self._holders[canonical]:
                module._parameters[attr] = new

    def load(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Read block ``index``'s parameters onto ``device``; returns the block."""
        self._load(self._block_params[index], device)
        _move_buffers(list(self.blocks[index].modules()), device)
        return self.blocks[index]

    def offload(self, index: int) -> None:
        """Move block ``index``'s parameters and buffers to the CPU, keeping their values
        (until :meth:`release`: the block's pruned weights are written first)."""
        self.blocks[index].to("cpu")

    def release(self, index: int) -> None:
        """Put block ``index``'s parameters back on the meta device."""
        self._release(self._block_params[index])
        _move_buffers(list(self.blocks[index].modules()), "cpu")

    def load_outside(self, device: torch.device | str = "cpu") -> None:
        """Read every parameter outside the blocks (embeddings, final norm, LM head)."""
        self._load(self._outside, device)
        _move_buffers(self._outside_modules(), device)

    def release_outside(self) -> None:
        """Put the parameters outside the blocks back on the meta device."""
        self._release(self._outside)
        _move_buffers(self._outside_modules(), "cpu")

    def _outside_modules(self) -> list[nn.Module]:
        prefix = f"{self.blocks_name}."
        return [m for n, m in self.model.named_modules()
                if n != self.blocks_name and not n.startswith(prefix)]

    @contextmanager
    def outside(self, device: torch.device | str = "cpu") -> Iterator[nn.Module]:
        """The modules outside the blocks loaded for the ``with`` body; yields the model."""
        try:
            self.load_outside(device)
            yield self.model
        finally:
            self.release_outside()

"""The whole pruned model sharded over the run's ranks for the global distillation pass
(:mod:`nmprune.stages.distillation`; docs/distributed.md "Global distillation"), on the
engine PyTorch ships for it: FSDP2 (``torch.distributed.fsdp.fully_shard``), NCCL on GPUs and
gloo on CPUs.

A copy of the model is built on the meta device, each decoder block and then the copy as a
whole are put under ``fully_shard`` on a one-dimensional mesh of every rank, and only then
is it given memory: each rank holds the rows ``r/R`` of every parameter in float32 (FSDP's
``Shard(0)``), and so the same share of the gradients FSDP's reduce-scatter leaves and of the
optimiser state :func:`~nmprune.reconstruct.fit_masked` builds on them. A block's parameters
are gathered whole, in the training dtype (FSDP's ``MixedPrecisionPolicy``), only while it
computes. The copy is filled block by block from the run's block source, one block whole in
memory at a time: a streamed model's blocks come from its checkpoint and its pruned weights
from the shards the run wrote (rank 0's :class:`~nmprune.streaming.ShardedWriter`, read by
every rank), an in-memory model's from itself. After training every pruned weight is
gathered whole again and written to the run's sink, block by block.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from ..memory import release_memory
from ..models import find_blocks
from ..reconstruct import FitOptions, local_part
from .sink import BlockSink
from .source import BlockSource


def sharded_options(options: FitOptions, ranks: int) -> FitOptions:
    """How the pass trains sharded over ``ranks``: every round takes one window from each
    rank for one step of their summed gradient (:func:`~nmprune.reconstruct.fit_masked`),
    so a step learns from ``ranks`` times the windows and an epoch has ``ranks`` times fewer
    steps; the learning rate grows by ``sqrt(ranks)``, the square-root rule for Adam on a
    batch ``ranks`` times larger (Malladi et al., arXiv 2205.10287; docs/distributed.md)."""
    return replace(options, lr=options.lr * ranks ** 0.5)


def _empty_copy(model: nn.Module) -> nn.Module:
    """``model``'s class built again from its configuration, float32 parameters on the meta
    device (buffers as the class computes them; the source's are copied in later)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        empty = type(model)(copy.deepcopy(model.config))
    empty.tie_weights()  # the meta context re-creates parameters, which unties them
    return empty.float().eval()


def _fill(params: Mapping[str, nn.Parameter], values: Mapping[str, Tensor]) -> None:
    """Copy each full tensor of ``values`` into this rank's rows of the parameter of its name
    (every rank holds the full values: no exchange)."""
    with torch.no_grad():
        for name, value in values.items():
            p = params[name]
            part = distribute_tensor(value.detach().to(p.device, p.dtype), p.device_mesh, p.placements,
                                     src_data_rank=None)
            local_part(p).copy_(part.to_local())


@contextmanager
def sharded_whole(source: BlockSource, sink: BlockSink, device: torch.device,
                  param_dtype: torch.dtype | None, offloaded: bool = False) -> Iterator[nn.Module]:
    """The whole pruned model, sharded over every rank of the default process group
    (module docstring), computing on ``device``, its blocks in ``param_dtype`` (None:
    float32); ``offloaded``, each rank's rows of the parameters and of their gradients wait
    in CPU memory between uses (FSDP2's ``CPUOffloadPolicy``; the training state built on
    them too, and each step runs there).
    On a normal exit every block's pruned layers are gathered whole and written to ``sink``
    (every rank takes part; a sink that does not write discards them)."""
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    model = _empty_copy(source.model)
    blocks_name, blocks = find_blocks(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offloaded else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # to_empty leaves them unset
    model.to_empty(device="cpu" if offloaded else device)
    params = dict(model.named_parameters())
    prefix = f"{blocks_name}."
    try:
        with torch.no_grad():
            with source.outside("cpu") as whole:
                given = dict(whole.named_buffers())
                for prefix_, module in model.named_modules():
                    for name, b in module._buffers.items():
                        if b is not None:  # on the compute device, offloaded or not (FSDP moves no buffer)
                            full = f"{prefix_}.{name}" if prefix_ else name
                            module._buffers[name] = given.get(full, buffers[full]).to(device)
                _fill(params, {n: p for n, p in whole.named_parameters() if not n.startswith(prefix)})
            for i in range(len(source)):
                with source.block(i, "cpu") as block:
                    values = {f"{prefix}{i}.{n}": p for n, p in block.named_parameters()}
                    values.update({f"{name}.weight": w for name, w in sink.read(i).items()})
                    _fill(params, values)
        yield model
        for i in range(len(source)):
            sink.write(i, {name: params[f"{name}.weight"].full_tensor() for name in source.layers(i)})
    finally:
        del model, params
        release_memory()

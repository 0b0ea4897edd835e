"""Load a local Hugging Face MoE checkpoint directory into a ``LeanMoEModel`` and its tokenizer.

What it does: validates the directory (config.json, safetensors weights, tokenizer files),
parses the config with ``transformers.AutoConfig`` (offline: ``local_files_only``), maps it to
the canonical spec, loads the tensors, and picks device/dtype defaults (CUDA + bf16 when a GPU is
present, CPU + fp32 otherwise). Every bad input raises ``PagedWeightError`` with the fix.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from pwformat.errors import PagedWeightError
from pwrun.data import missing_bundle_hint
from pwrun.model.checkpoint import load_weights
from pwrun.model.families import FAMILIES, UNSUPPORTED, CheckpointNames, spec_from_config
from pwrun.model.lean import LeanMoEModel
from pwrun.model.spec import ModelSpec
from pwrun.model.streamed import StreamedExperts

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; raises ``PagedWeightError`` for an unusable device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise PagedWeightError(f"unknown device '{device}': use auto, cpu or cuda[:N]") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PagedWeightError("--device cuda was asked for but no CUDA GPU is visible: use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> bf16 on CUDA, fp32 on CPU; else one of ``DTYPES``."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise PagedWeightError(f"unknown dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: CUDA, or a CPU with AVX512-BF16 or AMX (oneDNN's bf16
    GEMMs there run at twice the fp32 rate; elsewhere they are emulated, slower than fp32)."""
    if device.type != "cpu":
        return device.type == "cuda"
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private torch.cpu helpers: absent -> False
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def scoring_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype of offline scoring passes: ``"auto"`` -> bfloat16 (what the runtime serves in) where
    ``native_bf16``, else float32; else one of ``DTYPES``."""
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return resolve_dtype(dtype, device)


class _NonFinite(Exception):
    """NaN, Infinity or -Infinity in config.json (Python's json reads them; no config value may be one)."""


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


def read_config(model_dir: Path) -> Any:
    """The transformers config of ``model_dir`` (offline)."""
    if model_dir.exists() and not model_dir.is_dir():
        raise PagedWeightError(f"{model_dir} is a file, not a model directory: pass a local Hugging Face checkpoint "
                               "directory (config.json + *.safetensors + tokenizer files)")
    if not model_dir.is_dir():
        raise PagedWeightError(f"model directory {model_dir} does not exist: pass a local Hugging Face checkpoint "
                               "directory (config.json + *.safetensors + tokenizer files)"
                               + missing_bundle_hint(model_dir))
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        artifact = (model_dir / "manifest.json").is_file()  # a PagedWeight artifact where a checkpoint belongs
        raise PagedWeightError(f"{model_dir} has no config.json: it is not a Hugging Face checkpoint directory"
                               + (" (it is a PagedWeight artifact: pass it as --artifacts, and `pwcal verify` "
                                  "checks it)" if artifact else ""))
    restore = "restore config.json from the original checkpoint"
    try:
        text = cfg_path.read_text()
        if text.startswith("\ufeff"):  # some editors write one; transformers' config reader cannot read it
            raise PagedWeightError(f"{cfg_path} starts with a byte-order mark: save it as UTF-8 without one, or "
                                   f"{restore}")
        raw = json.loads(text, parse_constant=_no_constant)
    except _NonFinite as exc:
        raise PagedWeightError(f"{cfg_path} holds {exc}, not a number: {restore}") from None
    except json.JSONDecodeError as exc:
        raise PagedWeightError(f"{cfg_path} is not valid JSON ({exc.msg} at line {exc.lineno}): {restore}") from exc
    except UnicodeDecodeError:
        raise PagedWeightError(f"{cfg_path} is not UTF-8 text: restore config.json from the original checkpoint"
                               ) from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, or nesting too deep
        raise PagedWeightError(f"{cfg_path} is not a readable config ({type(exc).__name__}): restore config.json "
                               "from the original checkpoint") from None
    if not isinstance(raw, dict):
        raise PagedWeightError(f"{cfg_path} must hold a JSON object, not {type(raw).__name__}: {restore}")
    model_type = raw.get("model_type")

    if model_type is None:
        raise PagedWeightError(f"{cfg_path} has no model_type: add it (one of {', '.join(sorted(FAMILIES))}), or "
                               "restore config.json from the original checkpoint")

    if model_type in UNSUPPORTED or model_type not in FAMILIES:
        # fail before transformers, which may not know the type at all
        spec_from_config(type("Cfg", (), {"model_type": model_type})())

    if model_type not in CONFIG_MAPPING:
        raise PagedWeightError(f"transformers {transformers.__version__} does not know model_type '{model_type}' of "
                               f"{cfg_path}: upgrade transformers (pip install -U transformers)")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types (strict dataclass validation among them)
        raise PagedWeightError(f"{cfg_path} is malformed ({_root_cause(exc)}): fix it, or restore config.json from "
                               "the original checkpoint") from exc


def _root_cause(exc: BaseException) -> str:
    """The innermost cause of ``exc`` on one line (transformers wraps the useful message, e.g.
    ``num_hidden_layers (4) must be equal to the number of layer_types (2)``, in a validation error)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_spec(model_dir: Path) -> tuple[ModelSpec, CheckpointNames]:
    """Canonical spec of the checkpoint in ``model_dir`` without loading tensors; errors name its config file."""
    cfg = read_config(model_dir)
    try:
        return spec_from_config(cfg)
    except PagedWeightError as exc:
        text = str(exc)
        if not text.startswith("config.json"):
            raise
        raise PagedWeightError(str(Path(model_dir) / "config.json") + text.removeprefix("config.json")) from None


def load_model(model_dir: str | Path, device: str = "auto", dtype: str = "auto",
               experts: str = "load") -> LeanMoEModel:
    """Load the checkpoint in ``model_dir`` as a ``LeanMoEModel`` on ``device`` in ``dtype``.

    ``experts``: ``"load"`` every weight; ``"skip"`` all but the dense experts (serving an artifact: the pool
    holds AP experts); ``"stream"`` all but the dense experts, which the model then reads from the checkpoint one
    MoE layer at a time when it runs (``pwrun.model.streamed``: calibration within host memory).
    Raises ``PagedWeightError`` for a missing directory/config/weights, an unsupported family, or
    tensors that do not match the config.
    """
    if experts not in ("load", "skip", "stream"):
        raise ValueError(f"experts must be load, skip or stream, got {experts!r}")
    path = Path(model_dir)
    spec, names = load_spec(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    digest = experts != "load"  # what an artifact is served with: its checkpoint's weights are checked by digest
    if names.gemma4 and experts == "stream":
        experts = "load"  # Gemma-4's expert layout is read by its own loader only
    weights = load_weights(path, spec, names, dt, dev, "load" if experts == "load" else "skip", digest)
    return LeanMoEModel(spec, weights, StreamedExperts(path, spec, names, dt, dev) if experts == "stream" else None)


def check_token_ids(ids: list[int], vocab_size: int, tokenizer: Any, what: str) -> None:
    """Raise ``PagedWeightError`` if ``what``'s token ids reach past the model's ``vocab_size`` embedding rows: a
    tokenizer may add tokens (special ones) that its model never embeds."""
    bad = max(ids, default=-1)
    if bad >= vocab_size:
        token = tokenizer.convert_ids_to_tokens(bad) if hasattr(tokenizer, "convert_ids_to_tokens") else None
        raise PagedWeightError(f"{what} holds token id {bad} ({token!r}), which the tokenizer adds but the model does "
                               f"not embed (ids 0..{vocab_size - 1}): remove that text from it")


# tokenizer -> characters of its longest token (weak keys: a tokenizer's figure goes with it)
_TOKEN_CHARS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest token (64 if it cannot say): a text longer than the context times
    this cannot fit the context, whatever it tokenizes to."""
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):  # not yet measured, or a tokenizer that cannot be weakly referenced
        pass
    try:
        toks = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        n = max(max(len(t or "") for t in toks), 1)
    except Exception:  # a tokenizer without the vocabulary API
        n = 64
    try:
        _TOKEN_CHARS[tokenizer] = n
    except TypeError:
        pass
    return n


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer (``transformers.AutoTokenizer``, offline).

    Raises ``PagedWeightError`` for a missing directory or tokenizer, or a malformed config.json (which
    ``AutoTokenizer`` parses too: it is checked first so the error names the file).
    """
    path = Path(model_dir)
    read_config(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise PagedWeightError(f"no tokenizer in {path} (tokenizer.json, tokenizer.model or vocab.json): copy the "
                               "model's tokenizer files into the checkpoint directory")

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # like AutoConfig, it raises many types for bad files
        raise PagedWeightError(f"cannot load the tokenizer in {path} ({_root_cause(exc)}): restore the model's "
                               "tokenizer files (tokenizer.json, tokenizer_config.json)") from exc
    rows = load_spec(path)[0].vocab_size  # ordinary text must map to rows of the embedding (added tokens may not)
    if isinstance(getattr(tok, "vocab_size", None), int) and tok.vocab_size > rows:
        raise PagedWeightError(f"the tokenizer in {path} has {tok.vocab_size} tokens but the model embeds only {rows} "
                               "(config.json vocab_size): it belongs to another model; copy this model's tokenizer "
                               "files into the checkpoint directory")
    return tok

"""Calibration token windows from real text, sampled reproducibly.

What it does: reads documents (bundled ``c4-calib`` by default, a local json/jsonl/json.gz/
parquet/txt file, or ``allenai/c4`` through ``datasets`` for users who are online), shuffles
them with a seed, joins them with the EOS token, tokenizes and cuts consecutive windows of
``seq_len`` tokens. ``skip`` windows are passed over first, so later stages can take prompts
held apart from those an earlier stage used. It does not run the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pwformat.errors import PagedWeightError
from pwrun.data import read_documents
from pwrun.model.loader import check_token_ids

HUB_C4 = "allenai/c4"


def _hub_documents(name: str, limit: int) -> list[str]:
    try:
        from datasets import load_dataset  # optional dependency, online use only
    except ImportError as exc:
        raise PagedWeightError(f"--calib {name} needs the 'datasets' package (pip install datasets), or use a "
                               "local file / the bundled c4-calib") from exc
    try:
        ds = load_dataset(name, "en", split="validation", streaming=True)
        return [row["text"] for _, row in zip(range(limit), ds, strict=False)]
    except Exception as exc:  # datasets raises many types when offline
        raise PagedWeightError(f"cannot stream {name} ({type(exc).__name__}): you may be offline; use the bundled "
                               "c4-calib or a local file") from exc


def calibration_windows(tokenizer: Any, dataset: str = "c4-calib", samples: int = 64, seq_len: int = 512,
                        seed: int = 0, skip: int = 0, flags: str = "--samples or --seq-len",
                        vocab_size: int | None = None) -> list[list[int]]:
    """``samples`` windows of ``seq_len`` token ids each, after skipping ``skip`` windows.

    Raises ``PagedWeightError`` if the dataset holds fewer than ``skip + samples`` windows; the message tells the
    user to lower ``flags`` (the caller's options that set samples / skip); or, given the model's ``vocab_size``,
    if a window holds a token the tokenizer adds but the model does not embed.
    """
    if samples < 1 or seq_len < 2:
        raise PagedWeightError("--samples must be >= 1 and --seq-len >= 2")
    need = (skip + samples) * seq_len
    docs = _hub_documents(dataset, 4 * need // 400 + 100) if dataset == HUB_C4 else read_documents(dataset)
    order = np.random.default_rng(seed).permutation(len(docs))
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for i in order:
        ids.extend(tokenizer(docs[i], add_special_tokens=False, verbose=False).input_ids)
        if eos is not None:
            ids.append(int(eos))
        if len(ids) >= need:
            break
    have = len(ids) // seq_len
    if have < skip + samples:
        raise PagedWeightError(f"{dataset} gives {have} windows of {seq_len} tokens, fewer than the "
                               f"{skip + samples} needed: lower {flags}, or give more text")
    windows = [ids[(skip + j) * seq_len:(skip + j + 1) * seq_len] for j in range(samples)]
    if vocab_size is not None:
        check_token_ids([t for w in windows for t in w], vocab_size, tokenizer, f"the calibration text {dataset}")
    return windows

"""Prepare the training corpus of the tiny MoE: clean text, train a BPE tokenizer, pre-tokenize.

What it does: reads the English Wikipedia subset (a tar.gz of ``Page/<Title>.md`` articles),
removes ``[n]`` citation marks, trains a byte-level BPE tokenizer with ``tokenizers`` on the
same text, and writes the token ids of every article as one ``uint16`` array (articles joined
by the EOS token) plus a small held-out split. It does not train the model
(``tools/train_tiny_moe.py`` does, on the GPU machine).

WikiText-2 and C4 are never read here: they are kept for calibration and evaluation.

Usage::

    python tools/prepare_corpus.py --tar PATH/wikipedia.abstract.en-Page-subset.tar.gz \
        --out .data/corpus --tokenizer-out .data/tokenizer --vocab-size 4096

Retraining the bundled model keeps its tokenizer: add
``--tokenizer artifacts/models/tiny-qwen2moe-wiki/tokenizer.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tarfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CITATION = re.compile(r"\[\d+\]")
EOS = "<|endoftext|>"


def read_articles(tar_path: Path) -> list[tuple[str, str]]:
    """Return ``(path, cleaned text)`` for every ``.md`` member of the tar, sorted by path."""
    out = []
    with tarfile.open(tar_path, "r:gz") as tar:
        for member in tar:
            if not member.isfile() or not member.name.endswith(".md"):
                continue
            f = tar.extractfile(member)
            assert f is not None
            text = CITATION.sub("", f.read().decode("utf-8", errors="replace"))
            text = re.sub(r"\n{3,}", "\n\n", text).strip()
            if text:
                out.append((member.name, text))
    out.sort()
    return out


def is_heldout(path: str, fraction: float) -> bool:
    """Deterministic split by the sha256 of the member path."""
    h = int(hashlib.sha256(path.encode()).hexdigest()[:8], 16)
    return h < fraction * 0xFFFFFFFF


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tar", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="reuse this tokenizer.json (e.g. the bundled model's) instead of training one")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--heldout-fraction", type=float, default=0.01)
    args = ap.parse_args()

    articles = read_articles(args.tar)
    print(f"{len(articles)} articles, {sum(len(t) for _, t in articles) / 1e6:.1f} M chars")
    if args.tokenizer is not None:
        tok = Tokenizer.from_file(str(args.tokenizer))
    else:
        tok = train_tokenizer([t for _, t in articles], args.vocab_size)
    eos_id = tok.token_to_id(EOS)

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=None, pad_token=EOS,
                                     unk_token=None, model_max_length=4096)
    args.tokenizer_out.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(args.tokenizer_out)

    args.out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[np.ndarray]] = {"train": [], "heldout": []}
    texts = [t for _, t in articles]
    encs = tok.encode_batch(texts)
    for (path, _), enc in zip(articles, encs, strict=True):
        ids = np.asarray([*enc.ids, eos_id], dtype=np.uint16)
        splits["heldout" if is_heldout(path, args.heldout_fraction) else "train"].append(ids)
    stats = {}
    for name, parts in splits.items():
        arr = np.concatenate(parts)
        np.save(args.out / f"{name}.npy", arr)
        stats[name] = {"articles": len(parts), "tokens": int(arr.size)}
    stats["vocab_size"] = tok.get_vocab_size()
    stats["eos_id"] = eos_id
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()

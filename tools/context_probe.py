"""How far the bundled tiny MoE really uses its context: perplexity by position and copying by distance.

Usage: ``python tools/context_probe.py [--windows 48] [--model DIR]`` (CPU, a few minutes). Prints two
markdown tables: WikiText-2 perplexity by token position inside 2048-token windows (the model was trained on
2048-token sequences), and the mean NLL of a 32-token WikiText-2 span seen a second time after a
gap of unrelated text, against the span without its first occurrence (induction / copying).
These numbers set the long suite's context length (``pweval/retrieval.py``, ``docs/eval/README.md``).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pwrun.data import default_model_dir, read_text
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.runner.prefill import prefill_logits


def token_nll(model, ids: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """[len(ids) - 1] NLL (nats) of each next token."""
    logits = prefill_logits(model, [ids])[:-1].float()
    return -torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    args = ap.parse_args()
    model_dir = args.model or default_model_dir()
    tok, model = load_tokenizer(model_dir), load_model(model_dir, device="cpu")
    ids = tok(read_text("wikitext2"), add_special_tokens=False, verbose=False).input_ids
    length = 2048
    nll = np.mean([token_nll(model, ids[w * length:(w + 1) * length]) for w in range(args.windows)], axis=0)
    print(f"| positions | WikiText-2 ppl ({args.windows} windows of {length}) |\n|---|---|")
    for a, b in [(0, 64), (64, 256), (256, 512), (512, 768), (768, 1024), (1024, 1536), (1536, 2047)]:
        print(f"| {a}-{b} | {np.exp(nll[a:b].mean()):.1f} |")
    span = 32
    print(f"\n| gap (tokens) | NLL of a {span}-token span seen before | without it |\n|---|---|---|")
    for gap in (0, 32, 100, 200, 400):
        seen, unseen = [], []
        for w in range(12):
            x = ids[5000 + w * 997: 5000 + w * 997 + span]
            filler = ids[200_000 + w * 1000: 200_000 + w * 1000 + gap]
            lead = ids[300_000 + w * 500: 300_000 + w * 500 + 16]
            seen.append(token_nll(model, lead + x + filler + x)[-(span - 1):].mean())
            unseen.append(token_nll(model, lead + filler + x)[-(span - 1):].mean())
        print(f"| {gap} | {np.mean(seen):.2f} | {np.mean(unseen):.2f} |")


if __name__ == "__main__":
    main()

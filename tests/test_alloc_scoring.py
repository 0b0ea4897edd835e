"""Batched scoring of expert-bit allocations (``pwcal.alloc_scoring``) equals one model per allocation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pwcal.alloc_scoring import allocation_bits, score_allocations
from pwformat.tables import read_table
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_model
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.data import default_model_dir
from pwrun.model.loader import load_model
from pwrun.ppl import perplexity


@pytest.fixture(scope="module")
def parts(calibrated_artifacts: Path):  # type: ignore[no-untyped-def]
    table = BlockTable.from_frames(read_table(calibrated_artifacts / "sensitivity.parquet", "sensitivity"),
                                   read_table(calibrated_artifacts / "routing.parquet", "routing"))
    art = APArtifact(calibrated_artifacts)
    return art, load_model(default_model_dir(), device="cpu", dtype="float32"), table


def _allocations(art: APArtifact, table: BlockTable) -> list[np.ndarray]:
    """Random bits, plus allocations that agree with the first on layers 0-1 (shared prefixes), differ from it
    only in one shared-expert block, and repeat it."""
    rng = np.random.default_rng(0)
    qs = [rng.choice(art.bits, size=len(table.layer)) for _ in range(3)]
    late = qs[0].copy()
    late[table.layer >= 2] = rng.choice(art.bits, size=int((table.layer >= 2).sum()))
    shared = qs[0].copy()
    i = int(np.flatnonzero(table.expert == -1)[0])
    shared[i] = art.bits[0] if shared[i] != art.bits[0] else art.bits[-1]
    return [*qs, late, shared, qs[0].copy()]


def _reference(art: APArtifact, base, table: BlockTable, q: np.ndarray, windows: list[list[int]]) -> np.ndarray:  # type: ignore[no-untyped-def]
    bits = {(int(la), int(e), UNITS[u]): int(b) for la, e, u, b in zip(table.layer, table.expert, table.unit, q,
                                                                         strict=True)}
    flat = [t for w in windows for t in w]
    return np.array(perplexity(dense_model(art, base, bits), flat, seq_len=len(windows[0])).window_nll)


def test_batched_scores_equal_one_model_per_allocation(parts) -> None:  # type: ignore[no-untyped-def]
    art, base, table = parts
    qs = _allocations(art, table)
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, base.spec.vocab_size, (40,), generator=g).tolist() for _ in range(3)]
    ref = np.stack([_reference(art, base, table, q, windows) for q in qs])
    ticks: list[tuple[int, int]] = []
    one_step = score_allocations(art, base, table, qs, windows, progress=lambda d, t: ticks.append((d, t)))
    np.testing.assert_allclose(one_step, ref, rtol=0, atol=2e-5)
    n_layers = len(base.spec.layers)  # one pass: a tick per layer, its 18 sequences counted in proportion
    assert ticks == [(18 * la // n_layers, 18) for la in range(1, n_layers + 1)]
    assert np.array_equal(one_step[0], one_step[5])  # the repeat shares every row with the first
    # steps of 2 sequences (allocations split across steps) and a weight cache that keeps one tensor
    small = score_allocations(art, base, table, qs, windows, max_step_tokens=80, cache_bytes=1,
                              progress=lambda d, t: ticks.append((d, t)))
    np.testing.assert_allclose(small, ref, rtol=0, atol=2e-5)
    done = [d for d, _ in ticks[n_layers:]]
    assert ticks[-1] == (18, 18) and len(done) == 9 * n_layers and done == sorted(done)


def _tree(art: APArtifact, table: BlockTable, rng: np.random.Generator) -> list[np.ndarray]:
    """Allocations that split at every depth: one random allocation, siblings that each change one block of the
    last layer (several children of one parent with equal bits for most experts), a branch that changes a block of
    layer 1 and then one of layer 2, and a child that changes only a shared-expert block of the last layer."""
    last, root = int(table.layer.max()), rng.choice(art.bits, size=len(table.layer))

    def change(q: np.ndarray, rows: np.ndarray) -> np.ndarray:
        q = q.copy()
        i = int(rng.choice(rows))
        q[i] = int(rng.choice([b for b in art.bits if b != q[i]]))
        return q

    late = np.flatnonzero((table.layer == last) & (table.expert >= 0))
    siblings = [change(root, late) for _ in range(3)]
    mid = change(root, np.flatnonzero(table.layer == 1))
    deeper = change(mid, np.flatnonzero(table.layer == 2))
    shared = change(siblings[0], np.flatnonzero((table.layer == last) & (table.expert == -1)))
    return [root, *siblings, mid, deeper, shared]


def test_ragged_windows_and_passes_equal_one_model_per_allocation(parts) -> None:  # type: ignore[no-untyped-def]
    art, base, table = parts
    rng = np.random.default_rng(3)
    qs = [*_tree(art, table, rng), rng.choice(art.bits, size=len(table.layer))]
    g = torch.Generator().manual_seed(2)
    windows = [torch.randint(0, base.spec.vocab_size, (37,), generator=g).tolist() for _ in range(3)]
    ref = np.stack([_reference(art, base, table, q, windows) for q in qs])
    # one pass of every sequence, and passes of 5 sequences (allocation groups that cut the tree)
    for step_tokens in (1 << 16, 5 * 37):
        got = score_allocations(art, base, table, qs, windows, max_step_tokens=step_tokens)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)
    assert not np.allclose(ref[0], ref[1], rtol=0, atol=1e-6)  # the changed blocks change the scores


def test_prefix_classes_follow_the_earlier_layers(parts) -> None:  # type: ignore[no-untyped-def]
    art, _, table = parts
    qs = _allocations(art, table)
    bits, prefix = allocation_bits(table, qs)
    assert (prefix[:, 0] == 0).all()  # every allocation enters layer 0 with the same states
    for a in range(len(qs)):
        for b in range(len(qs)):
            for la in range(prefix.shape[1]):
                same = np.array_equal(bits[a, :la], bits[b, :la])
                assert (prefix[a, la] == prefix[b, la]) == same
    assert prefix[3, 2] == prefix[0, 2] and prefix[3, 3] != prefix[0, 3]


def test_bf16_scores_equal_bf16_models_and_track_fp32(parts) -> None:  # type: ignore[no-untyped-def]
    """In bfloat16 (search-buckets' dtype where the device multiplies it natively) the batched scores equal one
    bf16 model per allocation, and stay near the fp32 scores (random tokens: the hardest case for rounding)."""
    art, base32, table = parts
    base16 = load_model(default_model_dir(), device="cpu", dtype="bfloat16", experts="skip")
    rng = np.random.default_rng(5)
    qs = [*_tree(art, table, rng), rng.choice(art.bits, size=len(table.layer))]
    g = torch.Generator().manual_seed(4)
    windows = [torch.randint(0, base16.spec.vocab_size, (45,), generator=g).tolist() for _ in range(3)]
    full16 = load_model(default_model_dir(), device="cpu", dtype="bfloat16")  # dense_model replaces its experts
    ref16 = np.stack([_reference(art, full16, table, q, windows) for q in qs])
    got = score_allocations(art, base16, table, qs, windows, max_step_tokens=4 * 45)
    np.testing.assert_allclose(got, ref16, rtol=0, atol=2e-3)
    ref32 = np.stack([_reference(art, base32, table, q, windows) for q in qs])
    assert np.abs(got - ref32).max() < 0.1 and not np.allclose(got, ref32, rtol=0, atol=1e-6)

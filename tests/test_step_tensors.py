"""``StepTensors.build`` against the chunks it packs, and the 16-byte alignment of every tensor a step hands the
kernels (Triton compiles one variant per pointer alignment: an alignment that followed the token count would
compile inside a run)."""

from __future__ import annotations

import torch

from pwrun.core.decision import ScheduledChunk
from pwrun.model.step import StepTensors
from pwrun.runner.decode_inputs import DecodeInputs
from pwrun.runner.kv_store import PooledKVCache


def _chunks(lengths: list[tuple[int, int]]) -> list[ScheduledChunk]:
    """(start, new tokens) per sequence; block tables of ragged widths."""
    out = []
    for i, (start, n) in enumerate(lengths):
        nb = -(-(start + n) // 4)
        table = tuple(range(10 * i, 10 * i + nb))
        out.append(ScheduledChunk(rid=i, token_ids=tuple(range(100 * i, 100 * i + n)), start=start,
                                  slots=tuple(table[(start + j) // 4] * 4 + (start + j) % 4 for j in range(n)),
                                  block_table=table))
    return out


def test_build_packs_every_chunk_and_aligns_every_section() -> None:
    for lengths in ([(0, 5)], [(0, 3), (7, 1), (2, 6)], [(4, 1)] * 3, [(0, 2), (9, 1)]):
        chunks = _chunks(lengths)
        st = StepTensors.build(chunks, "cpu")
        assert st.tokens.tolist() == [t for c in chunks for t in c.token_ids]
        assert st.positions.tolist() == [c.start + j for c in chunks for j in range(len(c.token_ids))]
        assert st.slots.tolist() == [s for c in chunks for s in c.slots]
        assert st.context_lens == st.context_lens_t.tolist() == [c.end for c in chunks]
        assert st.query_start_t.tolist() == st.query_start
        assert st.max_query_len == max(n for _, n in lengths)
        width = max(len(c.block_table) for c in chunks)
        for c, row, bt in zip(chunks, st.padded_tables.tolist(), st.block_tables, strict=True):
            assert row == list(c.block_table) + [0] * (width - len(c.block_table))
            assert bt.tolist() == list(c.block_table)
        for t in (st.tokens, st.positions, st.slots, st.padded_tables, st.context_lens_t, st.query_start_t):
            assert t.data_ptr() % 16 == 0


def test_each_layers_kv_tables_start_aligned() -> None:
    """The per-layer K/V page tables of a step (``_tables``) start on 16-byte boundaries for odd S x width."""
    layers, bs, hkv, d = 3, 4, 2, 8
    blocks = 32
    pages = 2 * layers * blocks
    cache = PooledKVCache(torch.zeros(pages * bs * hkv * d * 2, dtype=torch.uint8), layers, blocks, bs, hkv, d,
                          torch.bfloat16, use_kernel=True)
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).tolist()  # pages anywhere in the pool
    cache.map_blocks(tuple((b, tuple(perm[2 * layers * b: 2 * layers * (b + 1)])) for b in range(blocks)))
    st = StepTensors.build(_chunks([(0, 3), (7, 1), (2, 7)]), "cpu")  # S = 3, width 3: 9 entries per layer
    cache.begin_step(st)
    for layer in range(layers):
        kt, vt = cache._tables(layer, st)
        assert kt.data_ptr() % 16 == 0 and vt.data_ptr() % 16 == 0
        bt = st.padded_tables.long()
        assert torch.equal(kt.long(), cache.unit[2 * layer][bt])
        assert torch.equal(vt.long(), cache.unit[2 * layer + 1][bt])


def test_decode_inputs_equal_the_built_step_on_ragged_tables() -> None:
    """A captured graph's static inputs (``DecodeInputs.load``, one copy) hold what ``StepTensors.build`` gives for
    the same decode chunks, with the block tables zero-padded to the graph's width; a later load with shorter
    tables leaves no column of the earlier one behind."""
    width = 6
    inputs = DecodeInputs(3, width, torch.device("cpu"))
    assert not DecodeInputs.fits(_chunks([(0, 2), (5, 1), (1, 1)]), width)  # a prefill chunk
    assert not DecodeInputs.fits(_chunks([(30, 1), (5, 1), (1, 1)]), width)  # 8 blocks > 6 columns
    for lengths in ([(17, 1), (3, 1), (9, 1)], [(0, 1), (22, 1), (4, 1)], [(1, 1), (2, 1), (3, 1)]):
        chunks = _chunks(lengths)
        assert DecodeInputs.fits(chunks, width)
        got, ref = inputs.load(chunks), StepTensors.build(chunks, "cpu")
        for a, b in ((got.tokens, ref.tokens), (got.positions, ref.positions), (got.slots, ref.slots),
                     (got.context_lens_t, ref.context_lens_t)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert ref.padded_tables is not None and got.padded_tables is not None
        padded = torch.zeros(3, width, dtype=torch.int32)
        padded[:, : ref.padded_tables.shape[1]] = ref.padded_tables
        assert torch.equal(got.padded_tables, padded)
        assert got.last_token_index.tolist() == ref.last_token_index.tolist() == [0, 1, 2]
        for t in (got.tokens, got.positions, got.slots, got.padded_tables, got.context_lens_t):
            assert t.data_ptr() % 16 == 0

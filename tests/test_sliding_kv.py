"""KV blocks of models with sliding-window layers, in the engine core without a model (no torch).

``KVLayout``: how a block's pages split over layers of different widths. The core with a fake executor: after each
step every block wholly before a running sequence's window holds only its global layers' pages (the sliding ones
went back to the pool), the others all of theirs; pages are conserved through admissions, preemptions under a
small pool and finishes; and what trims give back is free for the next blocks (the pool never needs more than the
window's worth of sliding pages per sequence).
"""

from __future__ import annotations

import pytest

from pwformat.kv_layout import KVLayout
from pwrun.core.config import EngineConfig
from pwrun.core.engine_core import EngineCore
from pwrun.core.pool import KV, PagePool, PoolConfig
from pwrun.core.request import Request, SamplingParams

BS, WINDOW = 4, 6
LAYOUT = KVLayout((64, 32, 64, 64, 32), (WINDOW, None, WINDOW, WINDOW, None))  # 3 sliding, 2 half-width global


def test_layout() -> None:
    assert KVLayout.uniform(3).pages_per_block == 6 and KVLayout.uniform(3).window is None
    assert [LAYOUT.layer_pages(i) for i in range(5)] == [2, 1, 2, 2, 1] and LAYOUT.pages_per_block == 8
    assert LAYOUT.offsets == (0, 2, 3, 5, 7, 8) and LAYOUT.sliding_pages == (0, 1, 3, 4, 5, 6)
    pages = [10, 11, 12, 13, 14, 15, 16, 17]
    assert LAYOUT.units(1, pages) == (24, 25) and LAYOUT.units(2, pages) == (13, 14)  # sub-pages / pages
    assert LAYOUT.page_bytes(BS, 2) == BS * 64 * 2 and LAYOUT.window == WINDOW
    assert LAYOUT.read_bytes(100, 2) == 2 * 2 * (3 * 64 * WINDOW + 2 * 32 * 100)
    assert LAYOUT.max_blocks(100) == 50  # trimmed blocks keep 2 pages
    with pytest.raises(ValueError, match="divide"):
        KVLayout((64, 48), (None, None))


def _run(pages: int, prompts: list[int], new: int) -> tuple[EngineCore, int]:
    core = EngineCore(EngineConfig(block_size=BS, max_batch=3, max_step_tokens=8), PagePool(PoolConfig(pages, 64)),
                      LAYOUT)
    for rid, n in enumerate(prompts):
        core.add_request(Request(rid, tuple(range(1, n + 1)), SamplingParams(max_new_tokens=new)))
    kept = LAYOUT.pages_per_block - len(LAYOUT.sliding_pages)
    trims = 0
    while not core.idle:
        d = core.step()
        core.update(d, [(c.rid * 7 + c.end) % 50 + 60 if c.last else None for c in d.chunks], [None] * len(d.chunks))
        trims += core.trimmed_blocks
        core.check()
        for s in core.scheduler.running:
            table = core.tables.table(s.rid)
            behind = max(0, s.computed - WINDOW + 1) // BS
            assert [core.alloc.trimmed(b) for b in table] == [j < behind for j in range(len(table))]
        held = sum(len(core.tables.table(s.rid)) for s in core.scheduler.running)
        sliding = core.alloc.sliding_kv_pages
        assert core.pool.count(KV) == held * kept + sliding
    assert core.pool.count(KV) == 0 and core.alloc.num_used == 0
    return core, trims


def test_blocks_out_of_the_window_give_back_their_sliding_pages() -> None:
    core, trims = _run(pages=400, prompts=[17, 3, 9], new=20)
    assert trims > 0 and core.scheduler.preemptions == 0
    # every block of every request lies before its window at the end, except the last ones
    assert core.alloc.trimmed_pages == trims * len(LAYOUT.sliding_pages)


def test_a_pool_too_small_for_whole_blocks_serves_long_sequences() -> None:
    """A 52-token sequence needs 13 whole blocks (104 pages) without trimming; 60 pages serve it (the sliding
    pages that trims free are taken by the next blocks), and three of them share the pool by preemption."""
    core, trims = _run(pages=60, prompts=[12], new=40)
    assert trims == 52 // BS - 2 and len(core.output(0).token_ids) == 40
    core, trims = _run(pages=60, prompts=[12, 5, 12], new=40)
    assert core.scheduler.preemptions > 0 and all(len(core.output(r).token_ids) == 40 for r in range(3))


def test_a_prompt_longer_than_whole_blocks_fit_is_admitted() -> None:
    """A 60-token prompt needs 15 whole blocks (120 pages); admitted for the pages it holds at most while prefilled
    8 tokens a step (whole blocks for the window and the next chunk, global pages behind: ``peak_pages``), it runs
    in 64 pages."""
    assert LAYOUT.peak_pages(60, BS, 8) == 5 * 8 + 10 * 2 and LAYOUT.peak_pages(9, BS, 8) == 3 * 8
    assert KVLayout.uniform(2).peak_pages(60, BS, 8) == 15 * 4
    assert LAYOUT.peak_blocks(60, BS, 8) == 8 and LAYOUT.peak_blocks(9, BS, 8) == 3  # 60 pages: 7.5 blocks of 8
    core, trims = _run(pages=64, prompts=[60], new=5)
    assert trims > 0 and len(core.output(0).token_ids) == 5

"""The Triton paged-decode kernel over the runtime's pooled KV cache (K and V pages placed independently).

Keys/values are written through ``PooledKVCache.write`` exactly as the model does, with blocks from
the shared page pool after weight runs fragmented it; the kernel (separate K and V tables) must
match dense attention over the cache's own ``gather`` (the reference path), on ragged lengths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pwformat.cost import kv_page_bytes
from pwkernels.paged_attention import paged_decode_attention
from pwrun.core.kv_blocks import BlockTables, PooledBlockAllocator
from pwrun.core.pool import WEIGHT, PagePool, PoolConfig
from pwrun.runner.kv_store import PooledKVCache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_on_pooled_cache_matches_gather_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    layers, bs, hkv, hq, d = 3, 8, 2, 4, 64
    page = kv_page_bytes(bs, hkv, d, dtype.itemsize)
    pool = PagePool(PoolConfig(200, page))
    runs = [pool.allocate_run(n, WEIGHT) for n in (3, 5, 2, 7)]
    pool.release_run(runs[1], 5, WEIGHT)  # a hole between weight runs: KV pages land anywhere
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, the compiled kernel on GPU
    memory = torch.full((200 * page,), 255, dtype=torch.uint8, device=dev)  # NaN poison outside written rows
    alloc = PooledBlockAllocator(pool, layers)
    cache = PooledKVCache(memory, layers, alloc.max_blocks, bs, hkv, d, dtype)
    tables = BlockTables(alloc, bs)
    lens = [1, bs - 1, bs, 3 * bs + 5, 29]
    for s, n in enumerate(lens):
        tables.reserve(s, n)
    cache.map_blocks(tuple((b, tuple(alloc.pages(b))) for b in alloc.new_blocks))
    for layer in range(layers):
        for s, n in enumerate(lens):
            slots = torch.tensor(tables.slots(s, 0, n), device=dev)
            cache.write(layer, slots, torch.randn(n, hkv, d, generator=g).to(dtype).to(dev),
                        torch.randn(n, hkv, d, generator=g).to(dtype).to(dev))
    width = max(len(tables.table(s)) for s in range(len(lens)))
    bt = torch.tensor([tables.table(s) + [0] * (width - len(tables.table(s))) for s in range(len(lens))], device=dev)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype).to(dev)
    for layer in range(layers):
        kt, vt = cache.layer_tables(layer, bt)
        out = paged_decode_attention(q, cache.pages, cache.pages, kt.to(torch.int32), torch.tensor(lens,
                                     dtype=torch.int32, device=dev), d**-0.5, v_block_tables=vt.to(torch.int32))
        for s, n in enumerate(lens):
            k, v = cache.gather(layer, torch.tensor(tables.table(s), device=dev), n)
            ref = F.scaled_dot_product_attention(q[s:s + 1].float().transpose(0, 1), k.float().transpose(0, 1)
                                                 .repeat_interleave(hq // hkv, 0), v.float().transpose(0, 1)
                                                 .repeat_interleave(hq // hkv, 0), scale=d**-0.5).transpose(0, 1)
            err = (out[s].float() - ref[0]).abs().max().item()
            assert err <= 4 * torch.finfo(dtype).eps * ref.abs().max().item() + 1e-3, (layer, s, err)

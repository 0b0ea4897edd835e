"""The engine core without a model: requests in and out, KV blocks, demotion and reload policy (no torch).

A fake executor stands in for the model runner: it "samples" a token that depends only on the request and its
length, reports every reload batch complete at the next step, and checks what a runner relies on (chunks are the
requests' next tokens at reserved slots, new KV blocks come with their pool pages, weight moves name the blocks
whose page table changed).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pwrun.core.config import EngineConfig
from pwrun.core.decision import StepDecision, WeightMoves
from pwrun.core.engine_core import EngineCore
from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.runtime import Planner, PlannerConfig
from pwrun.core.planner.tables import BlockTable
from pwrun.core.pool import KV, PagePool, PoolConfig
from pwrun.core.request import Request, RequestOutput, SamplingParams
from pwrun.core.weight_table import WeightPageTable

PAGE = 64
BITS = np.arange(3, 9)


def test_core_imports_neither_torch_nor_pandas() -> None:
    code = ("import sys, pkgutil, importlib, pwrun.core\n"
            "for m in pkgutil.walk_packages(pwrun.core.__path__, 'pwrun.core.'):\n"
            "    importlib.import_module(m.name)\n"
            "bad = sorted(k for k in ('torch', 'pandas', 'triton') if k in sys.modules)\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _weights(n: int = 20, seed: int = 0) -> tuple[WeightPageTable, BlockTable]:
    """n blocks of 2 pages per plane and a 2^b / 16-page LUT (at least 1), and the planner's table of the same bytes."""
    rng = np.random.default_rng(seed)
    plane_pages = np.full(n, 2)
    lut_pages = np.zeros((n, 9), np.int64)
    lut_pages[:, BITS] = np.maximum(1, 2 ** BITS // 64)
    wpt = WeightPageTable(BITS.tolist(), plane_pages, lut_pages)
    sens = np.sort(rng.gamma(1.0, 1.0, (n, BITS.size)) * rng.uniform(0.1, 10, (n, 1)), axis=1)[:, ::-1].copy()
    table = BlockTable(bits=BITS, layer=np.repeat(np.arange(n // 10), 10), expert=np.tile(np.arange(10), n // 10),
                       unit=np.zeros(n, np.int64), sens=sens,
                       bytes=np.stack([wpt.pages_at(int(b)) for b in BITS], axis=1) * PAGE,
                       tokens=np.full(n, 100), mass=rng.dirichlet(np.ones(n)))
    return wpt, table


def _core(pool_pages: int, start_bits: int = 6, planner: bool = True, **cfg: int) -> EngineCore:
    wpt, table = _weights()
    pool = PagePool(PoolConfig(pool_pages, PAGE))
    for i in range(wpt.n):
        wpt.place(pool, i, start_bits)
    p = Planner(table, BucketPolicy.neutral(3), PlannerConfig(overlapped=False)) if planner else None
    return EngineCore(EngineConfig(block_size=4, **cfg), pool, layout=1, weights=wpt, planner=p)


class FakeRunner:
    """Executes decisions on nothing; keeps what a runner would mirror."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.started: list[int] = []  # reload batches whose copies "run"
        self.lowered = self.committed = 0
        self.kv_pages: dict[int, tuple[int, ...]] = {}
        self.decisions: list[StepDecision] = []

    def apply(self, moves: WeightMoves) -> None:
        assert len(moves.lut_copies) == len(moves.lowered)  # one LUT rewrite per block lowered
        self.lowered += len(moves.lowered)
        self.committed += len(moves.committed)
        for r in moves.reloads:
            assert 0 < len(r.blocks) <= self.core.cfg.max_raise_blocks
            assert {o.block for o in r.orders} == set(r.blocks)
            self.started.append(r.batch)

    def step(self) -> list[RequestOutput]:
        core = self.core
        done, self.started = self.started, []
        d = core.step(done)
        self.decisions.append(d)
        for b, pages in d.new_kv_blocks:
            assert pages == tuple(core.alloc.pages(b)) and len(pages) == 2
            self.kv_pages[b] = pages
        self.apply(d.moves)
        for c in d.chunks:  # the chunk's tokens sit in reserved slots of its blocks, all mapped
            assert set(c.block_table) <= set(self.kv_pages)
            assert [s // 4 for s in c.slots] == [c.block_table[p // 4] for p in range(c.start, c.end)]
        tokens = [(c.rid * 31 + c.end) % 97 if c.last else None for c in d.chunks]
        outs = core.update(d, tokens, [None] * len(tokens))
        self.apply(core.take_moves())
        core.check()
        return outs

    def run(self) -> dict[int, RequestOutput]:
        final = {}
        while not self.core.idle:
            for o in self.step():
                final[o.rid] = o
        return final


def _requests(n: int, prompt: int, new: int, start: int = 0) -> list[Request]:
    return [Request(start + i, tuple(range(1 + i, 1 + i + prompt)), SamplingParams(max_new_tokens=new))
            for i in range(n)]


def test_kv_pressure_demotes_then_reloads_and_every_request_completes() -> None:
    core = _core(300, max_batch=4, max_step_tokens=64, max_raise_blocks=3)
    q0 = core.wpt.q.copy()  # type: ignore[union-attr]
    runner = FakeRunner(core)
    for r in _requests(4, 30, 12):
        core.add_request(r)
    outs = runner.run()
    assert sorted(outs) == [0, 1, 2, 3]
    for rid, o in outs.items():  # the fake executor's tokens, every one, in order
        assert o.finish == "length" and o.token_ids == tuple((rid * 31 + 30 + k) % 97 for k in range(12))
    w = core.weights
    assert w is not None and core.wpt is not None
    assert w.demoted_blocks == runner.lowered > 0  # 4 x 11 KV blocks do not fit beside the experts at 6 bits
    assert w.promoted_blocks == runner.committed > 0  # once they finished, planes came back
    assert (core.wpt.q >= BITS[0]).all() and (core.wpt.q <= q0).all()  # within the floors, never above the start
    assert core.pool.count(KV) == 0 and core.alloc.num_used == 0


@pytest.mark.parametrize("reserve", [None, 8])
def test_the_reload_reserve_sets_how_far_ahead_reloads_leave_room(reserve: int | None) -> None:
    """Demotion frees room for the next 32 tokens of each request; with ``reload_reserve_tokens`` 8 the planes
    come back into what lies beyond the next 8 tokens while the requests run; with None only into what no running
    request can ever take, so not before one finishes. Every token comes out and nothing is preempted."""
    core = _core(300, max_batch=4, max_step_tokens=64, reload_reserve_tokens=reserve)  # type: ignore[arg-type]
    runner = FakeRunner(core)
    for r in _requests(4, 30, 40):
        core.add_request(r)
    w = core.weights
    assert w is not None
    promoted_at_first_demotion = promoted_while_all_ran = -1
    while not core.idle:
        outs = runner.step()
        if w.demoted_blocks and promoted_at_first_demotion < 0:
            promoted_at_first_demotion = w.promoted_blocks
        if len(core.scheduler.running) == 4 and not any(o.finish for o in outs):
            promoted_while_all_ran = w.promoted_blocks
    assert w.demoted_blocks > 0 and core.scheduler.preemptions == 0
    raised_back = promoted_while_all_ran - promoted_at_first_demotion  # after the KV peak, while all 4 ran
    assert (raised_back > 0) == (reserve is not None)
    assert w.promoted_blocks > 0  # once the requests finished, planes came back


@pytest.mark.parametrize("bad", [-1, True, 1.5, float("nan"), "3"])
def test_the_reload_reserve_is_a_token_count_or_none(bad: object) -> None:
    with pytest.raises(ValueError, match="reload_reserve_tokens must be a token count >= 0 or None"):
        EngineConfig(reload_reserve_tokens=bad)  # type: ignore[arg-type]
    assert EngineConfig(reload_reserve_tokens=None).reload_reserve_tokens is None
    assert EngineConfig().reload_reserve_tokens == 32


def test_policy_is_a_function_of_its_inputs() -> None:
    """Two cores fed the same requests make the same decisions, step by step (no hidden state, no clock)."""
    runs = []
    for _ in range(2):
        core = _core(300, max_batch=4, max_step_tokens=64)
        runner = FakeRunner(core)
        for r in _requests(5, 25, 10):
            core.add_request(r)
        runner.run()
        runs.append([(d.chunks, d.preempted, d.moves.lowered, [r.blocks for r in d.moves.reloads])
                     for d in runner.decisions])
    assert runs[0] == runs[1]


def test_static_weights_preempt_instead_of_demoting() -> None:
    core = _core(300, planner=False, max_batch=4, max_step_tokens=64)
    q0 = core.wpt.q.copy()  # type: ignore[union-attr]
    runner = FakeRunner(core)
    for r in _requests(4, 30, 12):
        core.add_request(r)
    outs = runner.run()
    assert all(o.finish == "length" and len(o.token_ids) == 12 for o in outs.values())
    assert runner.lowered == runner.committed == 0 and (core.wpt.q == q0).all()  # type: ignore[union-attr]
    assert core.scheduler.preemptions > 0 and any(d.preempted for d in runner.decisions)


def test_a_step_after_the_last_request_says_so() -> None:
    """Stepping an idle core says nothing waits or runs, not that the KV cache is short; negative token ids are
    refused when the request is made."""
    core = _core(300, planner=False, max_batch=4, max_step_tokens=64)
    with pytest.raises(RuntimeError, match="no request waits or runs"):
        core.step()
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        Request(9, (1, 2), SamplingParams(max_new_tokens=2), forced=(3, -1))
    runner = FakeRunner(core)
    for r in _requests(2, 10, 3):
        core.add_request(r)
    runner.run()
    with pytest.raises(RuntimeError, match="every one has finished"):
        core.step()


def test_requests_join_at_any_time_and_abort_returns_their_pages() -> None:
    core = _core(400, max_batch=4, max_step_tokens=64)
    runner = FakeRunner(core)
    core.add_request(Request(0, tuple(range(1, 20)), SamplingParams(max_new_tokens=30)))
    core.add_request(Request(1, tuple(range(5, 30)), SamplingParams(max_new_tokens=30)))
    for _ in range(3):
        runner.step()
    kv_before = core.pool.count(KV)
    out = core.abort(1)
    assert out.finish == "abort" and len(out.token_ids) == 3 and 1 not in core.tables
    assert core.pool.count(KV) < kv_before
    core.check()
    core.add_request(Request(2, (7, 8, 9), SamplingParams(max_new_tokens=5), eos=frozenset({(2 * 31 + 5) % 97})))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(Request(0, (1,)))
    final = runner.run()
    assert final[0].finish == "length" and len(final[0].token_ids) == 30
    assert final[2].finish == "eos" and final[2].token_ids == (65, 66)  # stopped at its EOS (67), not kept
    assert core.pool.count(KV) == 0 and core.abort(0).finish == "length"  # aborting a finished request: a no-op


def test_forced_tokens_are_fed_and_scored() -> None:
    core = EngineCore(EngineConfig(block_size=4), PagePool(PoolConfig(64, PAGE)), layout=1)
    core.add_request(Request(0, (1, 2, 3), forced=(9, 8, 7)))
    seen = []
    while not core.idle:
        d = core.step()
        (c,) = d.chunks
        seen.append((c.token_ids, c.forced))
        core.update(d, [c.forced], [-0.5])
    assert seen == [((1, 2, 3), 9), ((9,), 8), ((8,), 7)]
    o = core.output(0)
    assert o.token_ids == (9, 8, 7) and o.logprobs == (-0.5,) * 3 and o.finish == "length"

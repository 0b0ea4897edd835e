"""``EngineConfig.max_mean_bits`` (``--max-mean-bits``): PagedWeight holds at most the expert bytes of every block at
that many bits, in its initial placement and in every reload, on the real tiny MoE (CPU pool); without the cap the
same runs hold more."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pwformat.errors import PagedWeightError
from pwrun.cli import app
from pwrun.core.config import EngineConfig
from pwrun.core.request import SamplingParams
from pwrun.core.weight_table import WeightPageTable
from pwrun.data import default_model_dir
from pwrun.engine.build import ServeConfig, build_engine
from pwrun.engine.llm_engine import LLMEngine
from pwrun.model.loader import load_tokenizer

MODEL = default_model_dir()


def test_pages_at_mean_bits_interpolates_between_stored_bitwidths() -> None:
    plane = np.array([2, 3])
    lut = np.zeros((2, 9), dtype=np.int64)
    lut[:, 3:9] = np.arange(3, 9)  # a b-bit LUT of b pages, for both blocks
    t = WeightPageTable([3, 4, 6, 8], plane, lut)
    at = {b: float(t.pages_at(b).sum()) for b in (3, 4, 6, 8)}
    assert at[4] == 4 * 5 + 2 * 4
    for b in (3, 4, 6, 8):
        assert t.pages_at_mean_bits(b) == at[b]
    assert t.pages_at_mean_bits(3.5) == pytest.approx((at[3] + at[4]) / 2)
    assert t.pages_at_mean_bits(5.0) == pytest.approx((at[4] + at[6]) / 2)  # 5 bits is not stored: between 4 and 6
    assert t.pages_at_mean_bits(2.0) == at[3] and t.pages_at_mean_bits(12.0) == at[8]
    for mb in (3.0, 3.25, 4.0, 4.7, 5.0, 7.99, 8.0):  # the inverse
        assert t.mean_bits_for_pages(t.pages_at_mean_bits(mb)) == pytest.approx(mb)
    assert t.mean_bits_for_pages(0) == 3 and t.mean_bits_for_pages(at[8] + 1) == 8


def test_the_cap_is_validated() -> None:
    assert EngineConfig(max_mean_bits=4.25).max_mean_bits == 4.25
    for bad in (0.5, 17, float("nan"), True, "4"):
        with pytest.raises(ValueError, match="max_mean_bits"):
            EngineConfig(max_mean_bits=bad)  # type: ignore[arg-type]
    for bad_flag in ("0.5", "17", "nan", "inf", "abc"):  # nan is out of range too, not "should be <= 16"
        r = CliRunner().invoke(app, ["generate", "--prompt", "x", "--max-mean-bits", bad_flag])
        assert r.exit_code == 2 and "--max-mean-bits" in r.output and "from 1 to 16" in r.output, r.output


@pytest.mark.parametrize("args", [["--policy", "uniform", "--bits", "4", "--max-mean-bits", "4"],
                                  ["--policy", "static", "--max-mean-bits", "4"],
                                  ["--policy", "static", "--reload-reserve", "last"],
                                  ["--max-mean-bits", "4"]])  # no artifact: the 16-bit experts
def test_planner_flags_are_refused_where_the_bits_do_not_move(calibrated_artifacts: Path, args: list[str]) -> None:
    art = [] if args == ["--max-mean-bits", "4"] else ["--artifacts", str(calibrated_artifacts)]
    r = CliRunner().invoke(app, ["generate", "--prompt", "x", "--max-new-tokens", "1", *art, *args])
    flag = "--reload-reserve" if "--reload-reserve" in args else "--max-mean-bits"
    assert r.exit_code == 2 and f"{flag} only goes with --policy pagedweight" in r.output, r.output
    assert "Traceback" not in r.output


def test_a_cap_below_the_floors_is_refused_with_the_least_that_fits(calibrated_artifacts: Path) -> None:
    """A cap below the artifact's least bitwidth, or below the blocks' floors, could not be held: it is refused,
    naming the least cap, which is then accepted and held."""
    reqs = [[1, 2, 3]]
    with pytest.raises(PagedWeightError, match=r"--max-mean-bits 2\.5 holds less than the experts at") as e:
        _engine(calibrated_artifacts, 2.5, reqs)
    least = float(str(e.value).rsplit(" ", 1)[-1])
    assert 3.0 <= least < 4.0
    eng = _engine(calibrated_artifacts, least, reqs)
    wpt = eng.core.wpt
    assert wpt is not None and eng.info["initial_weight_pages"] <= int(wpt.pages_at_mean_bits(least))
    assert int(wpt.pages_at_mean_bits(least)) * eng.core.pool.cfg.page_bytes >= eng.info["floor_expert_bytes"]
    if least > 3.0:  # floors above 3 bits on some blocks: just below the least cap is refused too
        with pytest.raises(PagedWeightError, match="at least"):
            _engine(calibrated_artifacts, least - 0.02, reqs)


def _engine(artifacts: Path, cap: float | None, reqs: list[list[int]]) -> LLMEngine:
    cfg = ServeConfig(2**30, engine=EngineConfig(debug_checks=True, max_batch=8, max_step_tokens=256,
                                                 max_mean_bits=cap))
    return build_engine(MODEL, artifacts, cfg, SamplingParams(max_new_tokens=16), reqs, set(), device="cpu")


def _reload_until_still(e: LLMEngine) -> int:
    """Every block lowered to 3 bits, then reloads started and committed until none starts; the weight pages."""
    store, w = e.runner.experts, e.core.weights
    assert store is not None and w is not None
    above = np.flatnonzero(w.wpt.q > 3)
    w.lower(above, np.full(above.size, 3))
    store.apply(e.core.take_moves())
    for _ in range(10_000):
        w.reload()
        store.apply(e.core.take_moves())
        if not w._pending:
            break
        w.commit(store.finished_reloads())
        store.apply(e.core.take_moves())
    e.core.check()
    return w.wpt.weight_pages()


def test_placement_runs_and_reloads_stay_within_the_cap(calibrated_artifacts: Path) -> None:
    tok = load_tokenizer(MODEL)
    reqs = [tok.encode("The history of the city " * n) for n in (8, 20, 30, 12)]
    for cap in (None, 4.0):
        e = _engine(calibrated_artifacts, cap, reqs)
        wpt, page = e.core.wpt, e.core.pool.cfg.page_bytes
        assert wpt is not None
        limit = int(wpt.pages_at_mean_bits(4.0))
        outs = e.run_until_done()  # debug checks after every step
        assert all(len(o.token_ids) == 16 for o in outs.values())
        most = max(r.weight_bytes for r in e.trace)
        after = _reload_until_still(_engine(calibrated_artifacts, cap, reqs))  # a fresh engine, no request run
        if cap is None:  # a budget larger than everything: 8 bits placed, and every block raised back
            assert most > limit * page and after == int(wpt.pages_at(8).sum())
        else:
            assert e.info["initial_weight_pages"] <= limit and most <= limit * page
            assert int(wpt.pages_at(3).sum()) < after <= limit  # reloads raised blocks up to the cap, not past it

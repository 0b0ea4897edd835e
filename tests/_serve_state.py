"""What a served engine holds, read at a step boundary where the engine runs (a module of its own: a function
handed to an engine process must pickle by name)."""

from __future__ import annotations

from typing import Any

from pwrun.core.pool import KV, WEIGHT


def held_state(e: Any) -> dict[str, int]:
    """Page conservation (``EngineCore.check``) and what ``e`` holds: pages by kind, requests, outputs, running."""
    e.core.check()
    pool = e.core.pool
    return {"kv": pool.count(KV), "weight": pool.count(WEIGHT), "free": pool.num_free, "pages": pool.cfg.num_pages,
            "requests": len(e.core.requests), "outputs": len(e.outputs), "running": len(e.core.scheduler.running)}


def never_built() -> Any:
    """A builder that does not finish (for the start-up time limit)."""
    import time

    time.sleep(600)


def unpicklable(e: Any) -> Any:
    """A call whose result cannot cross a pipe."""
    return lambda: e


def no_error(job: int) -> str:
    """A worker job that succeeds (``run_in_workers`` collects the non-empty messages)."""
    return ""


def built_after_workers(build: Any) -> Any:
    """``build()`` after a pool of worker processes ran, as the kernel warm-up does on a GPU."""
    from pwkernels.warmup import run_in_workers

    errors = run_in_workers(no_error, [1, 2], 2)
    assert errors == [], errors
    return build()

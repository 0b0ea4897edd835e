"""One row per engine step (``StepTrace``) and its Arrow schema (what ``pwrun generate --trace`` writes).

Columns and units (seconds are host wall-clock; blocks are expert linear blocks unless said KV):

- ``step``: 0-based step index; ``seconds``: the whole step; ``t_s``: seconds from the start of the run to the
  step's end, on the clock of the requests' arrival and finish times (idle time waiting for an arrival included,
  so steps line up with arrivals); ``model_seconds``: from launching the forward to the device finishing it;
  ``graph_captured``: this step captured a CUDA graph (one-off warm-up + capture).
- ``after_seconds``: host time after sampling (retiring requests, the weight policy: demotion / reload / plan
  preparation when not overlapped); ``sync_seconds``: waiting for the device at the end of the step;
  ``reload_seconds``: committing + planning + starting reloads while the device computed (overlapped; 0 on CPU).
- ``planner_seconds``: planner time on the step's critical path; ``planner_overlapped_seconds``: planner time
  while the device computed. ``poll_seconds``, ``refresh_seconds``, ``raise_plan_seconds``,
  ``raise_start_seconds``, ``prepare_seconds``: host seconds by phase (0: did not run).
- ``free_blocks``: KV blocks the free pages could hold; ``kv_pages``, ``weight_pages``, ``free_pages``: pool pages
  by owner at the end of the step; ``kv_pages_global`` / ``kv_pages_sliding``: the KV pages of global-attention
  and of sliding-window layers (their sum is ``kv_pages``); ``trimmed_blocks``: KV blocks that gave their
  sliding-window pages back to the pool this step (they left every window of their sequence).
- ``pressure_bytes``: D of SPEC Eq. 7 after sampling (bytes); ``demoted_blocks``: blocks lowered this step;
  ``reload_started_blocks``: blocks whose reload started; ``promoted_blocks``: blocks whose reload committed.
- ``mean_bits``: committed bits per block (unweighted mean); ``shared_bits`` / ``routed_bits``: committed bits per
  weight of the shared-expert blocks (read by every token; nan: none) and of the routed blocks;
  ``bits_hist``: blocks at 0..8 committed bits.
- ``weight_bytes``: pool bytes of expert objects (committed + in transfer); ``committed_weight_bytes``: bytes of
  the committed bitwidths; ``bytes_in_flight``: bytes of reloads in flight.
- ``running``, ``waiting``: requests at the step's end; ``arrived``: requests queued since the previous step (their
  arrival time came, or a server added them), counted once each; ``preempted``: requests preempted this step;
  ``step_tokens``: tokens run;
  ``prefill_tokens``: those of them not decoding (prompt chunks, recomputation after preemption).
- ``device_peak_bytes``: peak device memory allocated so far (CUDA; 0 elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyarrow as pa


@dataclass(frozen=True)
class StepTrace:
    """One engine step; see the module docstring for the columns and their units."""

    step: int
    seconds: float
    t_s: float
    model_seconds: float
    graph_captured: bool
    after_seconds: float
    sync_seconds: float
    reload_seconds: float
    planner_seconds: float
    planner_overlapped_seconds: float
    poll_seconds: float
    refresh_seconds: float
    raise_plan_seconds: float
    raise_start_seconds: float
    prepare_seconds: float
    free_blocks: int
    kv_pages: int
    weight_pages: int
    free_pages: int
    pressure_bytes: int
    demoted_blocks: int
    reload_started_blocks: int
    promoted_blocks: int
    mean_bits: float
    weight_bytes: int
    committed_weight_bytes: int
    bytes_in_flight: int
    running: int
    waiting: int
    preempted: int
    step_tokens: int
    prefill_tokens: int
    bits_hist: list[int] = field(default_factory=list)
    shared_bits: float = float("nan")
    routed_bits: float = float("nan")
    device_peak_bytes: int = 0
    kv_pages_global: int = 0
    kv_pages_sliding: int = 0
    trimmed_blocks: int = 0
    arrived: int = 0


def trace_schema() -> pa.Schema:
    """The Arrow schema of a trace table: one column per ``StepTrace`` field, in order."""
    types = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "list[int]": pa.list_(pa.int64())}
    return pa.schema([(f.name, types[str(f.type)]) for f in fields(StepTrace)])


def trace_table(rows: list[StepTrace]) -> pa.Table:
    """``rows`` as an Arrow table of ``trace_schema`` (zero rows allowed)."""
    schema = trace_schema()
    cols = {name: [getattr(r, name) for r in rows] for name in schema.names}
    return pa.table(cols, schema=schema)

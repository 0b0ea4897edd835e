"""The engine's configuration (frozen, validated on construction; control plane, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

# The CLI's defaults by device: on a GPU, 64 running requests and steps of up to 2,048 tokens (the real-workload
# benchmark's setting, ``bench.serving --workload``); on the CPU, 16 and 512.
GPU_MAX_BATCH, GPU_STEP_TOKENS = 64, 2048
CPU_MAX_BATCH, CPU_STEP_TOKENS = 16, 512


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch`` running requests; ``max_step_tokens`` tokens per step (chunked prefill);
    ``lookahead_tokens``: tokens per running request the prepared plan provisions for; ``cuda_graphs``:
    replay decode steps from CUDA graphs (CUDA only); ``stats_every``: steps between reads of the live
    routing statistics (each read is a small device -> host copy); ``max_raise_blocks``: blocks whose
    reload may start in one step (spreads the host-side copy launches over steps); ``fused_kernels``:
    the Triton kernels for residual+RMSNorm, RoPE+KV write and routing+statistics instead of the eager ops
    where the kernels run; ``use_kernels``: run the Triton kernels (MoE, paged attention, fused ops) at all
    (None: on CUDA only; True on the CPU runs them in Triton's interpreter, for tests at tiny shapes);
    ``precompile_workers``: on CUDA, processes that compile the decode MoE kernels for 1..``max_batch`` tokens
    before the page pool is allocated (``pwkernels/warmup.py``; -1: one per CPU core up to 8, 0: compile on first
    use); ``debug_checks``: assert page conservation and q_i <= resident planes after every step;
    ``reload_reserve_tokens``: tokens ahead of each running request whose KV blocks reloads leave free, as many as
    a demotion provisions for (None: up to its last token, so reloads only use pages no running request can ever
    take: less movement, but under steady load the planes lowered at a KV peak stay low while pages are free);
    ``max_mean_bits``: PagedWeight holds at most the expert bytes of every block at this many bits (initial placement
    and reloads; None: as many as the free pages allow, SPEC section 5). Each decode step reads the experts in force,
    so a cap near the uniform bitwidth bounds the bandwidth cost of the planner's raises; its bits still go where
    the predicted damage is largest."""

    block_size: int = 16
    max_batch: int = 16
    max_step_tokens: int = 512
    lookahead_tokens: int = 32
    debug_checks: bool = False
    cuda_graphs: bool = True
    stats_every: int = 4
    max_raise_blocks: int = 16
    fused_kernels: bool = True
    use_kernels: bool | None = None
    precompile_workers: int = -1
    reload_reserve_tokens: int | None = 32
    max_mean_bits: float | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_batch < 1 or self.max_step_tokens < 1 or self.lookahead_tokens < 0:
            raise ValueError("block_size, max_batch and max_step_tokens must be >= 1, lookahead_tokens >= 0")
        if self.stats_every < 1 or self.max_raise_blocks < 0:
            raise ValueError("stats_every must be >= 1 and max_raise_blocks >= 0")
        r = self.reload_reserve_tokens
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 0):
            raise ValueError(f"reload_reserve_tokens must be a token count >= 0 or None (up to each request's last "
                             f"token), got {r!r}")
        m = self.max_mean_bits
        if m is not None and (isinstance(m, bool) or not isinstance(m, int | float) or not 1 <= m <= 16):
            raise ValueError(f"max_mean_bits must be a bitwidth between 1 and 16 or None (no cap), got {m!r}")
        if (not isinstance(self.precompile_workers, int) or isinstance(self.precompile_workers, bool)
                or self.precompile_workers < -1):
            raise ValueError(f"precompile_workers must be -1 (one per core, up to 8), 0 (off) or a process count, "
                             f"got {self.precompile_workers}")

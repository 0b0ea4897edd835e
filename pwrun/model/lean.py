"""The lean reference MoE model: its own forward pass over a paged KV cache (plain PyTorch).

What it does: embeddings -> per layer [RMSNorm -> paged GQA attention (RoPE, optional qkv bias
/ qk-norm) -> residual -> RMSNorm -> MoE block or dense MLP -> residual] -> final RMSNorm ->
lm_head, for any family described by a ``ModelSpec``; sandwich layers (Gemma-4) add norms after
attention and after the feed-forward, run a dense MLP beside the MoE block (each with its own norms,
the router reading the residual stream) and scale the layer's output; the embeddings may be scaled and
the logits soft-capped. Runs on CPU and CUDA in the dtype of its
weights. One ``forward`` call runs one step: any mix of prefill chunks and decode tokens of many
sequences. It does not schedule, allocate KV blocks or sample (``generate.py`` does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pwkernels.dense_gemv import linear
from pwkernels.norm import add_rms_norm, add_rms_norm_ref
from pwrun.model.attention import PagedKVCache, attention_forward
from pwrun.model.moe import MoEObserver, mlp_forward, moe_forward, router_input
from pwrun.model.ops import norm as rms
from pwrun.model.ops import softcap
from pwrun.model.spec import LayerSpec, ModelSpec
from pwrun.model.step import StepTensors
from pwrun.model.streamed import StreamedExperts
from pwrun.model.weights import LayerWeights, ModelWeights

MoEFn = Callable[..., torch.Tensor]  # moe(x [T, H], layer, r=router input or None) -> [T, H]


class LeanMoEModel:
    """A loaded model: ``spec`` (what it is) + ``weights`` (its tensors, one dtype/device). ``experts``: where the
    dense experts come from when ``weights`` holds only placeholders for them (``load_model(experts="stream")``)."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, experts: StreamedExperts | None = None) -> None:
        self.spec, self.weights, self.experts = spec, weights, experts
        # run the fused Triton kernels for residual+norm, RoPE+KV write (the runner turns this on where kernels run)
        self.fused = False

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    def forward(self, step: StepTensors, cache: PagedKVCache, logits_for: str = "last",
                observer: MoEObserver | None = None, moe: MoEFn | None = None) -> torch.Tensor:
        """Run one step; writes its keys/values into ``cache``.

        ``moe``: replaces the MoE blocks' reference forward (``moe(x [T, H], layer, r=None) -> [T, H]``, ``r``
        the router's input where it is not x); the runtime passes its Any-Precision experts here. ``cache`` may
        be any object with the ``PagedKVCache`` interface (``write``, ``gather``).

        Returns fp32 logits: [S, V] for each sequence's last token (``logits_for="last"``) or
        [T, V] for every token (``"all"``, used by perplexity and parity tests).
        """
        return self._step(step, cache, logits_for, observer, moe, self.fused)

    def forward_with_grad(self, step: StepTensors, cache: PagedKVCache, logits_for: str = "all") -> torch.Tensor:
        """``forward`` with autograd on and the reference ops only (no Triton kernel: they have no backward), so
        that a loss of the logits can be differentiated with respect to weights that require grad (the Fisher
        importance of ``pwcal sensitivity``). Same arguments, shapes and cache writes as ``forward``."""
        with torch.enable_grad():
            return self._step(step, cache, logits_for, None, None, False)

    def _step(self, step: StepTensors, cache: PagedKVCache, logits_for: str, observer: MoEObserver | None,
              moe: MoEFn | None, fused: bool) -> torch.Tensor:
        h = self.embed(step.tokens)
        begin = getattr(cache, "begin_step", None)
        if begin is not None:
            begin(step)
        delta: torch.Tensor | None = None  # the last block's output, added to h by the next norm
        for ls, lw in zip(self.spec.layers, self.weights.layers, strict=True):
            h, delta = self.layer(h, delta, ls, lw, step, cache, observer, moe, fused)
        if logits_for == "last":
            h = h.index_select(0, step.last_token_index)
            delta = None if delta is None else delta.index_select(0, step.last_token_index)
        elif logits_for != "all":
            raise ValueError(f"logits_for must be 'last' or 'all', got {logits_for!r}")
        return self.head(h, delta, fused)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] of token ids [T] (scaled where the family scales its embeddings)."""
        h = F.embedding(tokens, self.weights.embed)
        if self.spec.embed_scale != 1.0:  # the scale rounded to the weights' dtype first, as transformers does
            h = h * torch.tensor(self.spec.embed_scale, dtype=h.dtype).item()
        return h

    def layer(self, h: torch.Tensor, delta: torch.Tensor | None, ls: LayerSpec, lw: LayerWeights,
              step: StepTensors, cache: PagedKVCache, observer: MoEObserver | None = None, moe: MoEFn | None = None,
              fused: bool = False, split: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder layer: residual stream h [T, H] plus the previous block's output ``delta`` (added by this
        layer's first norm) -> (h, delta) after it. ``split``: where ``moe`` returns other rows than it was given
        (offline scoring runs a layer's attention once for sequences that differ only from its MoE block on), it
        maps a tensor of the block's input rows to its output rows, and h leaves the layer with those rows."""
        eps = self.spec.rms_norm_eps
        norm = add_rms_norm if fused else add_rms_norm_ref
        h, x = norm(h, delta, lw.attn_norm, eps)
        a = attention_forward(x, lw.attn, ls.attention, eps, ls.index, step, cache, fused)
        if lw.sandwich is not None:
            sw = lw.sandwich
            h, x = norm(h, rms(a, sw.post_attn, eps, fused), lw.ffn_norm, eps)
            f = self._sandwich_ffn(h, x, ls, lw, observer, moe, fused, split)
            if split is not None and lw.moe is not None and moe is not None:
                h = split(h)
            return rms(f, sw.post_ffn, eps, fused, residual=h, scale=sw.scalar), None
        h, x = norm(h, a, lw.ffn_norm, eps)
        if lw.moe is None:
            assert lw.mlp is not None
            return h, mlp_forward(x, lw.mlp, self.spec.mlp_activation)
        assert ls.moe is not None
        if moe is not None:
            delta = moe(x, ls.index)
            return (h if split is None else split(h)), delta
        mw = lw.moe if self.experts is None else self.experts.moe(ls.index, lw.moe)
        return h, moe_forward(x, mw, ls.moe, ls.index, observer)

    def head(self, h: torch.Tensor, delta: torch.Tensor | None, fused: bool = False) -> torch.Tensor:
        """fp32 logits [T, V] of the last layer's h [T, H] and output ``delta`` (final norm, LM head, soft cap)."""
        norm = add_rms_norm if fused else add_rms_norm_ref
        _, h = norm(h, delta, self.weights.final_norm, self.spec.rms_norm_eps)
        logits = linear(h, self.weights.lm_head) if fused else F.linear(h, self.weights.lm_head)
        return softcap(logits.float(), self.spec.logit_softcap)

    def _sandwich_ffn(self, h: torch.Tensor, x: torch.Tensor, ls: LayerSpec, lw: LayerWeights,
                      observer: MoEObserver | None, moe: MoEFn | None, fused: bool,
                      split: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The feed-forward of a sandwich layer, before its post-norm: the dense MLP of x (after its own norm)
        plus the MoE block of the residual stream h (normalised by its pre-norm; the router reads h itself), in
        the MoE block's output rows (``split``, as in ``layer``)."""
        eps = self.spec.rms_norm_eps
        sw = lw.sandwich
        assert sw is not None and lw.mlp is not None
        f = rms(mlp_forward(x, lw.mlp, self.spec.mlp_activation, fused), sw.mlp_post, eps, fused)
        if lw.moe is None:
            return f
        assert ls.moe is not None
        x2 = rms(h, sw.moe_pre, eps, fused)
        r = router_input(h, lw.moe, ls.moe, eps, fused) if ls.moe.router == "gemma4" else None
        if moe is not None:
            e = moe(x2, ls.index, r=r)
            f = f if split is None else split(f)
        else:
            mw = lw.moe if self.experts is None else self.experts.moe(ls.index, lw.moe)
            e = moe_forward(x2, mw, ls.moe, ls.index, observer, r)
        return rms(e, sw.moe_post, eps, fused, residual=f)

"""Read a local Hugging Face MoE checkpoint into ``ModelWeights`` (safetensors only, never pickle).

What it does: finds ``*.safetensors`` (single file or sharded with an index), maps the
family's tensor names to the canonical layout (``CheckpointNames``), stacks per-expert
projections into [E, 2I, H] / [E, H, I] (or takes transformers-5 fused ``gate_up_proj`` /
``down_proj`` tensors as they are), checks every shape against the spec, and casts to the
requested dtype and device. Errors name the missing tensor or the mismatched shape.
Host memory: files are memory-mapped (``safe_open``) one layer at a time and unmapped after it, and every
tensor returned owns its memory (a mapped page counts in the process's RSS for as long as it is mapped), so
loading holds at most one layer of the file beside what it returns. ``experts="skip"`` returns the expert
weights as empty placeholders (serving an artifact), for ``pwrun.model.streamed`` to read layer by layer.
It does not parse configs (``families.py``) or run anything.
"""

from __future__ import annotations

from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from pwformat.errors import PagedWeightError
from pwformat.shards import safetensors_files
from pwrun.model.checkpoint_gemma4 import load_gemma4
from pwrun.model.families import CheckpointNames
from pwrun.model.spec import LayerSpec, ModelSpec
from pwrun.model.weights import AttentionWeights, LayerWeights, MLPWeights, ModelWeights, MoEWeights

EXPERT_MODES = ("load", "skip")


class TensorReader:
    """Lazy name -> tensor access over a set of safetensors files (``close`` unmaps them; reopened on the next
    ``get``); every tensor is checked for NaN and Inf as it is loaded (the error names it). With ``digest``,
    ``digest()`` is the xxh3-128 of the names and checkpoint bytes of the tensors read so far, in read order (what a
    served artifact checks the checkpoint by: ``load_weights(experts="skip")`` reads exactly the weights serving
    takes from it); without, "" and no hashing (e.g. experts streamed pass after pass)."""

    def __init__(self, files: list[Path], dtype: torch.dtype | None, device: torch.device | str,
                 digest: bool = False) -> None:
        """``dtype`` None: each tensor in its checkpoint dtype."""
        self.dtype, self.device = dtype, device
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        self._where[k] = f
            except Exception as exc:  # safetensors raises SafetensorError and others on damaged files
                raise PagedWeightError(f"{f} is not a readable safetensors file ({str(exc).splitlines()[0]}): "
                                       "re-download or re-export the checkpoint") from exc
        self._handles: dict[Path, object] = {}
        self._digest = xxhash.xxh3_128() if digest else None

    def digest(self) -> str:
        return "" if self._digest is None else self._digest.hexdigest()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._where:
            raise PagedWeightError(f"tensor '{name}' is missing from the checkpoint: the weights do not match "
                                   "config.json (wrong or partial checkpoint)")
        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        t = self._handles[f].get_tensor(name)  # type: ignore[attr-defined]  # a view of the mapped file
        if shape is not None and tuple(t.shape) != shape:
            raise PagedWeightError(f"tensor '{name}' has shape {tuple(t.shape)} but config.json implies {shape}: "
                                   "the weights belong to another config")
        if not t.is_floating_point():
            raise PagedWeightError(f"tensor '{name}' has dtype {t.dtype}: only float checkpoints are supported")
        if self._digest is not None:
            self._digest.update(name.encode() + b"\0")
            self._digest.update(t.contiguous().view(torch.uint8).numpy())  # the checkpoint's bytes, before any cast
        out = t.to(device=self.device, dtype=self.dtype)
        if not bool(torch.isfinite(out).all()):  # one pass over the tensor where it lands (cheap on a GPU)
            raise PagedWeightError(f"tensor '{name}' of {f.name} holds NaN or Inf (as {str(out.dtype)[6:]}): the "
                                   "checkpoint is damaged; re-download or re-export it")
        if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            out = out.clone()  # same dtype on the CPU: own the bytes, so that ``close`` can unmap the file
        return out

    def close(self) -> None:
        """Unmap every file (their pages leave the RSS); later ``get`` calls map them again."""
        self._handles.clear()

    def maybe(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(name, shape) if self.has(name) else None


def _attention(r: TensorReader, p: str, spec: ModelSpec, layer: LayerSpec) -> AttentionWeights:
    a, h = layer.attention, spec.hidden_size
    qd, kd = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    w = AttentionWeights(
        q=r.get(p + "q_proj.weight", (qd, h)), k=r.get(p + "k_proj.weight", (kd, h)),
        v=r.get(p + "v_proj.weight", (kd, h)), o=r.get(p + "o_proj.weight", (h, qd)),
    )
    if a.qkv_bias:
        w.q_bias, w.k_bias, w.v_bias = (r.get(p + f"{n}_proj.bias", (d,)) for n, d in (("q", qd), ("k", kd), ("v", kd)))
    if a.qk_norm == "per_head":
        w.q_norm, w.k_norm = r.get(p + "q_norm.weight", (a.head_dim,)), r.get(p + "k_norm.weight", (a.head_dim,))
    elif a.qk_norm == "full":
        w.q_norm, w.k_norm = r.get(p + "q_norm.weight", (qd,)), r.get(p + "k_norm.weight", (kd,))
    return w


def _mlp(r: TensorReader, p: str, names: tuple[str, str, str], inter: int, h: int) -> MLPWeights:
    gate = r.get(p + names[0] + ".weight", (inter, h))
    up = r.get(p + names[1] + ".weight", (inter, h))
    return MLPWeights(gate_up=torch.cat([gate, up], 0), down=r.get(p + names[2] + ".weight", (h, inter)))


def experts_of(r: TensorReader, p: str, spec: ModelSpec, layer: LayerSpec, names: CheckpointNames
               ) -> tuple[torch.Tensor, torch.Tensor, MLPWeights | None]:
    """One MoE layer's dense experts: gate_up [E, 2I, H], down [E, H, I] and the shared expert (or None);
    ``p`` = ``model.layers.{index}.``."""
    m, h = layer.moe, spec.hidden_size
    assert m is not None
    e, i = m.num_experts, m.expert_intermediate
    mp = p + names.moe_prefix + "."
    if r.has(mp + "experts.gate_up_proj"):  # transformers-5 fused layout
        gate_up = r.get(mp + "experts.gate_up_proj", (e, 2 * i, h))
        down = r.get(mp + "experts.down_proj", (e, h, i))
    else:
        units = (names.expert_gate, names.expert_up, names.expert_down)
        experts = [_mlp(r, mp + f"experts.{x}.", units, i, h) for x in range(e)]
        gate_up = torch.stack([x.gate_up for x in experts])
        down = torch.stack([x.down for x in experts])
    shared = None
    if m.shared_intermediate:
        shared = _mlp(r, mp + "shared_expert.", ("gate_proj", "up_proj", "down_proj"), m.shared_intermediate, h)
    return gate_up, down, shared


def _moe(r: TensorReader, p: str, spec: ModelSpec, layer: LayerSpec, names: CheckpointNames,
         experts: str) -> MoEWeights:
    m, h = layer.moe, spec.hidden_size
    assert m is not None
    mp = p + names.moe_prefix + "."
    router = r.get(mp + "gate.weight", (m.num_experts, h))
    if experts == "load":
        gate_up, down, shared = experts_of(r, p, spec, layer, names)
    else:  # placeholders with the layout of a stripped model (``pwrun.engine.build.strip_experts``)
        gate_up = down = torch.empty(0, dtype=r.dtype, device=r.device)
        shared = MLPWeights(gate_up, down) if m.shared_intermediate else None
    w = MoEWeights(router=router, gate_up=gate_up, down=down, shared=shared)
    if m.shared_gate:
        w.shared_gate = r.get(mp + "shared_expert_gate.weight", (1, h))
    return w


def load_weights(model_dir: Path, spec: ModelSpec, names: CheckpointNames, dtype: torch.dtype,
                 device: torch.device | str, experts: str = "load", digest: bool = False) -> ModelWeights:
    """Load every tensor the lean model needs, as ``dtype`` on ``device``; ``experts="skip"``: all but the
    routed and shared experts' weights (empty placeholders; routers and shared-expert gates are loaded).
    ``digest``: set ``ModelWeights.source_digest`` (``TensorReader``'s digest of the bytes read; else "").

    Raises ``PagedWeightError`` when files or tensors are missing or shapes disagree with ``spec``.
    """
    if experts not in EXPERT_MODES:
        raise ValueError(f"experts must be one of {EXPERT_MODES}, got {experts!r}")
    r = TensorReader(safetensors_files(model_dir), dtype, device, digest)
    if names.gemma4:  # its own layout: every weight is loaded (``strip_experts`` drops the experts)
        gemma = load_gemma4(r, spec)
        r.close()
        gemma.source_digest = r.digest()
        return gemma
    h, v = spec.hidden_size, spec.vocab_size
    embed = r.get("model.embed_tokens.weight", (v, h))
    if r.has("lm_head.weight") and not spec.tie_word_embeddings:
        lm_head = r.get("lm_head.weight", (v, h))
    elif spec.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = r.get("lm_head.weight", (v, h))
    layers = []
    for layer in spec.layers:
        p = f"model.layers.{layer.index}."
        lw = LayerWeights(
            attn_norm=r.get(p + "input_layernorm.weight", (h,)),
            ffn_norm=r.get(p + "post_attention_layernorm.weight", (h,)),
            attn=_attention(r, p + "self_attn.", spec, layer),
        )
        if layer.moe is not None:
            lw.moe = _moe(r, p, spec, layer, names, experts)
        else:
            lw.mlp = _mlp(r, p + "mlp.", ("gate_proj", "up_proj", "down_proj"), layer.dense_intermediate, h)
        layers.append(lw)
        r.close()  # at most one layer of the files mapped at a time
    out = ModelWeights(embed=embed, lm_head=lm_head, final_norm=r.get("model.norm.weight", (h,)), layers=layers)
    r.close()
    out.source_digest = r.digest()
    return out

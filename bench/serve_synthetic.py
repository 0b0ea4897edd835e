"""The synthetic full-size model that ``bench/serve_speed.py`` (and ``profile_decode.py``, ``planner_speed.py``)
serve: random weights of a seed architecture, random AP planes and LUTs, and calibration tables (timing only).

What it does: ``random_model`` builds the lean model of a config with random bf16 weights (norms 1; no checkpoint
read), ``SyntheticAP`` random bit-planes and sorted random LUTs at BITS for every expert block in one host buffer
(pinned on CUDA; the artifact reader's stand-in), ``synthetic_table`` a calibration table (Dirichlet routing mass,
the shared experts at mass 1; lognormal sensitivities ~4x smaller per bit, SPEC section 4 Eq. 2's shape), and
``table_at`` the page-rounded bytes of every block at one bitwidth. The values mean nothing for quality.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pwrun.model.checkpoint import LayerWeights, ModelWeights, _attention, _moe
from pwrun.model.families import spec_from_config
from pwrun.model.inventory import expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import read_config
from pwrun.planner.tables import UNITS, BlockTable

BITS = [3, 4, 5, 6, 7, 8]


class RandomReader:
    """Stands in for the checkpoint reader: random tensors of the asked shapes (norms = 1)."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        self.dtype, self.device = dtype, device

    def has(self, name: str) -> bool:
        return name.endswith("experts.gate_up_proj")

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        assert shape is not None
        if "norm" in name:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        return torch.randn(shape, dtype=self.dtype, device=self.device) * 0.02

    def maybe(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return None


def random_model(config_dir: Path, dtype: torch.dtype, device: str) -> LeanMoEModel:
    """The lean model of the config in ``config_dir`` (``config.json``) with random weights of ``dtype`` on
    ``device`` (every layer must be MoE: AssertionError otherwise)."""
    spec, names = spec_from_config(read_config(config_dir))
    r = RandomReader(dtype, device)
    h, v = spec.hidden_size, spec.vocab_size
    embed = r.get("embed", (v, h))
    lm_head = embed if spec.tie_word_embeddings else r.get("lm_head", (v, h))
    layers = []
    for layer in spec.layers:
        p = f"model.layers.{layer.index}."
        lw = LayerWeights(attn_norm=r.get(p + "norm", (h,)), ffn_norm=r.get(p + "norm2", (h,)),
                          attn=_attention(r, p + "self_attn.", spec, layer))  # type: ignore[arg-type]
        assert layer.moe is not None
        lw.moe = _moe(r, p, spec, layer, names)  # type: ignore[arg-type]
        layers.append(lw)
    return LeanMoEModel(spec, ModelWeights(embed=embed, lm_head=lm_head, final_norm=r.get("norm", (h,)), layers=layers))


class SyntheticAP:
    """Random AP planes [8, N, ceil(K / 32)] int32 and sorted LUTs [N, 2^q] (``dtype``, q in BITS) for every expert
    block, in one host buffer (pinned if ``device`` is CUDA, where the random values are drawn): an artifact
    stand-in for ``pwrun.engine.serve.assemble_engine`` (``layer_tensors``)."""

    def __init__(self, spec: Any, dtype: torch.dtype, device: str = "cuda") -> None:
        self.bits, self.seed_bits = BITS, 3
        self.blocks = expert_blocks(spec)
        sizes = []
        for b in self.blocks:
            kw = -(-b.k // 32)
            sizes.append(8 * b.n * kw * 4 + sum(b.n * 2**q * 2 for q in BITS))
        self.buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device == "cuda")
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        pos = 0
        g = torch.Generator(device=device).manual_seed(0)
        for b, size in zip(self.blocks, sizes, strict=True):
            kw = -(-b.k // 32)
            name = f"{'shared' if b.expert < 0 else b.expert}.{b.unit}"
            d = self.tensors.setdefault(b.layer, {})
            n_pl = 8 * b.n * kw * 4
            planes = self.buf[pos:pos + n_pl].view(torch.int32).view(8, b.n, kw)
            planes.copy_(torch.randint(-2**31, 2**31 - 1, (8, b.n, kw), dtype=torch.int32, device=device,
                                       generator=g))
            d[f"{name}.planes"] = planes
            off = pos + n_pl
            for q in BITS:
                nb = b.n * 2**q * 2
                lut = self.buf[off:off + nb].view(dtype).view(b.n, 2**q)
                lut.copy_(torch.sort(torch.randn(b.n, 2**q, device=device, generator=g) * 0.02, dim=1)[0].to(dtype))
                d[f"{name}.lut{q}"] = lut
                off += nb
            pos += size
        if device == "cuda":
            torch.cuda.synchronize()

    def layer_tensors(self, layer: int, device: str = "cpu") -> dict[str, torch.Tensor]:
        return self.tensors[layer]


def synthetic_table(spec: Any, seed: int = 0) -> BlockTable:
    """A calibration table of every expert block of ``spec`` at BITS: routing mass Dirichlet per layer (shared
    experts 1.0), sensitivity s_i^b (SPEC Eq. 2) lognormal x mass, each bit ~4x smaller; bytes are filled by the
    engine (page-rounded)."""
    rng = np.random.default_rng(seed)
    blocks = sorted(expert_blocks(spec), key=lambda b: (b.layer, b.expert, b.unit))
    n = len(blocks)
    e = max(ls.moe.num_experts for ls in spec.layers if ls.moe is not None)
    mass_le = rng.dirichlet(np.ones(e) * 2, size=spec.num_layers)
    mass = np.array([1.0 if b.expert < 0 else mass_le[b.layer, b.expert] for b in blocks])
    base = rng.lognormal(0, 1, n) * mass * 1e3
    sens = base[:, None] * 4.0 ** -(np.arange(len(BITS))[None, :])  # each bit ~4x less error
    return BlockTable(bits=np.array(BITS), layer=np.array([b.layer for b in blocks]),
                      expert=np.array([b.expert for b in blocks]), unit=np.array([UNITS.index(b.unit) for b in blocks]),
                      sens=sens, bytes=np.zeros((n, len(BITS)), np.int64), tokens=np.full(n, 1000), mass=mass)


def table_at(table: BlockTable, spec: Any, bits: int) -> np.ndarray:
    """[n] page-rounded bytes of every block at ``bits`` (16-token KV pages of this model, bf16)."""
    from pwrun.engine.experts import page_rounded_bytes

    a = spec.layers[0].attention
    return page_rounded_bytes(table, spec, 16 * a.num_kv_heads * a.head_dim * 2)[:, BITS.index(bits)]

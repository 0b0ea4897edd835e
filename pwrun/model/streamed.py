"""Dense experts read from the checkpoint one MoE layer at a time (calibration without the whole model in memory).

What it does: ``StreamedExperts`` gives a layer's dense experts (routed gate_up [E, 2I, H] / down [E, H, I] and
the shared expert) as ``dtype`` on ``device``, reading them from the safetensors files only when that layer runs
(``LeanMoEModel.forward``) or when a block's weight is asked for (``dense_weight``), and holding only the layer
last read. On CUDA each layer stays on the device after its first read, in the checkpoint's own dtype (cast to
``dtype`` when used: exact for bf16/fp16 -> fp32), so that repeated calibration passes read the files once; on
the CPU nothing stays, and host memory holds one layer's experts at a time. Values are those a whole-model load
gives (the same read and cast).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pwformat.shards import safetensors_files
from pwrun.model.checkpoint import TensorReader, experts_of
from pwrun.model.families import CheckpointNames
from pwrun.model.spec import ModelSpec
from pwrun.model.weights import MLPWeights, MoEWeights

Experts = tuple[torch.Tensor, torch.Tensor, MLPWeights | None]


class StreamedExperts:
    """The experts of ``model_dir``'s MoE layers as ``dtype`` on ``device``, one layer in memory at a time."""

    def __init__(self, model_dir: Path, spec: ModelSpec, names: CheckpointNames, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec, self.names, self.dtype, self.device = spec, names, dtype, device
        self._reader = TensorReader(safetensors_files(model_dir), dtype, device)
        self._keep_on_device = device.type == "cuda"
        self._stored: dict[int, Experts] = {}  # CUDA: every layer read so far, in the checkpoint's dtype
        self._current: tuple[int, Experts] | None = None
        self.layer_reads = 0  # layers read from the files so far

    def layer(self, index: int) -> Experts:
        """gate_up [E, 2I, H], down [E, H, I] and the shared expert (or None) of MoE layer ``index``."""
        if self._current is not None and self._current[0] == index:
            return self._current[1]
        self._current = None  # drop the previous layer before the next one is read
        if self._keep_on_device:
            if index not in self._stored:
                self._stored[index] = self._read(index, None)
            gu, dn, sh = self._stored[index]
            cast = (gu.to(self.dtype), dn.to(self.dtype),
                    None if sh is None else MLPWeights(sh.gate_up.to(self.dtype), sh.down.to(self.dtype)))
        else:
            cast = self._read(index, self.dtype)
        self._current = (index, cast)
        return cast

    def moe(self, index: int, base: MoEWeights) -> MoEWeights:
        """``base`` (a layer loaded with ``experts="skip"``: router, shared gate) with layer ``index``'s experts."""
        gate_up, down, shared = self.layer(index)
        return MoEWeights(router=base.router, gate_up=gate_up, down=down, shared=shared, shared_gate=base.shared_gate)

    def release(self) -> None:
        """Drop the layer held for use (what stays on a CUDA device stays)."""
        self._current = None

    def _read(self, index: int, dtype: torch.dtype | None) -> Experts:
        layer = self.spec.layers[index]
        if layer.moe is None:
            raise ValueError(f"layer {index} has no MoE block")
        self._reader.dtype = dtype
        try:
            out = experts_of(self._reader, f"model.layers.{index}.", self.spec, layer, self.names)
        finally:
            self._reader.close()
        self.layer_reads += 1
        return out

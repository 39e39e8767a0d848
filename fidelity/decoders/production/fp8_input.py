"""An activation quantized once for every FP8 GEMM it feeds (the ``fused-norm`` profile's ``rms_norm_act_quant``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Input:
    """y [n, d] bf16 (the RMSNorm output the other consumers read) and xq [n, d] bf16, y on its e4m3 1x128 ue8m0
    grid (spec §3 ``act_quant`` in place), made in one kernel; rows index both."""

    y: torch.Tensor
    xq: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.y.shape

    def __getitem__(self, rows) -> Fp8Input:
        return Fp8Input(self.y[rows], self.xq[rows])

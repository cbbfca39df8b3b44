"""LFM short convolution (LFM2, LFM2-MoE, LFM3): y = C * conv(B * x), a gated depthwise conv, no recurrent state."""

from __future__ import annotations

import torch
from torch import nn

from prefixlab.recurrent.families.base import Mixed, Projected, ScanRequest


class ShortConv:
    classes: tuple[str, ...] = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
    has_recurrent_state = False
    conv_name = "conv"
    read_directly: tuple[str, ...] = ("conv",)

    def activation(self, layer: nn.Module) -> str | None:
        return None

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        B, C, x = layer.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
        return Projected(B * x, {"C": C})

    def mix(self, layer: nn.Module, conv_output: torch.Tensor, projected: Projected, request: ScanRequest) -> Mixed:
        return Mixed(conv_output, None, {})

    def finish(self, layer: nn.Module, mixed: torch.Tensor, projected: Projected) -> torch.Tensor:
        return layer.out_proj((projected.extras["C"] * mixed.transpose(1, 2)).transpose(-1, -2).contiguous())

"""Mamba1 mixers (Jamba, Falcon-Mamba, Mamba): in_proj to x | z, a depthwise conv over x, x_proj to dt | B | C,
the selective scan gated by SiLU(z), out_proj. Jamba and Falcon-Mamba RMS-normalise dt, B and C first.

transformers 5.23's Mamba1 mixers (Jamba, Mamba, Falcon-Mamba) hand no cached state to the scan of a forward of more
than one token (modeling_mamba.py mamba_selective_scan: its torch loop starts from zeros, mamba_ssm's
selective_scan_fn takes no initial state), so without this patch a cached prefix cannot be resumed exactly by these
models (hfspec marks them `patched_only`)."""

from __future__ import annotations

import torch
from torch import nn

from prefixlab.recurrent.families.base import Mixed, Projected, ScanRequest, mask_padding
from prefixlab.recurrent.selective_scan import selective_scan


class MambaMixer:
    classes: tuple[str, ...] = ("MambaMixer",)
    has_recurrent_state = True
    conv_name = "conv1d"
    read_directly: tuple[str, ...] = ("conv1d", "dt_proj")

    def activation(self, layer: nn.Module) -> str | None:
        return layer.activation

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        x, gate = layer.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)
        return Projected(x, {"gate": gate, "dtype": hidden_states.dtype})

    def normalise(
        self, layer: nn.Module, time_step: torch.Tensor, B: torch.Tensor, C: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return time_step, B, C

    def mix(self, layer: nn.Module, conv_output: torch.Tensor, projected: Projected, request: ScanRequest) -> Mixed:
        x = mask_padding(conv_output, request.mask)
        time_step, B, C = torch.split(
            layer.x_proj(x), [layer.time_step_rank, layer.ssm_state_size, layer.ssm_state_size], dim=-1
        )
        time_step, B, C = self.normalise(layer, time_step, B, C)
        if hasattr(getattr(layer, "config", None), "_is_quantized"):  # quantized Linear: call it, as the layer does
            delta = (layer.dt_proj(time_step) - layer.dt_proj.bias).transpose(1, 2)
        else:
            delta = layer.dt_proj.weight @ time_step.transpose(1, 2)
        y, final, states = selective_scan(
            x.transpose(1, 2),
            delta,
            -torch.exp(layer.A_log.float()),
            B.transpose(1, 2),
            C.transpose(1, 2),
            D=layer.D.float(),
            z=projected.extras["gate"],
            delta_bias=None if layer.dt_proj.bias is None else layer.dt_proj.bias.float(),
            delta_softplus=True,
            initial_state=request.initial_state,
            capture=request.capture,
            # there is no compiled Mamba1 kernel: its token loop serves every portable backend
            backend="torch" if request.backend == "compiled" else request.backend,
        )
        return Mixed(y.transpose(1, 2), final, states)

    def finish(self, layer: nn.Module, mixed: torch.Tensor, projected: Projected) -> torch.Tensor:
        return layer.out_proj(mixed.to(projected.extras["dtype"]))


class NormalisedMambaMixer(MambaMixer):
    """Jamba, Falcon-Mamba: RMS norms on dt, B and C before the scan."""

    classes = ("JambaMambaMixer", "FalconMambaMixer")

    def normalise(
        self, layer: nn.Module, time_step: torch.Tensor, B: torch.Tensor, C: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return layer.dt_layernorm(time_step), layer.b_layernorm(B), layer.c_layernorm(C)

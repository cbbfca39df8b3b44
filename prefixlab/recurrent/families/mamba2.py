"""Mamba2 mixers (Mamba2, Bamba, Nemotron-H, Granite-4-H, Zamba2, Falcon-H1): one in_proj to gate | xBC | dt, a
depthwise conv over xBC, the SSD scan, a gated RMS norm and out_proj. Falcon-H1 adds µP multipliers and may gate
with SiLU instead of the norm."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prefixlab.recurrent.families.base import Mixed, Projected, ScanRequest, mask_padding
from prefixlab.recurrent.ssd import ssd, ssd_backend

NO_DT_LIMIT = (0.0, math.inf)


def time_step_limit(layer: nn.Module) -> tuple[float, float]:
    return NO_DT_LIMIT if layer.time_step_limit is None else tuple(layer.time_step_limit)


def skipped_clamp(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """A bool tensor (no device sync): whether clamping softplus(dt + dt_bias), as ssd computes it, to `limit` would
    change any value."""
    dt = F.softplus(dt.float() + dt_bias.float())
    return ((dt < limit[0]) | (dt > limit[1])).any()


class Mamba2Mixer:
    classes: tuple[str, ...] = (
        "Mamba2Mixer",
        "BambaMixer",
        "NemotronHMamba2Mixer",
        "GraniteMoeHybridMambaLayer",
        "Zamba2MambaMixer",
    )
    has_recurrent_state = True
    conv_name = "conv1d"
    read_directly: tuple[str, ...] = ("conv1d",)

    def activation(self, layer: nn.Module) -> str | None:
        return layer.activation

    def in_proj(self, layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return layer.in_proj(hidden_states)

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        gate, xbc, dt = self.in_proj(layer, hidden_states).split(
            [layer.intermediate_size, layer.conv_dim, layer.num_heads], dim=-1
        )
        return Projected(xbc.transpose(1, 2), {"gate": gate, "dt": dt, "dtype": hidden_states.dtype})

    def mix(self, layer: nn.Module, conv_output: torch.Tensor, projected: Projected, request: ScanRequest) -> Mixed:
        batch, length = conv_output.shape[:2]
        # transformers clamps dt to time_step_limit in its chunked form only, not in its recurrent (decode) form, a
        # one token forward over a cached state (its selective_state_update, like mamba_ssm's, takes no limit)
        decode, limit = length == 1 and request.initial_state is not None, time_step_limit(layer)
        groups_state = layer.n_groups * layer.ssm_state_size
        x, B, C = torch.split(
            mask_padding(conv_output, request.mask), [layer.intermediate_size, groups_state, groups_state], dim=-1
        )
        # float32 in, as transformers' torch path (the gated norm then sees float32 outputs); the model's fp16 / bf16
        # where mamba_ssm runs the scan, as transformers' CUDA path gives it
        model_dtype = projected.extras["dtype"]
        on_mamba_ssm = ssd_backend(request.backend, x.device, model_dtype, length) == "mamba_ssm"
        scan_dtype = model_dtype if on_mamba_ssm else torch.float32
        y, final, states = ssd(
            x.reshape(batch, length, layer.num_heads, layer.head_dim).to(scan_dtype),
            projected.extras["dt"],
            -torch.exp(layer.A_log.float()),
            B.reshape(batch, length, layer.n_groups, -1),
            C.reshape(batch, length, layer.n_groups, -1),
            D=layer.D,
            dt_bias=layer.dt_bias,
            dt_softplus=True,
            dt_limit=NO_DT_LIMIT if decode else limit,
            initial_state=request.initial_state,
            capture=request.capture,
            chunk_size=layer.chunk_size,
            backend=request.backend,
        )
        # where the limit is not (0, inf) (Nemotron-H, Zamba2), a decode step that skipped a clamp computed what a
        # prefill of its token would not (prefixlab.cache.model_info.decode_differs_from_prefill)
        differs = None
        if decode and limit != NO_DT_LIMIT:
            differs = skipped_clamp(projected.extras["dt"], layer.dt_bias, limit)
        return Mixed(y.reshape(batch, length, -1), final, states, differs)

    def gate(self, layer: nn.Module, mixed: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return layer.norm(mixed, gate)

    def finish(self, layer: nn.Module, mixed: torch.Tensor, projected: Projected) -> torch.Tensor:
        gated = self.gate(layer, mixed, projected.extras["gate"])
        return layer.out_proj(gated.to(projected.extras["dtype"]))


class FalconH1Mixer(Mamba2Mixer):
    """Falcon-H1: input and per-channel (µP) multipliers on the projection; SiLU gate when the norm is off."""

    classes = ("FalconH1Mixer",)

    def in_proj(self, layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return layer.in_proj(hidden_states * layer.ssm_in_multiplier) * layer.mup_vector

    def gate(self, layer: nn.Module, mixed: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return layer.norm(mixed, gate) if layer.mamba_rms_norm else mixed * F.silu(gate)

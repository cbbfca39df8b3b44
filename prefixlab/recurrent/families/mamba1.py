"""Mamba1 mixers (Jamba, Falcon-Mamba, Mamba, Zamba): in_proj to x | z, a depthwise conv over x, x_proj to
dt | B | C, the selective scan gated by SiLU(z), out_proj. Jamba and Falcon-Mamba RMS-normalise dt, B and C first;
Zamba splits the channels into heads, each scanned with its own x_proj, dt_proj, A and D.

transformers 5.23's Mamba1 mixers (Jamba, Mamba, Falcon-Mamba, Zamba) hand no cached state to the scan of a forward of
more than one token (modeling_mamba.py mamba_selective_scan: its torch loop starts from zeros, mamba_ssm's
selective_scan_fn takes no initial state), so without this patch a cached prefix cannot be resumed exactly by these
models (hfspec marks them `patched_only`)."""

from __future__ import annotations

import torch
from torch import nn

from prefixlab.recurrent.families.base import Mixed, Projected, ScanRequest, mask_padding
from prefixlab.recurrent.selective_scan import selective_scan


def scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor | None,
    gate: torch.Tensor,
    initial_state: torch.Tensor | None,
    request: ScanRequest,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The selective scan of one Mamba1 mixer (or head) as transformers calls it: x [B, T, C], delta [B, C, T]
    (before bias and softplus), B and C [B, T, N], gate [B, C, T]. Returns (y [B, C, T], final state, captures)."""
    return selective_scan(
        x.transpose(1, 2),
        delta,
        -torch.exp(A_log.float()),
        B.transpose(1, 2),
        C.transpose(1, 2),
        D=D.float(),
        z=gate,
        delta_bias=None if dt_bias is None else dt_bias.float(),
        delta_softplus=True,
        initial_state=initial_state,
        capture=request.capture,
        # there is no compiled Mamba1 kernel: its token loop serves every portable backend
        backend="torch" if request.backend == "compiled" else request.backend,
    )


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
        y, final, states = scan(x, delta, B, C, layer.A_log, layer.D, layer.dt_proj.bias, projected.extras["gate"],
                                request.initial_state, request)
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


class MultiHeadMambaMixer(MambaMixer):
    """Zamba: in_proj interleaves x and z channels; the channels split into `n_mamba_heads` heads, each scanned
    independently with its own x_proj / dt_proj weights (3D parameters, not Linear children), A and D. The cached
    recurrent state is [B, heads, head_dim, N], as transformers stacks the heads' states."""

    classes = ("ZambaMambaMixer",)
    read_directly = ("conv1d",)

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        batch, length = hidden_states.shape[:2]
        x, gate = layer.in_proj(hidden_states).transpose(1, 2).view(batch, -1, 2, length).unbind(2)
        return Projected(x.contiguous(), {"gate": gate, "dtype": hidden_states.dtype})

    def mix(self, layer: nn.Module, conv_output: torch.Tensor, projected: Projected, request: ScanRequest) -> Mixed:
        heads = mask_padding(conv_output, request.mask).unflatten(-1, (layer.n_mamba_heads, layer.mamba_head_dim))
        gates = projected.extras["gate"].unflatten(1, (layer.n_mamba_heads, layer.mamba_head_dim))
        n = layer.ssm_state_size
        results = []
        for head in range(layer.n_mamba_heads):
            x = heads[:, :, head]
            params = (layer.x_proj_weight[head] @ x.transpose(1, 2)).transpose(1, 2)
            time_step, B, C = torch.split(params, [layer.time_step_rank, n, n], dim=-1)
            delta = layer.dt_proj_weight[head] @ time_step.transpose(1, 2)
            initial = None if request.initial_state is None else request.initial_state[:, head]
            results.append(scan(x, delta, B, C, layer.A_log[head], layer.D[head], layer.dt_proj_bias[head],
                                gates[:, head], initial, request))
        ys, finals, captures = zip(*results, strict=True)
        states = {offset: torch.stack([c[offset] for c in captures], dim=1) for offset in captures[0]}
        return Mixed(torch.cat(ys, dim=1).transpose(1, 2), torch.stack(finals, dim=1), states)

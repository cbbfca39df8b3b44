"""Gated delta rule layers: GatedDeltaNet (Qwen3.5 and -MoE, Qwen3-Next, Qwen4-Exp, OLMo-hybrid), KDA (Kimi, Bailing,
GLM-5-Next).

All of them project q, k, v through one depthwise conv, run the gated delta rule with q/k l2-normalised, and gate
the outputs with an RMS norm; they differ only in how the projections are laid out (one method each below).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixlab.recurrent.delta_rule import gated_delta_rule
from prefixlab.recurrent.families.base import Mixed, Projected, ScanRequest


def _decay(layer: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """Per-head log decay g = -exp(A_log) * softplus(a + dt_bias), in float32 as transformers computes it."""
    return -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)


class GatedDeltaNet:
    """Qwen3.5 / Qwen3.5-MoE / Qwen4-Exp: a fused q|k|v projection and separate z, b, a projections."""

    classes: tuple[str, ...] = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet")
    has_recurrent_state = True
    conv_name = "conv1d"
    read_directly: tuple[str, ...] = ("conv1d",)

    def activation(self, layer: nn.Module) -> str | None:
        return layer.activation

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        batch, length = hidden_states.shape[:2]
        z = layer.in_proj_z(hidden_states).reshape(batch, length, -1, layer.head_v_dim)
        beta = layer.in_proj_b(hidden_states).sigmoid()
        g = _decay(layer, layer.in_proj_a(hidden_states))
        return Projected(layer.in_proj_qkv(hidden_states).transpose(1, 2), {"gate": z, "beta": beta, "g": g})

    def dims(self, layer: nn.Module) -> tuple[int, int, int, int]:
        """(key_dim, value_dim, head_k_dim, head_v_dim)."""
        return layer.key_dim, layer.value_dim, layer.head_k_dim, layer.head_v_dim

    def query_key(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(q, k, whether the kernel should l2-normalise them): the kernel's l2norm is GatedDeltaNet's."""
        return q, k, True

    def mix(self, layer: nn.Module, conv_output: torch.Tensor, projected: Projected, request: ScanRequest) -> Mixed:
        batch, length = conv_output.shape[:2]
        key_dim, value_dim, head_k_dim, head_v_dim = self.dims(layer)
        q, k, v = torch.split(conv_output, [key_dim, key_dim, value_dim], dim=-1)
        q, k, normalise = self.query_key(
            q.reshape(batch, length, -1, head_k_dim), k.reshape(batch, length, -1, head_k_dim)
        )
        out, final, states = gated_delta_rule(
            q,
            k,
            v.reshape(batch, length, -1, head_v_dim).to(q.dtype),
            projected.extras["g"],
            projected.extras["beta"],
            initial_state=request.initial_state,
            capture=request.capture,
            use_qk_l2norm=normalise,
            backend=request.backend,
        )
        return Mixed(out.to(v.dtype), final, states)

    def finish(self, layer: nn.Module, mixed: torch.Tensor, projected: Projected) -> torch.Tensor:
        batch, length = mixed.shape[:2]
        head_v_dim = self.dims(layer)[3]
        gated = self.norm(layer)(mixed.reshape(-1, head_v_dim), projected.extras["gate"].reshape(-1, head_v_dim))
        return self.out_proj(layer)(gated.reshape(batch, length, -1))

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.norm

    def out_proj(self, layer: nn.Module) -> nn.Module:
        return layer.out_proj


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next: q|k|v|z and b|a come interleaved per key head from two fused projections."""

    classes = ("Qwen3NextGatedDeltaNet",)

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states)
        )
        qkv = torch.cat([x.reshape(*x.shape[:2], -1) for x in (q, k, v)], dim=-1)
        return Projected(qkv.transpose(1, 2), {"gate": z, "beta": b.sigmoid(), "g": _decay(layer, a)})


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    """OLMo-hybrid: separate q, k, v, a, b projections, a g_proj output gate, beta optionally doubled."""

    classes = ("OlmoHybridGatedDeltaNet",)

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        qkv = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], -1)
        beta = layer.b_proj(hidden_states).sigmoid()
        if layer.allow_neg_eigval:
            beta = beta * 2.0
        g = _decay(layer, layer.a_proj(hidden_states))
        return Projected(qkv.transpose(1, 2), {"gate": layer.g_proj(hidden_states), "beta": beta, "g": g})

    def norm(self, layer: nn.Module) -> nn.Module:
        return layer.o_norm

    def out_proj(self, layer: nn.Module) -> nn.Module:
        return layer.o_proj


class KimiDeltaAttention(OlmoHybridGatedDeltaNet):
    """Kimi Linear KDA (and GLM-5-Next's, the same layer): the delta rule with a per-key-channel decay from the
    layer's forget gate."""

    classes = ("KimiLinearDeltaAttention", "Glm5NextTextLinearAttention")

    def project(self, layer: nn.Module, hidden_states: torch.Tensor) -> Projected:
        batch, length = hidden_states.shape[:2]
        qkv = torch.cat([layer.q_proj(hidden_states), layer.k_proj(hidden_states), layer.v_proj(hidden_states)], -1)
        gate = self.output_gate(layer, hidden_states).view(batch, length, -1, layer.head_dim)
        beta = layer.b_proj(hidden_states).sigmoid()
        return Projected(qkv.transpose(1, 2), {"gate": gate, "beta": beta, "g": layer.forget_gate(hidden_states)})

    def output_gate(self, layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return layer.g_b_proj(layer.g_a_proj(hidden_states))  # low rank

    def dims(self, layer: nn.Module) -> tuple[int, int, int, int]:
        return layer.qkv_dim, layer.qkv_dim, layer.head_dim, layer.head_dim

    def query_key(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        # KDA divides by sqrt(|x|^2 + eps) (fla's Triton form) where GatedDeltaNet multiplies by rsqrt: normalise
        # here, in float32 as Kimi does, so the kernel sees exactly the layer's q and k.
        return _kimi_l2norm(q.float()), _kimi_l2norm(k.float()), False

    def finish(self, layer: nn.Module, mixed: torch.Tensor, projected: Projected) -> torch.Tensor:
        batch, length = mixed.shape[:2]
        return layer.o_proj(layer.o_norm(mixed, projected.extras["gate"]).reshape(batch, length, -1))


class BailingHybridDeltaAttention(KimiDeltaAttention):
    """Bailing-hybrid (Ling): Kimi's KDA with a full-rank g_proj output gate."""

    classes = ("BailingHybridDeltaAttention",)

    def output_gate(self, layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return layer.g_proj(hidden_states)


def _kimi_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)

"""Recurrent kernels that return exact intermediate states (pure tensor functions; see docs/ARCHITECTURE.md)."""

from prefixlab.recurrent.conv import causal_conv1d, conv_state_at
from prefixlab.recurrent.delta_rule import gated_delta_rule
from prefixlab.recurrent.patch import patch, patched, unpatch
from prefixlab.recurrent.selective_scan import selective_scan
from prefixlab.recurrent.ssd import ssd

__all__ = ["causal_conv1d", "conv_state_at", "gated_delta_rule", "patch", "patched", "selective_scan", "ssd", "unpatch"]

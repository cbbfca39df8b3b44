"""The protocol of a cache the model's forward hooks drive (hooks.py); HybridPrefixCache implements it."""

from __future__ import annotations

import torch


class ModelDrivenCache:
    """The protocol the hooks drive (HybridPrefixCache implements it)."""

    started: bool
    in_flight: bool  # a forward over it started (record) and has not ended (forward_done / forward_failed)
    row_pads: list[int] | None  # per row, the left pads of its request (None: rows whose positions are not checked)

    def prefixlab_bind(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None, logits_tokens: int, reusable: int | None) -> int:
        raise NotImplementedError

    def capture_splits(self, start: int, stop: int) -> list[int]:
        raise NotImplementedError

    def get_seq_length(self, layer_idx: int = 0) -> int:  # tokens the cache holds (continuing forwards start there)
        raise NotImplementedError

    def record(self, input_ids: torch.Tensor) -> None:
        raise NotImplementedError

    def held_tokens(self) -> torch.Tensor:  # [batch, n] the tokens the cache's tensors describe
        raise NotImplementedError

    def resume_further(self, input_ids: torch.Tensor, logits_tokens: int, reusable: int | None,
                       attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None) -> int:  # columns of input_ids now held
        raise NotImplementedError

    def admit_nothing(self) -> None:  # a forward not continuing it plainly (rows.continues_plainly)
        raise NotImplementedError

    def check_one_token(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        raise NotImplementedError

    def forward_done(self) -> None:
        raise NotImplementedError

    def forward_failed(self) -> None:
        raise NotImplementedError

"""The guard of HybridPrefixCache: only a forward its store's hooks announced may read or write the cache's tensors
(another model, a submodule called directly, or a closed store's model would run on the request's states unchecked).
"""

from __future__ import annotations

import torch

from prefixlab.cache.rows import PADS_ONLY
from prefixlab.cache.sharing import check_open
from prefixlab.errors import InvalidInputError, ModelMismatchError


class ModelGuard:
    """Mixed into HybridPrefixCache before DynamicCache (whose methods it guards)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens the cache already holds (every layer holds the same count, recurrent-only models included)."""
        if self.store is not None:
            check_open(self.store)  # generate asks this first: a cache over a closed store fails before any forward
        return self._seen

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seen

    def _require_started(self) -> None:
        if self._started:  # (its store closed: the hooks that cut and check the forward's tokens are gone)
            check_open(self.store)
            return
        if self.store is None:
            raise InvalidInputError(
                "HybridPrefixCache() without a store ran on a model that was not prepared for prefixlab, so nothing "
                "bound it to a store. Add this line once after loading the model: prefixlab.patch(model)"
            )
        raise ModelMismatchError(
            "HybridPrefixCache was used by a model its PrefixStore was not built for (the store hooks that drive it "
            f"never ran); the store serves {type(self.store.model).__name__} ({self.store.identity[:12]}). Build a "
            "PrefixStore for this model and a HybridPrefixCache over it"
        )

    def _require_driven(self) -> None:
        """Layers write into the cache only inside a forward its store's hooks announced (`record`)."""
        self._require_started()
        if not self._pending:
            raise ModelMismatchError(
                "a forward the store's hooks did not drive ran over this HybridPrefixCache (another model, or a "
                f"submodule called directly); its store serves {type(self.store.model).__name__} "
                f"({self.store.identity[:12]}). Give each model a HybridPrefixCache over its own PrefixStore and call "
                "the model itself"
            )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._require_driven()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._require_driven()
        return super().get_conv_state(layer_idx, state_idx)

    def check_one_token(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """A one-token forward continuing the request (a decode step, a one-token piece of a prompt): its rows must
        be the request's (InvalidInputError; the cache is reset); a row fed a pad as its token (transformers masks
        no pad out of a one-token forward: it enters a recurrent layer's states) or masked otherwise than by its
        left pads has other KV and states: that row is then not admitted. The mask is compared on its device, row by
        row, and read at the next commit (no host sync per decode step)."""
        rows = self._fed[0].shape[0] if self._fed else input_ids.shape[0]
        if input_ids.shape[0] != rows:
            raise InvalidInputError(f"this HybridPrefixCache holds a request of {rows} rows and this forward has "
                                    f"{input_ids.shape[0]}: use a new HybridPrefixCache(store), whose lookup reuses "
                                    "what this one held. This cache is reset now")
        if not self._admit_rows or attention_mask is None or self.row_ends is not None or attention_mask.dim() != 2:
            return
        # every row's mask: pads, then real tokens up to this one (a row of pads only so far: where its first real
        # token is, a later forward resolves), as many pads as the row began with
        device, key = attention_mask.device, tuple(self._pads)
        if self._pads_on is None or self._pads_on[0] != (device, key):  # (one copy to the device a request)
            known = torch.tensor([p != PADS_ONLY for p in key], device=device)
            pads = torch.tensor([0 if p == PADS_ONLY else p for p in key], device=device)
            self._pads_on = ((device, key), known, pads)
        _, known, pads = self._pads_on
        real = attention_mask.bool()
        plain = (real[:, 1:] >= real[:, :-1]).all(dim=1) & ((real.shape[1] - real.sum(dim=1) == pads) | ~known)
        if self.store.layout.state_layers:  # (attention stores no pad column's KV: rows are stored from their pads)
            plain &= real[:, -1]
        self._mask_plain = plain if self._mask_plain is None else self._mask_plain & plain  # per row

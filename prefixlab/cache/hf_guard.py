"""The guard of HybridPrefixCache: only a forward its store's hooks announced may read or write the cache's tensors
(another model, a submodule called directly, or a closed store's model would run on the request's states unchecked).
"""

from __future__ import annotations

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

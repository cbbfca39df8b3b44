"""transformers' in-place edits of a cache (beam reorder, repeat, select, crop, reset) on HybridPrefixCache: each keeps
the cache's token record (the tokens fed, per-row pads and admitted rows, tokens held) in step with the tensors.
Copies are refused (one cache object is one request; the store shares prefixes)."""

from __future__ import annotations

import torch

from prefixlab.cache.sharing import under_store_lock
from prefixlab.errors import InvalidInputError, is_int


class TensorEdits:
    """Mixed into HybridPrefixCache before DynamicCache (whose methods edit the tensors)."""

    def __deepcopy__(self, memo):
        raise InvalidInputError(
            "a HybridPrefixCache is not copied (the DynamicCache idiom copy.deepcopy(prompt_cache) for prefix reuse): "
            "its PrefixStore already reuses prefixes across requests. Give each request a new HybridPrefixCache(store) "
            "and its whole prompt; it resumes from the longest prefix the store holds"
        )

    def __copy__(self):
        return self.__deepcopy__({})

    def __reduce__(self):  # pickle
        return self.__deepcopy__({})

    @under_store_lock
    def reset(self) -> None:
        """Admit what this cache holds, then empty it: the object serves its next forward as a new request
        (transformers' reset would empty the tensors under a request the store has yet to admit)."""
        if self.store is None or not self._started:
            return super().reset()
        if self._pending:
            raise InvalidInputError("HybridPrefixCache.reset() while a forward runs over it; reset between requests")
        self.commit()
        self._forget_request()

    @under_store_lock
    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._fed = [torch.cat(self._fed, dim=1).index_select(0, beam_idx.cpu())] if self._fed else []
        self._pads = [self._pads[i] for i in beam_idx.tolist()] if self._pads else []
        self._rows_edited()

    @under_store_lock
    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._fed = [torch.cat(self._fed, dim=1).repeat_interleave(repeats, dim=0)] if self._fed else []
        self._admit_rows = [r * repeats + k for r in self._admit_rows for k in range(repeats)]
        self._pads = [pad for pad in self._pads for _ in range(repeats)]
        self._rows_edited()

    @under_store_lock
    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._fed = [torch.cat(self._fed, dim=1)[indices.cpu()]] if self._fed else []
        self._pads = [self._pads[i] for i in torch.as_tensor(indices).reshape(-1).tolist()] if self._pads else []
        self._admit_rows = list(range(len(self._fed[0]))) if self._admit_rows and self._fed else []
        self._rows_edited()

    def _rows_edited(self) -> None:  # rows moved: a row's one-token mask check (check_one_token) now holds for all
        if self._mask_plain is not None and self._fed:
            self._mask_plain = self._mask_plain.all().expand(len(self._fed[0])).clone()

    @property
    def is_croppable(self) -> bool:  # transformers asks before it defers a stop check by a step (then crops)
        return self.store is None or not self.store.layout.state_layers

    @under_store_lock
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (assisted decoding's rejected candidates): attention KV only;
        recurrent states cannot roll back. What the store was already given stays (its KV is exact for its tokens)."""
        if not is_int(tokens_to_remove):
            raise InvalidInputError(f"crop({tokens_to_remove!r}): pass an int, the negative number of tokens to remove")
        if tokens_to_remove == 0:
            return
        if self.store is None or self.store.layout.state_layers:
            raise InvalidInputError("HybridPrefixCache cannot crop: recurrent states cannot roll back. Disable "
                                    "assisted/speculative decoding with this cache")
        if tokens_to_remove > 0:
            raise InvalidInputError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        keep = max(self._seen + tokens_to_remove, 0)
        super().crop(keep - self._seen)
        self._fed, self._seen = [self.held_tokens()[:, :keep]], keep
        self._committed = min(self._committed, keep)

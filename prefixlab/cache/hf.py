"""HybridPrefixCache: a transformers `DynamicCache` that resumes from, and feeds, a `PrefixStore`.

    prefixlab.patch(model)                                  # once per model: kernels + forward hooks
    out = model.generate(input_ids, past_key_values=HybridPrefixCache(policy="dp"), max_new_tokens=64)
    # or, managing the store yourself:
    store = PrefixStore(model, capacity="4GB", policy="dp")
    out = model.generate(input_ids, past_key_values=HybridPrefixCache(store), max_new_tokens=64)

A cache without a store binds, on its first forward, to the model's default store (its first open PrefixStore,
created then with the cache's options if there is none; options that differ from an existing default store's raise).
One cache object serves one request (one generate call, or several calls that continue the same sequences: a forward
whose positions do not continue them is refused). The model's forward hooks (cache/hooks.py, put there by
`prefixlab.patch` or a PrefixStore) drive it, because `generate` never shows the prompt to a cache before the first
forward:
- first forward (`begin`): load COPIES of the KV and recurrent + conv states of the longest reusable prefix (at most
  all but the last token) and tell the hook which tokens remain: it runs the model on those only;
- every forward (`record`) remembers the tokens fed; planned states are captured within the pass (patched layers) or
  by splitting the prefill there (transformers' layers; never a one-token segment at a pad column);
- `commit` (by the store before its next lookup, or by you) admits prompt + output[:-1] with its states, its final
  state the one a next chat turn resumes from; where a decode step may compute otherwise than a prefill (Nemotron-H,
  Zamba2) only the prompt, if one did, and a prompt resumes at most all but its last two tokens.

Batches: every row is matched on its own (on its real tokens, without its pads), then all rows resume at one common
column c of the (left-padded) batch: row b with p_b pads at real position c - p_b, from its own cached KV (placed at
columns [p_b, c); pad columns hold zeros, masked by the attention mask) and states; a row with nothing cached starts
fresh (c <= p_b). c is the deepest column where every row holds a checkpoint (rows re-matched at shorter probes until
they agree); rows whose checkpoints sit at other columns are first prefilled alone up to the batch's deepest column
(align.py). Positions must be the real ones (generate's, from the mask); a first forward whose position_ids say
otherwise, or whose mask is not plain left padding, gets no reuse and admits nothing. A row of pads only so far
(chunked prefill) starts fresh and a later forward's mask gives its pads. Captures are planned per row in real
positions and taken at padded columns; each row is admitted as its real tokens (prompt + output[:-1]) with its
states at column - p_b. Beam search and num_return_sequences reorder / repeat the token record and pad counts.
More in docs/ARCHITECTURE.md "HF flow".

Direct forwards work the same way (outputs cover the tokens run); a later multi-token forward (chunked prefill, a
continued turn) resumes further where the store holds more. Mamba, Falcon-Mamba and Mamba2 take it as
`cache_params=`. Assisted decoding crops rejected candidates (refused with recurrent states: they cannot roll back).
Images: multimodal.py. `cache.report()`: what each row reused and why, what was admitted."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from prefixlab.cache.defaults import cache_store_options, check_bound_store
from prefixlab.cache.driven import ModelDrivenCache
from prefixlab.cache.explain import RequestReport, RowReport
from prefixlab.cache.hf_commit import RequestCommit
from prefixlab.cache.hf_edits import TensorEdits
from prefixlab.cache.hf_guard import ModelGuard
from prefixlab.cache.hf_minimax import cache_class
from prefixlab.cache.hf_resume import RowResume
from prefixlab.cache.model_info import runs_uncached
from prefixlab.cache.multimodal import first_key
from prefixlab.cache.rows import PADS_ONLY, left_pads, pad_safe_splits, real_positions, resolve_pads, right_padded
from prefixlab.cache.sharing import under_store_lock
from prefixlab.cache.store import PrefixStore
from prefixlab.cache.tensors import snapshot_states
from prefixlab.cache.tokens import check_namespace
from prefixlab.errors import InvalidInputError


class HybridPrefixCache(RowResume, RequestCommit, TensorEdits, ModelGuard, DynamicCache, ModelDrivenCache):
    """A transformers Cache that reuses exact prefixes from a PrefixStore and admits what it computes.

    Args:
        store: the persistent, shared part (one per model). Left out, the cache binds on its first forward to the
            model's default store (needs `prefixlab.patch(model)` once, or any PrefixStore of the model).
        namespace: entries are only reused by caches of the same namespace (e.g. one per tenant).
        policy, capacity, offload_capacity, block_size, patch, media_cache: options of the default store
            (PrefixStore's), used to create it or checked against it; only without `store`.
    """

    is_compileable = False  # generate() on CUDA compiles over all-linear caches (Mamba2); DynamicCache is exempt too

    def __new__(cls, store: PrefixStore | None = None, *args, **kwargs):
        """The class the store's model takes (hf_minimax.cache_class: MiniMax needs a MiniMaxCache)."""
        if cls is HybridPrefixCache and isinstance(store, PrefixStore):
            cls = cache_class(store.model.config)
        return super().__new__(cls)

    def __init__(self, store: PrefixStore | None = None, namespace: str = "default", **store_options):
        if store is not None and not isinstance(store, PrefixStore):
            raise InvalidInputError(
                f"HybridPrefixCache(store=...) takes a PrefixStore, got {type(store).__name__}; build one with "
                "prefixlab.PrefixStore(model), or leave it out: HybridPrefixCache(policy='dp') after "
                "prefixlab.patch(model)"
            )
        check_namespace(namespace)
        self._store_options = cache_store_options(store, store_options)
        super().__init__(config=store.model.config if store is not None else None)
        self.store = store
        self.namespace = namespace
        self.reused_tokens = 0  # tokens of the prompt that came from the store (the most of any row)
        self.generate_prompt: int | None = None  # columns of the input of the generate() call running, if one is
        self.rows_reused: list[int] = []  # per row: its real tokens that came from the store
        self.prefixlab_capture_positions: list[int] | list[list[int]] | None = None
        # per row, the columns of its tokens, right padding after them: a batch of primes (align.py); None: left pads
        self.row_ends: list[int] | None = None
        self._report = RequestReport()
        self._clear_request()

    @classmethod
    def for_model(cls, model: torch.nn.Module, namespace: str = "default", **store_options) -> HybridPrefixCache:
        """A cache bound now to the model's default store (`PrefixStore.default_for(model, **store_options)`)."""
        check_namespace(namespace)  # (before a default store is built: a refused call leaves none)
        return cls(PrefixStore.default_for(model, **store_options), namespace=namespace)

    def prefixlab_bind(self, model: torch.nn.Module) -> None:
        """Called by the model's forward hook: an unbound cache takes the model's default store; a bound one must be
        used with its store's model."""
        if self.store is None:
            self.store = PrefixStore.default_for(model, **self._store_options)
            if type(self) is HybridPrefixCache:  # (as __new__ would have picked, had the store been given)
                self.__class__ = cache_class(model.config)
            DynamicCache.__init__(self, config=model.config)
        check_bound_store(self.store, model)

    def report(self) -> RequestReport:
        """Per row what was reused and why no more, and what was admitted (committing now if pending; explain.py)."""
        self.commit()
        return self._report

    # -- request state ---------------------------------------------------------------------------------------------
    def _clear_request(self) -> None:
        self._started = False
        self._fed: list[torch.Tensor] = []  # [batch, t] token chunks fed so far, on CPU
        self._seen = 0  # tokens the cache tensors describe
        self._pending = 0  # tokens of the forward in flight
        self._ran = False  # a forward of this request succeeded
        self._admit_rows: list[int] = []  # rows we may admit (all, unless the mask is not plain left padding)
        self._pads: list[int] = []  # per row: leading pad columns (left padding)
        self._plan: list[int] = []  # absolute positions whose states we still have to capture
        self._captured: dict[int, dict[str, dict[tuple[int, int], torch.Tensor]]] = {}
        self._row_plans: list[list[int]] = []  # with row_ends: per row, the positions to capture in that row alone
        self._row_captured: dict[tuple[int, int], dict[str, dict[tuple[int, int], torch.Tensor]]] = {}
        self._provisional: set[int] = set()  # planned by a later forward over part of the prompt (resume_further)
        self._committed = 0
        self.primed: list[RowReport | None] | None = None  # per row, the report of its prime before begin (align.py)
        self._generation = -1  # the store's generation at begin: a store cleared since gets nothing of this request
        self._admit_limit: float = float("inf")  # columns that may be admitted (multimodal.py: none past an image)
        # on a model whose decode steps may differ from prefills (see record): where the first one started, and per
        # device (layers may sit on several) whether one differed
        self._decode_start, self._decode_differs = None, {}
        self._mask_plain: torch.Tensor | None = None  # per row: one-token forwards' masks were its pads' (hf_guard)
        self._pads_on: tuple | None = None  # the pads on the mask's device: ((device, pads), known, counts)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def row_pads(self) -> list[int] | None:
        return self._pads if self._admit_rows else None

    @property
    def in_flight(self) -> bool:
        """Whether a forward over this cache started and has not ended (reported done or failed) yet."""
        return bool(self._pending)

    def held_tokens(self) -> torch.Tensor:
        """[batch, n] token ids the tensors describe (after generate: prompt + output[:-1]); what `commit` admits."""
        return torch.cat(self._fed, dim=1) if self._fed else torch.zeros(0, 0, dtype=torch.long)

    # -- driven by the store's forward hooks ------------------------------------------------------------------------
    @under_store_lock
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None = None, logits_tokens: int = 0, reusable: int | None = None) -> int:
        """Start a request for `input_ids` [batch, length] (left padding allowed): load the longest prefix every row
        can resume from (each row's own cached tokens and state, one common padded position), plan the captures;
        the last `logits_tokens` columns are always computed (the caller wants their logits), and only the first
        `reusable` columns (if given: multimodal.py) are looked up or admitted.
        Returns the number of leading (padded) columns already in the cache (the forward must run only the rest)."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise InvalidInputError(f"input_ids must be [batch, length>0], got shape {list(input_ids.shape)}")
        ids = input_ids.detach().cpu()  # token ids were checked by the hooks (hooks.py), every row before any lookup
        batch, length = ids.shape
        if self.row_ends is not None:  # right padding: rows at positions 0, 1, ... (the hooks' column positions)
            pads = [0] * batch if right_padded(attention_mask, self.row_ends, length) else None
        else:
            pads = left_pads(attention_mask, batch, length, pads_only_rows=True)  # (chunked prefill: rows start later)
            served = min(length if reusable is None else reusable, first_key(ids))  # (past a key, M-RoPE offsets)
            if pads is not None and not real_positions(position_ids, pads, length,
                                                       bool(self.store.layout.kv_layers), served):
                pads = None
            if pads is not None and runs_uncached(self.store, pads, length):  # (model_info: a bias, a RoPE)
                pads = None
        self._started = True
        if pads is None:  # not plain left padding, or positions other than the real ones: run uncached, admit nothing
            self._admit_rows, self._pads, self.rows_reused = [], [0] * batch, [0] * batch
            self._fed.append(ids[:, :0])
            self._report = RequestReport([RowReport(length, reason="refused_input") for _ in range(batch)],
                                         admission="not admitted (refused input)")
            self.store.record_request(self._report.rows)
            return 0
        # one token at a row's pad: transformers masks no pad out of a one-token forward, it enters the row's states
        pad_fed = length == 1 and bool(self.store.layout.state_layers)
        self._admit_rows, self._pads = [r for r in range(batch) if not (pad_fed and pads[r] == PADS_ONLY)], pads
        self.store.check_weights()
        self._generation = self.store.generation
        self._admit_limit = min(float("inf") if reusable is None else reusable, self.store.admit_limit)
        tail = self._tail(logits_tokens, length, length)
        common, rows, self.rows_reused = self._resume(ids, tail, 0)
        self.reused_tokens = max(self.rows_reused)
        self._plan_repeat(length - tail, common)
        self._report = RequestReport(rows)
        self._fed.append(ids[:, :common])
        self._seen = common
        self.store.record_request(rows)
        return common

    @under_store_lock
    def resume_further(self, input_ids: torch.Tensor, logits_tokens: int, reusable: int | None = None,
                       attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> int:
        """A forward continuing this request over `input_ids` [batch, t]: where the store holds a checkpoint of the
        tokens so far deeper than this cache (generate's chunked prefill shows the prompt one chunk at a time), load
        it. The last `logits_tokens` columns are always computed, columns past `reusable` neither looked up nor
        admitted (as in `begin`); rows of pads only so far get theirs from the mask. Returns the columns now held."""
        if not self._admit_rows or self._pending:
            return 0
        if self.store.rope_limit is not None and self._seen + input_ids.shape[1] >= self.store.rope_limit:
            # the whole forward runs at the rescaled RoPE frequencies: nothing stored stands in for it, none of it
            # may be stored (model_info.rope_limit)
            self._admit_limit = min(self._admit_limit, self._seen)
            return 0
        self.store.check_weights()  # (a later turn: the weights may have changed since the request began)
        if self._generation != self.store.generation:  # the store was cleared since: this request admits nothing
            return 0
        if PADS_ONLY in self._pads:
            pads = resolve_pads(self._pads, attention_mask, position_ids, self._seen, self._seen + input_ids.shape[1],
                                bool(self.store.layout.kv_layers))
            if pads is None:  # the mask or positions are not those of the padded prompt begun: admit nothing of it
                self._admit_rows, self._report.admission = [], "not admitted (refused input)"
                return 0
            self._pads = pads
        if reusable is not None:
            self._admit_limit = min(self._admit_limit, self._seen + reusable)
        self.store.drop(self)  # its own lookups would commit it: a state at every chunk's end (held again after)
        ids = torch.cat([self.held_tokens(), input_ids.detach().cpu()], dim=1)
        tail = self._tail(logits_tokens, input_ids.shape[1], ids.shape[1])
        if ids.shape[1] - tail <= self._seen:
            return 0
        seen = self._seen
        common, rows, rows_reused = self._resume(ids, tail, seen)
        self._plan_repeat(ids.shape[1] - tail, common)
        if common > seen:
            self.store.record_request(rows, replacing=self._report.rows)
            self._report.rows, self._seen = rows, common  # (what the request admitted so far stays counted)
            self.rows_reused, self.reused_tokens = rows_reused, max(rows_reused)
            self._fed.append(ids[:, seen:common])
        return common - seen

    @under_store_lock
    def admit_nothing(self) -> None:
        """A forward of this request whose positions or mask are not the plain continuation of what it holds (packed
        documents restarting positions, pads among new tokens): it runs as given over the held tokens, and the
        request is not admitted (the store would hold its KV as if at plain positions)."""
        if self._admit_rows:
            self._admit_rows, self._report.admission = [], "not admitted (refused input)"
            self.store.drop(self)

    def _tail(self, logits_tokens: int, new: int, total: int) -> int:
        """The last columns of a forward over `new` columns (`total` so far) that must run: the store's minimum, the
        logits asked for, any past what may be admitted, and 2 while a row is pads only (rows.pad_safe_splits)."""
        return max(self.store.min_prefill_tokens, min(logits_tokens, new), total - self._admit_limit,
                   min(2, new) if PADS_ONLY in self._pads else 0)

    def _plan_repeat(self, position: int, common: int) -> None:
        """Where an identical prompt would resume (all but its last tail tokens), recorded by patched layers within
        the pass (a split would change an unpatched miss's rounding); a later chunk drops it (not the prompt's end)."""
        if self.store.records_in_kernel and position > common:
            self._plan = sorted({*self._plan, position})
            self._provisional.add(position)

    def capture_splits(self, start: int, stop: int) -> list[int]:
        """Positions strictly inside (start, stop) where a forward over tokens [start, stop) must pause, so the
        recurrent states there can be captured (a patched model records them in one pass instead)."""
        if not self.store.layout.state_layers or self.store.records_in_kernel:
            return []
        # a one-token segment runs as a decode step: unsafe anywhere where those differ from prefills (pad_safe_splits)
        unsafe_below = stop if self.store.decode_differs else max(self._pads, default=0)
        return pad_safe_splits([p for p in self._plan if start < p < stop], start, stop, unsafe_below)

    @under_store_lock
    def record(self, input_ids: torch.Tensor) -> None:
        """A forward is about to run over `input_ids` [batch, t] (as the store sees them: images keyed by content,
        multimodal.py); offsets to record are set for patched layers."""
        self._require_started()
        if input_ids.shape[1] == 1 and self._seen and self._decode_start is None and self.store.decode_differs:
            # the first decode step: if any computes what a prefill would not (patched layers tell, through
            # prefixlab_decode_differs; transformers' cannot), the store gets the sequence up to here
            self._decode_start, self._decode_differs = self._seen, {} if self.store.records_in_kernel else {None: True}
            self._captured.setdefault(self._seen, snapshot_states(self.layers, self.store.layout.state_layers))
        self._fed.append(input_ids.detach().cpu())
        self._pending = input_ids.shape[1]
        stop = self._seen + self._pending
        if self._row_plans:  # each row its own offsets (its end among them): patched layers record them by row
            self.prefixlab_capture_positions = [[p - self._seen for p in plan if self._seen <= p <= stop]
                                                for plan in self._row_plans]
            return
        offsets = [p - self._seen for p in self._plan if self._seen <= p <= stop]
        self.prefixlab_capture_positions = offsets or None

    @under_store_lock
    def forward_done(self) -> None:
        """The forward in flight succeeded: its tokens are now held; capture the state at its end if planned."""
        self._seen += self._pending
        self._pending, self._ran = 0, True
        self.prefixlab_capture_positions = None
        self.store.hold(self)  # admitted on the store's next use
        if self._seen in self._plan:
            self._captured[self._seen] = snapshot_states(self.layers, self.store.layout.state_layers)
            self._plan.remove(self._seen)

    @under_store_lock
    def forward_failed(self) -> None:
        """A forward raised: some layers advanced and others not, so nothing here is trustworthy. Forget it all;
        reusing this cache starts a new request. The store never saw a partial state, nor counts a request whose
        first forward failed (bad input the model refused)."""
        if not self._ran and not self.store.closed:
            self.store.record_request([], replacing=self._report.rows)
        if self._report.admission.startswith("pending"):
            self._report.admission = "not admitted (a forward of the request failed)"
        self._forget_request()

    def _forget_request(self) -> None:
        self.layers = DynamicCache(config=self.store.model.config).layers
        self.store.drop(self)
        self._clear_request()
        self.reused_tokens = 0
        self.prefixlab_capture_positions = None

    def prefixlab_record(self, layer_idx: int, offset: int, conv_state: torch.Tensor | None,
                         recurrent_state: torch.Tensor | None, row: int | None = None, state_idx: int = 0) -> None:
        """Called by patched recurrent layers (recurrent capture protocol) with the states after `offset` tokens of
        the current forward (of batch row `row` alone, [1, ...], where rows capture apart; the layer's state
        `state_idx`, 0 but for Qwen4-Exp's PLE states, families/ple.py); the tensors are already
        the caller's clones (detached here: with grad enabled the store would otherwise keep the request's autograd
        graph alive)."""
        if row is not None:
            states = self._row_captured.setdefault((row, self._seen + offset), {"conv": {}, "recurrent": {}})
        else:
            states = self._captured.setdefault(self._seen + offset, {"conv": {}, "recurrent": {}})
        if conv_state is not None:
            states["conv"][(layer_idx, state_idx)] = conv_state.detach()
        if recurrent_state is not None:
            states["recurrent"][(layer_idx, state_idx)] = recurrent_state.detach()
        if self._seen + offset in self._plan:
            self._plan.remove(self._seen + offset)

    def prefixlab_decode_differs(self, differs: torch.Tensor) -> None:  # patched layers, per decode step (base.py)
        flags, device = self._decode_differs, differs.device
        flags[device] = flags[device] | differs if device in flags else differs

"""A batch's rows for HybridPrefixCache: which columns are left padding, whether positions are the real ones, and
per-row tensors stacked into one padded batch (pure tensor functions)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefixlab.cache.tensors import TOKEN_AXIS

# the pads of a row that is pads only so far (a chunk of a left-padded prompt): its real tokens start further on
PADS_ONLY = 1 << 62


def left_pads(attention_mask: torch.Tensor | None, batch: int, length: int,
              pads_only_rows: bool = False) -> list[int] | None:
    """Leading zero columns of each row of a 2D left-padding mask ([0]*batch without a mask); None if the mask is
    anything else (zeros after ones, non-binary, another shape, a row without a real token unless `pads_only_rows`:
    then such a row's pads are PADS_ONLY)."""
    if attention_mask is None:
        return [0] * batch
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        return None
    mask = attention_mask.detach().cpu()
    pads = (mask == 0).long().cumprod(dim=1).sum(dim=1)
    expected = torch.arange(length)[None, :] >= pads[:, None]
    if not torch.equal(mask.bool(), expected) or not bool(((mask == 0) | (mask == 1)).all()):
        return None
    if bool((pads == length).any()) and not pads_only_rows:
        return None
    return [PADS_ONLY if pad == length else pad for pad in pads.tolist()]


def right_pad_mask(ends: list[int], length: int) -> torch.Tensor:
    """[batch, length] long: ones on each row's first `ends[row]` columns, zeros after (right padding)."""
    return (torch.arange(length)[None, :] < torch.tensor(ends)[:, None]).long()


def right_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D token rows as one right-padded batch and its mask; a row's pads repeat its last token (a valid id, and
    nothing past a row's end is read)."""
    width = max(len(row) for row in rows)
    ids = torch.stack([torch.cat([row, row[-1:].expand(width - len(row))]) for row in rows])
    return ids, right_pad_mask([len(row) for row in rows], width)


def right_padded(attention_mask: torch.Tensor | None, ends: list[int], length: int) -> bool:
    """Whether a [batch, length] mask is ones on each row's first `ends[row]` (>= 1) columns and zeros after."""
    if attention_mask is None or tuple(attention_mask.shape) != (len(ends), length) or not all(ends):
        return False
    return torch.equal(attention_mask.detach().cpu(), right_pad_mask(ends, length).to(attention_mask.dtype))


def real_positions(position_ids: torch.Tensor | None, pads: list[int], length: int, has_attention: bool,
                   cached: int | None = None) -> bool:
    """Whether each row's real tokens run at positions 0, 1, ... (what cached KV was computed at) on the first
    `cached` columns (all by default; those the store may serve or take: past an image M-RoPE positions are offset):
    position_ids [batch, length] or [k, batch, length] must say so on real columns; without them the model counts
    columns, which is right only without pads (or without attention layers, where positions do not matter)."""
    if position_ids is None:
        return not has_attention or not any(pads)
    ids = position_ids.detach().cpu().long()
    ids = ids[None] if ids.dim() == 2 else ids
    if ids.dim() != 3 or tuple(ids.shape[1:]) != (len(pads), length):
        return False
    stop = length if cached is None else cached
    return all(torch.equal(ids[:, row, pad:stop], torch.arange(max(stop - pad, 0)).expand(ids.shape[0], -1))
               for row, pad in enumerate(pads))



def resolve_pads(pads: list[int], attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, seen: int,
                 total: int, has_attention: bool) -> list[int] | None:
    """The `pads` of a request after a forward over columns [seen, total), where rows of PADS_ONLY may start: the
    mask of the tokens so far must agree with the pads known, and a row starting here must run at its real positions
    (0, 1, ... from its first real column, as `begin` requires of every row). None where they do not."""
    now = left_pads(attention_mask, len(pads), total, pads_only_rows=True)
    if now is None or any(new != old if old != PADS_ONLY else new < seen for old, new in zip(pads, now, strict=True)):
        return None
    starting = [new - seen if old == PADS_ONLY and new != PADS_ONLY else PADS_ONLY  # (PADS_ONLY: not checked)
                for old, new in zip(pads, now, strict=True)]
    if all(pad == PADS_ONLY for pad in starting):
        return now
    return now if real_positions(position_ids, starting, total - seen, has_attention) else None


def one_column(depths: list[int], pads: list[int], deepest: Callable[[int, int], int]) -> list[int]:
    """Each row's reuse when a batch resumes at one column: from each row's deepest checkpoint (`depths`), a row
    whose checkpoint sits at another column (pad + depth) than the least is re-matched at a checkpoint at or before
    it (`deepest(row, depth limit)` -> depth) until all agree; a row at depth 0 starts fresh (only pads before it)."""
    depths = list(depths)
    common = min(pad + depth for pad, depth in zip(pads, depths, strict=True))
    while stale := [row for row, depth in enumerate(depths) if depth and pads[row] + depth != common]:
        for row in stale:
            depths[row] = deepest(row, max(0, common - pads[row]))
        common = min(pad + depth for pad, depth in zip(pads, depths, strict=True))
    return depths


def continues_at(position_ids: torch.Tensor | None, seen: int, pads: list[int] | None, mrope: bool = False,
                 every_column: bool = False) -> bool:
    """Whether a forward over a cache holding `seen` columns starts each row at its real position `seen - pad`, as
    a continuation of what the cache holds does (a later generate() call with another prompt starts elsewhere), and
    with `every_column` goes on from there one position a column; True where it cannot be told (no positions, rows
    not admitted, positions broadcast over rows padded apart, or on a model offsetting positions past an image,
    `mrope`, any but generate's 4 rows, whose first counts text)."""
    if position_ids is None or pads is None or position_ids.shape[-1] == 0:
        return True
    ids = position_ids.detach()
    ids = ids[None] if ids.dim() == 2 else ids
    if ids.dim() == 3 and (mrope or len(ids) in (3, 4)):  # M-RoPE: past an image its rows are offset from the columns
        if len(ids) != 4:  # (text positions + the image's offset, generate's later calls: cannot be told)
            return True
        ids = ids[:1]  # 4 rows: the first counts text positions
    if ids.dim() != 3 or ids.shape[1] not in (1, len(pads)) or (ids.shape[1] == 1 and len(set(pads)) > 1):
        return True
    expected = [seen - pad for pad in pads[: ids.shape[1]]]
    if every_column:
        want = torch.tensor(expected, device=ids.device)[:, None] + torch.arange(ids.shape[-1], device=ids.device)
        return bool(((ids == want) | (want < 0)).all())  # (columns a row still pads: any position)
    # (plain lists: at a decode step's size, building and comparing tensors costs more than the step's cache work)
    return all(position == want for row in ids[:, :, 0].tolist() for position, want in zip(row, expected, strict=True)
               if want >= 0)  # a row still in its left pads there has a pad's position (whatever the model fills in)


def continues_past_masked(position_ids: torch.Tensor | None, mask: torch.Tensor | None, seen: int,
                          pads: list[int] | None) -> bool:
    """Whether a forward over a cache holding `seen` columns, whose first columns its 2-D `mask` masks (a pad token
    fed mid-prompt, a prefill chunk starting there), goes on at each row's real position `seen - pad` from its
    first unmasked column (0 for a row still in its left pads at `seen`: there its first real token starts):
    generate counts positions over unmasked tokens only."""
    if position_ids is None or pads is None or mask is None or mask.dim() != 2 or position_ids.dim() != 2:
        return False
    length = position_ids.shape[-1]
    if mask.shape != (len(pads), seen + length) or position_ids.shape[0] not in (1, len(pads)):
        return False
    new = mask[:, seen:].bool().cpu()
    for row, pad in enumerate(pads):
        unmasked = new[row].nonzero()
        want = max(seen - pad, 0)
        if len(unmasked) and int(position_ids[min(row, position_ids.shape[0] - 1), int(unmasked[0])]) != want:
            return False
    return True


def masks_held(mask: torch.Tensor | None, seen: int, pads: list[int] | None) -> bool:
    """Whether a 2-D `mask` over a cache's `seen` held columns and a forward's new ones masks a column some row
    holds as a real token (past its leading pads): a recurrent state already took that token in, so no forward can
    mask it out again (attention can: its KV is masked per column)."""
    if pads is None or mask is None or mask.dim() != 2 or mask.shape[0] != len(pads) or mask.shape[1] < seen:
        return False
    held = ~mask[:, :seen].bool().cpu()
    return any(bool(held[row, pad:].any()) for row, pad in enumerate(pads) if pad < seen)


def continues_plainly(kwargs: dict, seen: int, pads: list[int] | None, mrope: bool, row_ends: list[int] | None) -> bool:
    """Whether a multi-token forward over a cache holding `seen` columns continues it plainly: every column at its
    real position (continues_at) and, unless rows are right-padded (`row_ends`), a 2-D mask over the held and new
    columns that masks only each row's leading ones (pads between held and new tokens would be stored as tokens);
    True where it cannot be told."""
    if not continues_at(kwargs.get("position_ids"), seen, pads, mrope, every_column=True):
        return False
    mask, width = kwargs.get("attention_mask"), seen + kwargs["input_ids"].shape[1]
    if row_ends is not None or mask is None or mask.dim() != 2 or mask.shape[1] != width:
        return True
    return left_pads(mask, mask.shape[0], width, pads_only_rows=True) is not None


def pad_safe_splits(splits: list[int], start: int, stop: int, unsafe_below: int) -> list[int]:
    """The sorted `splits` of a forward over columns [start, stop), less those that would cut a one-token segment
    at a column < unsafe_below. transformers takes a one-token forward over a cached state for a decode step: it
    masks no pads there (so a segment at a column some row still pads, < its max pads, would feed a pad into the
    row's state), and where decode steps compute differently from prefills no one-token segment is safe
    (unsafe_below = stop). A dropped split only loses that capture."""
    kept: list[int] = []
    for split in splits:
        if not (split - (kept[-1] if kept else start) == 1 and split - 1 < unsafe_below):
            kept.append(split)
    if kept and stop - kept[-1] == 1 and kept[-1] < unsafe_below:
        kept.pop()
    return kept

def stack_rows(rows: list[list[torch.Tensor]], common: int, device: torch.device) -> torch.Tensor:
    """One fresh [batch, heads, common, dim] tensor on `device`: each row's pieces joined along the token axis and
    right-aligned at column `common` (zeros before: pad columns). Never aliases the store: requests resume from
    copies."""
    joined = [torch.cat(pieces, dim=TOKEN_AXIS) if len(pieces) > 1 else pieces[0] if pieces else None
              for pieces in rows]
    like = next(t for t in joined if t is not None)
    shape = list(like.shape)
    shape[TOKEN_AXIS] = common
    out = torch.zeros([len(rows), *shape], dtype=like.dtype, device=device)
    for row, tensor in enumerate(joined):
        if tensor is not None and tensor.shape[TOKEN_AXIS]:
            out[row, ..., common - tensor.shape[TOKEN_AXIS]:, :] = tensor.to(device)
    return out


def stack_states(states: list[torch.Tensor | None], device: torch.device, fresh: int = 0) -> torch.Tensor:
    """[batch, ...] copies of each row's state on `device`; the fresh state (`fresh` everywhere: zeros but for the
    states CacheLayout.fresh names) for rows without one."""
    like = next(t for t in states if t is not None)
    return torch.stack([t.to(device) if t is not None else torch.full_like(like, fresh, device=device)
                        for t in states])


def load_rows(layers: list, layout, common: int, sources: list, devices: dict[int, torch.device],
              default: torch.device) -> None:
    """Fill the cache `layers` with copies of each row's matched KV (`sources[row].kv`, its pieces concatenated; a DSA
    indexer's keys too) placed at the last columns before `common` (pad columns before it: zeros, masked out) and
    each row's states (`sources[row].state`; the fresh state for rows that resume nothing), each layer's on its
    device (`devices`, else `default`)."""
    from transformers.cache_utils import DynamicLayer

    for layer_idx in layout.kv_layers:
        device = devices.get(layer_idx, default)
        layer = layers[layer_idx]
        keys = stack_rows([[kv.keys[layer_idx] for kv in source.kv] for source in sources], common, device)
        values = stack_rows([[kv.values[layer_idx] for kv in source.kv] for source in sources], common, device)
        if not layer.is_initialized:
            DynamicLayer.lazy_initialization(layer, keys, values)
        layer.keys, layer.values = keys, values
    for layer_idx in layout.indexer_layers:  # [batch, 1, common, width]: pad columns zero, their valid flag too
        indexer = stack_rows([[kv.indexer[layer_idx] for kv in source.kv] for source in sources], common,
                             devices.get(layer_idx, default))[:, 0]
        if not layers[layer_idx].is_indexer_initialized:
            layers[layer_idx].lazy_initialization_indexer(indexer)
        layers[layer_idx].indexer_keys = indexer
    if layout.position_history is not None:
        layers[layout.position_history].indexer_position_ids = indexer_positions(
            [common - source.length for source in sources], common, devices.get(layout.position_history, default))
    states = [source.state if source.length else None for source in sources]
    model = next(state for state in states if state is not None) if any(states) else None
    fresh = dict(layout.fresh)
    for layer_idx, state_idx in sorted(model.conv) if model else ():  # (state 0 first: it sets the layer's dtype)
        device = devices.get(layer_idx, default)
        conv = stack_states([state and state.conv[(layer_idx, state_idx)] for state in states], device,
                            fresh.get((layer_idx, state_idx), 0))
        layers[layer_idx].update_conv_state(conv, state_idx, conv_kernel_size=conv.shape[-1])
    for layer_idx, state_idx in model.recurrent if model else ():
        device = devices.get(layer_idx, default)
        recurrent = stack_states([state and state.recurrent[(layer_idx, state_idx)] for state in states], device)
        layers[layer_idx].update_recurrent_state(recurrent, state_idx)
        layers[layer_idx].has_previous_state[state_idx] = True


def indexer_positions(pads: list[int], common: int, device: torch.device) -> torch.Tensor:
    """[3, batch, common] positions of `common` held columns, row b's pads[b] first: the QSA indexers' position
    history (Qwen4ExpTextModel keeps it on its first indexed layer, in the 3 M-RoPE rows its rotary embedding takes).
    Held tokens are text at their real positions (images are not reused past their first placeholder); pad columns
    get 1, as generate gives pads (no query sees them)."""
    columns = torch.arange(common)[None, :] - torch.tensor(pads)[:, None]
    return columns.clamp(min=0).masked_fill(columns < 0, 1).expand(3, -1, -1).to(device)

"""The index tables and small tensor helpers every decode path of the production decoder shares: which window rows
and compressed entries a query sees (prefill, eager decode, graph decode), the ``L{i}.attn.visible`` site built
from them, and the activation / pick helpers the sub-layers record sites with."""

from __future__ import annotations

import torch

from fidelity.decoders.production.faults import on
from fidelity.decoders.production.fp8_input import Fp8Input
from fidelity.decoders.production.profiles import Profile
from fidelity.decoders.production.topk import topk_width
from fidelity.model.formats import hadamard


def plain(h: torch.Tensor | Fp8Input) -> torch.Tensor:
    """The bf16 activation of ``h`` (itself, or an :class:`Fp8Input`'s y)."""
    return h.y if isinstance(h, Fp8Input) else h


def unrotated(x: torch.Tensor, prof: Profile) -> torch.Tensor:
    """Indexer q / keys as emitted at their sites: the quantized values taken back out of the Hadamard domain
    (H is orthonormal and self-inverse), so they compare with the oracle's and dot products are unchanged."""
    return hadamard(x.float()) if prof.hadamard == "on" else x


def topk_cap(topk: int) -> int:
    """The indexer's top-k width for ``index_topk`` (fault ``topk-cap-half``: half of it)."""
    topk = topk_width(topk)
    return topk // 2 if on("topk-cap-half") else topk


def pad(picks: torch.Tensor, width: int) -> torch.Tensor:
    """picks [n, k] padded with -1 to ``width`` columns; a wider selection (fault ``index-topk-hardcoded``) is
    recorded whole."""
    return torch.nn.functional.pad(picks, (0, max(0, width - picks.shape[1])), value=-1)


def window_prefill_idx(t: int, win: int, start: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Prefill window TOKEN POSITIONS [t, min(start + t, win)] of the chunk's queries start..start+t-1: query p
    sees max(0, p-win+1) .. p, valid first (the official prefill: start 0); built on ``device``."""
    base = torch.arange(start, start + t, device=device)[:, None]
    idx = (base - win + 1).clamp(min=0) + torch.arange(min(start + t, win), device=device)[None]
    idx = torch.where(idx > base, -1, idx)
    if on("window-127"):
        idx = torch.where(idx == base - win + 1, -1, idx)
    if on("window-no-self"):
        idx = torch.where(idx == base, torch.where(base >= win, base - win, -1), idx)
    return idx


def window_decode_idx(t: int, win: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Official decode window indices [1, win] into the ring buffer, oldest first (built on ``device``)."""
    if t >= win - 1:
        s = t % win
        idx = ((torch.arange(win, device=device) + s + 1) % win)[None]
        if on("window-127"):
            idx[0, 0] = -1
    else:
        idx = torch.nn.functional.pad(torch.arange(t + 1, device=device), (0, win - t - 1), value=-1)[None]
    if on("window-no-self"):
        idx = torch.where(idx == t % win, -1, idx)
    return idx


def window_idx_on_device(pos: torch.Tensor, win: int) -> torch.Tensor:
    """:func:`window_decode_idx` for a position in a device tensor (int64 [1]) -> [1, win] ring slots, oldest
    first, -1 where the window is not full yet."""
    j = torch.arange(win, device=pos.device)
    s = pos % win
    ring = (j + s + 1) % win
    if on("window-127"):
        ring = torch.where(j == 0, -1, ring)
    idx = torch.where(pos >= win - 1, ring, torch.where(j <= pos, j, -1))[None]
    if on("window-no-self"):
        idx = torch.where(idx == s, -1, idx)
    return idx


def hca_prefill_idx(t: int, ratio: int, start: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """All entries j < (p+1)//ratio per query p of the chunk [t, (start+t)//ratio], -1 otherwise, built on
    ``device`` (at 1M context a 16K-token chunk's table is 1 GB of int64: no host copy)."""
    j = torch.arange((start + t) // ratio, device=device)[None]
    limit = (torch.arange(start + 1, start + t + 1, device=device) // ratio)[:, None] + \
        (1 if on("causal-off-by-one") else 0)
    return torch.where(j >= limit, -1, j)


def visible(window_idx: torch.Tensor, comp: torch.Tensor | None, positions: torch.Tensor, win: int,
            prefill: bool) -> torch.Tensor:
    """The ``L{i}.attn.visible`` site: window token positions then compressed entry ids (-1 padding)."""
    if prefill:
        window_pos = window_idx
    else:
        t = positions[:1]  # on the device: no host read (graph decode records this site from a captured step)
        slot_pos = t - ((t - torch.arange(win, device=window_idx.device)) % win)  # token position in each slot
        window_pos = torch.where(window_idx >= 0, slot_pos[window_idx.clamp(min=0)], -1)
    window_pos = torch.nn.functional.pad(window_pos, (0, win - window_pos.shape[1]), value=-1)
    if comp is None:
        return window_pos
    return torch.cat((window_pos, comp), dim=1)

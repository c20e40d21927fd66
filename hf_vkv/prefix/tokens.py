"""Token ids of one sequence, checked: what the store's keys and the prefix files' ids are made of."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..memory.errors import ArgumentError, ArgumentTypeError

__all__ = ["check_unpadded", "outside_vocabulary", "token_list"]


def token_list(token_ids: Any, *, name: str = "token_ids") -> list[int]:
    """Token ids of one sequence as ints: a ``[T]`` or ``[1, T]`` integer tensor, or a sequence."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise ArgumentTypeError(
                f"{name} must be one sequence of integer token ids ([T] or [1, T]), got a {token_ids.dtype} "
                f"tensor of shape {tuple(token_ids.shape)}; entries are batch-1: pass one row"
            )
        return token_ids.tolist()  # an integer tensor's items are ints
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ArgumentTypeError(f"{name} must be a tensor or a sequence of int token ids, got {type(token_ids).__name__}")
    out = list(token_ids)
    if set(map(type, out)) <= {int}:  # the common case, in C (a turn's ids: thousands)
        return out
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool):
            raise ArgumentTypeError(f"{name} must hold ints only, got a {type(t).__name__} ({t!r}): pass the token "
                                    f"ids as ints (tensor.tolist() gives them)")
    return out


def outside_vocabulary(ids: Sequence[int], config: Any) -> tuple[int, int, int] | None:
    """The first ``(position, id)`` of ``ids`` outside ``config``'s vocabulary, and the vocabulary's
    size (its text config's ``vocab_size``); ``None`` where all are inside or the size is not known."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or not ids or (0 <= min(ids) and max(ids) < vocab):
        return None
    return next(((i, t, vocab) for i, t in enumerate(ids) if not 0 <= t < vocab), None)


def check_unpadded(cache: Any, doing: str) -> None:
    """Raise :class:`~hf_vkv.ArgumentError` where ``cache`` holds columns an attention mask hid
    (``VKVCache.padded``: a left-padded batch's row holds its padding's columns and positions
    counted from its first real token, so its K/V are not those of its token ids from position 0;
    kept as a prefix of those ids, they gave other tokens)."""
    if getattr(cache, "padded", False):
        raise ArgumentError(
            f"{doing}: the cache's rows hold columns an attention mask hid (a left-padded batch, or a mask with "
            f"zeros), so its K/V are not those of its token ids from position 0 and a prefix of them would give other "
            f"tokens; generate the prompt alone without padding to keep it, or pass cache_config={{'prefix_store': "
            f"store}} to generate, which stores each row without its padding")

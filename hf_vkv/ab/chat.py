"""``hf-vkv chat``: a chat through one prefix store, each turn's reuse beside DynamicCache's re-prefill.

Every turn sends the whole conversation (system prompt, earlier turns, the new message) to
``generate(cache_implementation="vkv", cache_config={"prefix_store": store})``, which prefills only
what the store does not hold; then, unless asked not to, DynamicCache generates the same turn
from scratch (what transformers does by default: the whole history prefilled again). Each turn
reports the prompt's tokens, those reused from the store and those computed, both times to first
token, and whether the two answers are the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from ..generate import reuse_report
from ..prefix import PrefixStore

__all__ = ["FirstTokenClock", "Turn", "chat_turns", "format_turn"]


class FirstTokenClock(BaseStreamer):
    """A streamer that notes when the first generated token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        """The generation's end: nothing to record (the first token's time is taken in :meth:`put`)."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of :func:`chat_turns`."""

    turn: int  # from 1
    prompt_tokens: int  # the whole conversation so far, as the model reads it
    reused_tokens: int  # taken from the store (not computed)
    computed_tokens: int  # prompt tokens the vkv prefill computed
    ttft_vkv_s: float  # time to first token with the store
    ttft_dynamic_s: float | None  # DynamicCache re-prefilling the whole conversation (None: not compared)
    same_tokens: bool | None  # the two answers are the same tokens (None: not compared)
    answer: str


def _first_token(model: Any, ids: torch.Tensor, **kwargs: Any) -> tuple[float, torch.Tensor]:
    clock = FirstTokenClock()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
    assert clock.first_token_at is not None
    return clock.first_token_at - start, out


def chat_turns(model: Any, tokenizer: Any, messages: Iterable[str], *, store: PrefixStore, system: str | None = None,
               max_new_tokens: int = 32, compare: bool = True) -> Iterator[Turn]:
    """Chat through ``store``: one :class:`Turn` per user message of ``messages`` (greedy)."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for k, message in enumerate(messages, start=1):
        history.append({"role": "user", "content": message})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"].to(model.device)
        common = {"max_new_tokens": max_new_tokens, "do_sample": False}
        before = store.stats().prompt_tokens_computed
        ttft, result = _first_token(model, ids, cache_implementation="vkv", cache_config={"prefix_store": store},
                                    return_dict_in_generate=True, **common)
        report, out = reuse_report(result), result.sequences
        ttft_dyn = same = None
        if compare:
            ttft_dyn, want = _first_token(model, ids, **common)
            same = bool(torch.equal(want, out))
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        history.append({"role": "assistant", "content": answer})
        yield Turn(turn=k, prompt_tokens=ids.shape[1], reused_tokens=report.reused_tokens if report else 0,
                   computed_tokens=store.stats().prompt_tokens_computed - before, ttft_vkv_s=ttft,
                   ttft_dynamic_s=ttft_dyn, same_tokens=same, answer=answer)


def format_turn(turn: Turn) -> str:
    """Two lines: the turn's numbers, then its answer."""
    line = (f"turn {turn.turn}: {turn.prompt_tokens:,} prompt tokens, {turn.reused_tokens:,} reused, "
            f"{turn.computed_tokens:,} computed; first token after {turn.ttft_vkv_s:.2f} s")
    if turn.ttft_dynamic_s is not None:
        line += (f" (DynamicCache re-prefill: {turn.ttft_dynamic_s:.2f} s, "
                 f"{turn.ttft_dynamic_s / turn.ttft_vkv_s:.1f}x; same tokens: {'yes' if turn.same_tokens else 'NO'})")
    return f"{line}\n  assistant: {turn.answer}"

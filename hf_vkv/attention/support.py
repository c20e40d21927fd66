"""Which models the ``"vkv_paged"`` and ``"vkv_cascade"`` attentions can serve exactly, decided from
the model class and config.

The paged attention computes what transformers' sdpa attention computes (scaled dot product, an
optional bool/float mask, GQA) over the K/V a paged cache layer returns: by default the layer's
tokens gathered through the block tables, what ``DynamicCache`` returns, so a model that reworks
them after the update (DiffLlama splits the values, multi-head latent attention expands cached
latents into keys and values, T5 sizes its position bias by the keys) computes exactly as on
``DynamicCache``. A model needs more than that when its attention

* does not go through transformers' ``AttentionInterface`` at all (MPT, Bloom, CodeGen, GPT-J,
  Falcon, GPT-Neo, XGLM, ...): it never calls ``"vkv_paged"``;
* adds attention sinks (``s_aux``, GPT-OSS) or logit softcapping (``attn_logit_softcapping``, Gemma 2);
* declares ``_supports_sdpa = False`` for any other reason (an sdpa-shaped computation is not exact).

The fused kernel (``cache_config={"paged_kernel": "fused"}``) reads the blocks in place, so there
the layer returns only the new states, tagged: a model that replaces them after the update is
refused at its first forward (:mod:`hf_vkv.attention.guards`), and one whose attention expands
cached latents (which replaces both, leaving nothing to tell by) when the cache is made
(:class:`~hf_vkv.CacheOptionError`).

The cascade (``"vkv_cascade"``) computes sdpa's attention too, reading a shared prefix once, so the
same three refuse it. :func:`attention_refusal` names the first of these that applies; ``None``
means the model is served.
The checks read the model's class, its modeling module's source (as transformers' own
``_can_set_attn_implementation`` does) and its config, so they run in ``PreTrainedModel.__init__``,
before any weight exists.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from ..kv_records import CASCADE_ATTENTION, PAGED_ATTENTION
from .errors import UnsupportedModelError

__all__ = ["attention_refusal", "check_attention_support", "model_type_of", "own_attention_instead"]

#: What each of vkv's attentions is called in a refusal.
_NAMES = {PAGED_ATTENTION: "the paged attention", CASCADE_ATTENTION: "the cascade attention"}


def own_attention_instead(attention: str) -> str:
    """What to do for a model whose attention code is its own (the contiguous layout needs no attention help)."""
    return (f"keep the model's own attention (do not pass attn_implementation={attention!r}) and generate with "
            "cache_implementation='vkv': the contiguous layout hands its attention ordinary tensors")


@functools.lru_cache(maxsize=None)
def _module_source(module_name: str) -> str:
    module = sys.modules.get(module_name)
    if module is None:
        return ""
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


def model_type_of(config: Any, fallback: str) -> str:
    """The config's ``model_type`` (``fallback`` when it has none)."""
    return getattr(config, "model_type", None) or fallback


def _softcapping(config: Any) -> Any:
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config(decoder=True))
    for c in configs:
        cap = getattr(c, "attn_logit_softcapping", None)
        if cap is not None:
            return cap
    return None


def attention_refusal(model_class: type, config: Any, attention: str = PAGED_ATTENTION) -> UnsupportedModelError | None:
    """The error ``attention`` (``"vkv_paged"`` or ``"vkv_cascade"``) raises for ``model_class``
    built from ``config``, or ``None`` when it computes this model's attention exactly."""
    name = _NAMES[attention]
    model_type = model_type_of(config, model_class.__name__)
    can_set = getattr(model_class, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return UnsupportedModelError(
            model_type=model_type,
            feature=f"{model_class.__name__}'s attention does not call transformers' AttentionInterface (its own "
                    f"attention code would never run {name})",
            instead=own_attention_instead(attention), attention=attention,
        )
    source = _module_source(model_class.__module__)
    uses_interface = "ALL_ATTENTION_FUNCTIONS" in source
    if not uses_interface:
        return None  # no attention of its own (Mamba, ...) or a wrapper of sub-models checked on their own
    if "s_aux" in source:
        return UnsupportedModelError(model_type=model_type, attention=attention,
                                     feature=f"attention sinks (s_aux) are not part of {name}")
    cap = _softcapping(config)
    if cap is not None:
        return UnsupportedModelError(
            model_type=model_type, attention=attention,
            feature=f"attention logit softcapping (attn_logit_softcapping={cap}) is not part of {name}")
    if getattr(model_class, "_supports_sdpa", True) is False:
        return UnsupportedModelError(
            model_type=model_type, attention=attention,
            feature=f"{model_class.__name__} declares _supports_sdpa = False: its attention needs more than the "
                    f"scaled dot product {name} computes",
        )
    return None


def check_attention_support(model_class: type, config: Any, attention: str = PAGED_ATTENTION) -> None:
    """Raise :class:`UnsupportedModelError` when :func:`attention_refusal` finds a reason."""
    error = attention_refusal(model_class, config, attention)
    if error is not None:
        raise error

"""Errors of the attention side: what the ``"vkv_paged"`` and ``"vkv_cascade"`` attentions refuse to serve."""

from __future__ import annotations

from ..memory.errors import VKVError

__all__ = ["UnsupportedModelError", "CONTIGUOUS_INSTEAD"]

#: What a user refused by the paged or cascade attention can do instead (the contiguous layout reads any attention).
CONTIGUOUS_INSTEAD = (
    "load the model with its own attention (attn_implementation='sdpa' or 'eager', or leave it unset) and "
    "generate with cache_implementation='vkv': the contiguous layout serves every attention implementation"
)


class UnsupportedModelError(VKVError, ValueError):
    """The ``"vkv_paged"`` (or ``"vkv_cascade"``) attention cannot compute this model's attention exactly.

    Raised as early as possible (``from_pretrained(attn_implementation="vkv_paged")``,
    ``model.set_attn_implementation("vkv_paged")``, the same for ``"vkv_cascade"``, else the first forward), never replaced by a
    silent fallback: a wrong token is not an acceptable result.

    Attributes:
        model_type: the config's ``model_type`` (``"t5"``, ``"gpt_oss"``, ...) or the module's class.
        feature: what the attention cannot honour ("attention sinks (s_aux) are not part of ...", ...).
        instead: what to do instead.
        attention: the attention implementation that refuses (``"vkv_paged"``, ``"vkv_cascade"``).
    """

    def __init__(self, *, model_type: str, feature: str, instead: str = CONTIGUOUS_INSTEAD,
                 attention: str = "vkv_paged") -> None:
        self.model_type = model_type
        self.feature = feature
        self.instead = instead
        super().__init__(
            f"hf_vkv: attn_implementation={attention!r} cannot serve model type {model_type!r}: {feature}. "
            f"Instead, {instead}."
        )

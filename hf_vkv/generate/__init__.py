"""The wing that hooks transformers' generation: the one patch registry (:mod:`.registry`), the
per-call record (:mod:`.call`), prefill once and its exactness proofs (:mod:`.prefill_once`,
:mod:`.row_exactness`) and the per-call half of prefix reuse (:mod:`.reuse`).

It imports ``cache``, ``prefix``, ``attention``, ``memory`` and ``devices``; nothing below it
imports it (``docs/architecture.md``)."""

from .call import GenerateCall, reuse_report
from .names import CACHE_IMPLEMENTATION, CACHE_NAMES, cache_kwarg
from .registry import Patch, patches, register

__all__ = ["CACHE_IMPLEMENTATION", "CACHE_NAMES", "GenerateCall", "Patch", "cache_kwarg", "patches", "register", "reuse_report"]

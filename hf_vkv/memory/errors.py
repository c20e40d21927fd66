"""The three tiers of errors.

Every error hf_vkv raises on purpose is a :class:`VKVError` (``tests/unit/test_error_types.py``
checks the package's source for a raise of a builtin exception class):

* bad input: ``ValueError`` / ``TypeError`` / ``IndexError`` subclasses naming the argument and the
  fix, raised before anything changes;
* exhaustion: :class:`KVCacheOutOfMemory`, raised *before* any bookkeeping changes;
* bugs and broken backends: ``RuntimeError`` subclasses that say so.
"""

from __future__ import annotations

__all__ = [
    "VKVError",
    "CacheOptionError",
    "CacheOptionTypeError",
    "ArgumentError",
    "ArgumentTypeError",
    "CacheIndexError",
    "CompiledModuleError",
    "MissingDependencyError",
    "KVCacheOutOfMemory",
    "CapacityError",
    "CacheClosedError",
    "BackendError",
    "InvariantError",
]


class VKVError(Exception):
    """Base class of every error hf_vkv raises on purpose."""


class CacheOptionError(VKVError, ValueError):
    """A ``cache_config`` key or ``VKVCache`` keyword that is unknown, removed, out of range or does
    not apply to the chosen layout (the message names the key and what to write instead)."""


class CacheOptionTypeError(VKVError, TypeError):
    """A ``cache_config`` that is not a dict, or an option whose value has the wrong type (the
    message names the option and the type it takes)."""


class ArgumentError(VKVError, ValueError):
    """An argument of an hf_vkv call (not a ``cache_config`` option) that is out of range or does not
    fit what it is given to: a length past a cache's, a cache of another model, a file where a folder
    goes. Raised before anything changes; the message names the argument and what it takes."""


class ArgumentTypeError(VKVError, TypeError):
    """An argument of an hf_vkv call of the wrong type (the message names it and the type it takes)."""


class CompiledModuleError(VKVError, ValueError):
    """``generate`` with a vkv cache on a model whose modules were compiled in place
    (``model.compile()``, ``module.compile()``): the compiled code reads vkv's K/V views with other
    kernels than DynamicCache's tensors (recompiling as their strides change), and its logits came
    out a rounding apart. The message names the modules and what to do instead."""


class CacheIndexError(VKVError, IndexError):
    """A row or layer index outside the cache (the message names the index and the valid range);
    nothing was changed."""


class MissingDependencyError(VKVError, ModuleNotFoundError):
    """A package an optional part of hf_vkv needs is not installed (``name``: its import name);
    the message gives the ``pip install`` command (an extra such as ``hf_vkv[plot]``)."""


class KVCacheOutOfMemory(VKVError, MemoryError):
    """The page budget cannot hold what was asked for.

    Raised before any page table or mapping changes, so the cache stays usable: free rows (or
    raise ``budget_bytes``) and retry the same call.
    """

    def __init__(self, *, requested_bytes: int, free_bytes: int, budget_bytes: int, what: str = "pages",
                 fits_bytes: int | None = None, message: str | None = None,
                 budget: str | None = None) -> None:
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        self.budget_bytes = budget_bytes
        #: A ``budget_bytes`` that would hold what was asked for on top of what is held (when known).
        self.fits_bytes = fits_bytes
        self.what, self.budget = what, budget
        budget = budget or "cache_config['budget_bytes']"  # where the budget is set (a prefix store's memory: its own)
        raise_to = f"raise {budget} to at least {fits_bytes:,}" if fits_bytes is not None else f"raise {budget}"
        super().__init__(message or
            f"KV cache out of memory: {what} need {requested_bytes:,} bytes but only {free_bytes:,} of the "
            f"{budget_bytes:,}-byte budget are free. Free finished rows, lower the batch or max_new_tokens, "
            f"or {raise_to}."
        )

    def for_whole_step(self, *, requested_bytes: int, free_bytes: int, budget_bytes: int, what: str,
                       fits_bytes: int, budget: str | None = None) -> KVCacheOutOfMemory:
        """This error restated for the whole step it interrupted (the allocation that failed is one
        sub-row's page after the step's earlier ones took the free pages): the step's total need,
        what is free, and a budget that fits it."""
        return KVCacheOutOfMemory(requested_bytes=requested_bytes, free_bytes=free_bytes, budget_bytes=budget_bytes,
                                  what=what, fits_bytes=fits_bytes, budget=budget)

    def for_whole_call(self, *, rows: int, tokens: int, call_bytes: int, held_bytes: int) -> KVCacheOutOfMemory:
        """This error restated for the ``generate`` call it interrupted: its ``fits_bytes`` holds the
        whole call, not only the step that failed (a budget that fitted the step failed again one
        token later). ``call_bytes``: what the call's ``rows`` rows hold at most at ``tokens``
        tokens each (no page shared); ``held_bytes``: what the call's cache holds now (the rest of
        the memory in use is held by others: a prefix store's entries, other caches)."""
        others = max(self.budget_bytes - self.free_bytes - held_bytes, 0)
        fits = max(others + call_bytes, self.fits_bytes or 0)
        budget = self.budget or "cache_config['budget_bytes']"
        step = f"{self.fits_bytes:,} fits this step, and " if self.fits_bytes is not None else ""
        return KVCacheOutOfMemory(
            requested_bytes=self.requested_bytes, free_bytes=self.free_bytes, budget_bytes=self.budget_bytes,
            what=self.what, fits_bytes=fits, budget=self.budget,
            message=f"KV cache out of memory: {self.what} need {self.requested_bytes:,} bytes but only "
                    f"{self.free_bytes:,} of the {self.budget_bytes:,}-byte budget are free. Free finished rows, lower "
                    f"the batch or max_new_tokens, or raise {budget} to at least {fits:,}, which holds the whole call "
                    f"({step}its {rows} row(s) reaching {tokens:,} tokens hold at most {call_bytes:,} bytes with no "
                    f"page shared, beside {others:,} held by others).")


class CapacityError(VKVError, ValueError):
    """A row would grow past the tokens its virtual reservation was sized for."""


class CacheClosedError(VKVError, RuntimeError):
    """The cache (or buffer) was closed and its pages returned: it cannot be used any more."""


class BackendError(VKVError, RuntimeError):
    """A memory-backend call (mmap, fallocate, a CUDA driver call, ...) failed.

    ``call`` names the failing call; the operation that made it was rolled back.
    """

    def __init__(self, call: str, detail: str) -> None:
        self.call = call
        self.detail = detail
        super().__init__(f"{call} failed: {detail}")


class InvariantError(VKVError, RuntimeError):
    """A bookkeeping invariant does not hold: this is a bug in hf_vkv, please report it."""

"""``hf-vkv prefix``: a system prompt's KV saved to a folder that later processes map, and what a
saved folder holds.

* ``hf-vkv prefix save DIR [--system-file F]``: the embedded model (or ``--model``) computes the
  system prompt — rendered by the chat template as the system message a chat starts with — once,
  and a :class:`~hf_vkv.PrefixStore` holding it is saved to ``DIR`` (``prefix_store.kv`` and its
  index). ``hf-vkv chat --store DIR`` then starts from it without computing it.
* ``hf-vkv prefix inspect DIR [--verify]``: the index (model fingerprint, dtype, weights
  fingerprint, entries and their tokens, pages, bytes); ``--verify`` reads the page file and
  checks every page against its checksum (exit 1 if one differs).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["save_system_prompt", "summary", "system_ids", "verify_folder"]


def system_ids(tokenizer: Any, system: str) -> list[int]:
    """The tokens a chat's system message renders to (its first tokens in every turn)."""
    ids = tokenizer.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False,
                                        tokenize=True, return_dict=False)
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def save_system_prompt(model: Any, tokenizer: Any, system: str, folder: str | Path) -> dict[str, Any]:
    """Compute ``system`` (as a chat's system message) once into a prefix store and save it to
    ``folder``; return the tokens, the seconds of each step and the bytes held."""
    import torch

    from .prefix import PrefixStore

    ids = torch.tensor([system_ids(tokenizer, system)])
    store = PrefixStore(model.config)
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                   cache_implementation="vkv", cache_config={"prefix_store": store})
    computed = time.perf_counter() - t
    t = time.perf_counter()
    store.save(folder, model=model)
    return {"tokens": int(ids.shape[1]), "compute_s": computed, "save_s": time.perf_counter() - t,
            "bytes_held": store.stats().bytes_held}


def _index(path: Path) -> dict[str, Any]:
    """The index at ``path``, checked as :meth:`PrefixStore.load` checks it (a damaged or foreign
    index: :class:`~hf_vkv.PrefixFileCorruptError` or :class:`~hf_vkv.PrefixFormatError` naming it)."""
    from .prefix.store import saved_files

    saved_files(path.parent)
    return json.loads(path.read_text())


def summary(folder: Path) -> dict[str, Any]:
    """What ``folder``'s index (``prefix_store.json``) says: model, dtype, weights fingerprint,
    the mapped entries' token counts, pages, bytes, layout and the prefix files beside them."""
    from .cache.layouts import layout_option
    from .prefix.store import STORE_INDEX

    index = _index(folder / STORE_INDEX)
    mapped = index.get("mapped") or {}
    entries = mapped.get("entries", [])
    return {
        "folder": str(folder), "version": index.get("version"), "writer": index.get("writer"),
        "config_fingerprint": index.get("config_fingerprint"), "dtype": index.get("dtype"),
        "weights_fingerprint": index.get("weights_fingerprint"),
        "model_type": (index.get("config_fields") or {}).get("model_type"),
        "mapped_entries": [len(e.get("tokens", [])) for e in entries],
        "pages": mapped.get("pages", 0), "page_bytes": mapped.get("page_bytes"),
        "layout": [layout_option(str(g.get("layout"))) for g in mapped.get("groups", [])],
        "file_bytes": mapped.get("file_bytes", 0),
        "prefix_files": index.get("files", []),
    }


def verify_folder(folder: Path, *, pages: bool = True) -> tuple[int, float]:
    """Read ``folder``'s page file and check every page against its checksum: ``(pages, seconds)``;
    raises :class:`~hf_vkv.PrefixFileCorruptError` naming the first page that differs.
    ``pages=False``: the page file's header and size only (no page read)."""
    from .prefix.mapped import verify_file
    from .prefix.store import STORE_INDEX

    index = _index(folder / STORE_INDEX)
    t = time.perf_counter()
    checked = verify_file(folder, index["mapped"], pages=pages) if index.get("mapped") else 0
    return checked, time.perf_counter() - t

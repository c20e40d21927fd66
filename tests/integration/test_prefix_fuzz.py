"""Prefix files are verified by content: a bit flipped in any tensor, in the header or in the
token ids, a truncation, and missing or wrong-typed metadata keys are all refused with a prefix
error (never a TypeError/AttributeError, never a cache that generates differently), and a refused
load leaves nothing behind (no cache, no memfd, no mapping)."""

from __future__ import annotations

import gc
import json
import os
import random
from pathlib import Path

import pytest
import torch
from models import prompts, tiny

from hf_vkv import VKVCache, load_prefix, save_prefix
from hf_vkv.prefix.errors import PrefixFileCorruptError, PrefixFileError, PrefixFormatError, PrefixMismatchError
from hf_vkv.generate import cache_kwarg

REFUSED = (PrefixFileError, PrefixMismatchError)


def held() -> tuple[int, int]:
    """memfds open and memfd mappings of the process: what a half-loaded cache would hold (the
    file's own mapping by safetensors lives as long as the error's traceback, which pytest keeps)."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        return fds, sum("/memfd:" in line for line in f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny("llama")
    cache = VKVCache(model.config)
    ids = prompts(1, 10, seed=3)["input_ids"]
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True)
    path = save_prefix(tmp_path_factory.mktemp("fuzz") / "p.safetensors", cache, ids[0].tolist(), model=model)
    return model, path, path.read_bytes()


def header_of(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n])


def refused(model, path: Path, data: bytes, **kw) -> BaseException:
    path.write_bytes(data)
    gc.collect()  # caches earlier tests left to the collector: not counted before and freed during the load
    before = held()
    with pytest.raises(REFUSED) as info:
        load_prefix(path, model=model, **kw)
    assert held() == before  # nothing half-loaded
    return info.value


def test_the_untouched_file_loads(saved, tmp_path):
    model, path, data = saved
    cache, ids = load_prefix(path, model=model)
    assert len(ids) == cache.get_seq_length() == 10


def test_a_bit_flip_in_each_tensor_is_refused_naming_it(saved, tmp_path):
    model, _, data = saved
    n, header = header_of(data)
    rng = random.Random(0)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        for _ in range(3):
            at = 8 + n + rng.randrange(lo, hi)
            bad = bytearray(data)
            bad[at] ^= 1 << rng.randrange(8)
            err = refused(model, tmp_path / "t.safetensors", bytes(bad))
            # a checksum that differs: the file is not whole (docs/api.md), not "not an hf_vkv prefix"
            assert isinstance(err, PrefixFileCorruptError) and repr(name) in str(err), str(err)
            assert "not whole" in str(err), str(err)


def test_bit_flips_across_the_header_are_refused(saved, tmp_path):
    model, _, data = saved
    n, _ = header_of(data)
    rng = random.Random(1)
    for at in range(0, 8 + n, 3):  # every third byte of the length and the JSON header, a random bit
        bad = bytearray(data)
        bad[at] ^= 1 << rng.randrange(8)
        refused(model, tmp_path / "h.safetensors", bytes(bad))


def rewrite(data: bytes, edit) -> bytes:
    """The file with its prefix metadata changed by ``edit(meta)`` (tensors unchanged)."""
    n, header = header_of(data)
    meta = json.loads(header["__metadata__"]["hf_vkv_prefix"])
    edit(meta)
    header["__metadata__"]["hf_vkv_prefix"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def test_other_token_ids_of_the_same_length_are_refused(saved, tmp_path):
    model, _, data = saved

    def swap(meta):
        meta["token_ids"] = [(t + 1) % 50 + 4 for t in meta["token_ids"]]

    err = refused(model, tmp_path / "i.safetensors", rewrite(data, swap))
    assert "token ids do not match" in str(err) or "metadata does not match" in str(err)


def test_out_of_vocabulary_ids_are_refused_naming_the_vocabulary(saved, tmp_path):
    model, _, data = saved
    vocab = model.config.vocab_size

    def oov(meta):  # consistent checksums: only the vocabulary check can catch it
        from hf_vkv.prefix.checksums import _digest, _meta_digest

        meta["token_ids"][3] = vocab + 5
        meta["checksums"]["token_ids"] = _digest(json.dumps(meta["token_ids"]).encode())
        meta["checksums"]["metadata"] = _meta_digest(meta)

    err = refused(model, tmp_path / "v.safetensors", rewrite(data, oov))
    assert isinstance(err, PrefixFormatError) and f"vocabulary of {vocab}" in str(err)


def test_truncations_are_refused(saved, tmp_path):
    model, _, data = saved
    for cut in (0, 4, 8, 100, len(data) // 2, len(data) - 1):
        refused(model, tmp_path / "c.safetensors", data[:cut])


KEYS = ["format", "version", "layout", "dtype", "length", "token_ids", "config_fingerprint", "config_fields",
        "config_rest", "weights_fingerprint", "layers", "checksums"]
WRONG = [None, 7, True, "x", [], {}, [None], {"a": 1}, -1, 1.5]


@pytest.mark.parametrize("key", KEYS)
def test_missing_and_wrong_typed_keys_are_refused(saved, tmp_path, key):
    model, _, data = saved
    for value in ["<missing>", *WRONG]:
        def edit(meta, value=value):
            if value == "<missing>":
                meta.pop(key)
            else:
                meta[key] = value
        refused(model, tmp_path / "k.safetensors", rewrite(data, edit))


def test_layer_entries_of_the_wrong_type_are_refused(saved, tmp_path):
    model, _, data = saved
    for bad in (None, [], {"start": "0"}, {"start": -1}, {"start": True}, {"window": 3}, {"start": 0, "window": "4"}):
        def edit(meta, bad=bad):
            meta["layers"][0] = bad
        refused(model, tmp_path / "l.safetensors", rewrite(data, edit))


def test_a_file_without_weights_fingerprint_needs_the_opt_out(saved, tmp_path):
    model, _, data = saved
    cache = VKVCache(model.config)
    ids = prompts(1, 6, seed=5)["input_ids"]
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True)
    path = save_prefix(tmp_path / "nofp.safetensors", cache, ids[0].tolist())  # no model: no fingerprint
    with pytest.raises(PrefixMismatchError, match="check_weights=False") as info:
        load_prefix(path, model=model)
    assert info.value.field == "weights"
    loaded, got = load_prefix(path, model=model, check_weights=False)
    assert got == ids[0].tolist() and loaded.get_seq_length() == 6


def test_truncations_are_not_whole(saved, tmp_path):
    """docs/api.md: a truncated file is a ``PrefixFileCorruptError`` ("not whole"), wherever it is cut."""
    model, _, data = saved
    for cut in (0, 4, 8, 9, 100, len(data) // 2, len(data) - 1):
        err = refused(model, tmp_path / "c.safetensors", data[:cut])
        assert isinstance(err, PrefixFileCorruptError) and "not whole" in str(err), (cut, str(err))


def test_files_that_are_no_prefix_are_format_errors(saved, tmp_path):
    """docs/api.md: a file that is not an hf_vkv prefix (text, JSON, another binary) is a
    ``PrefixFormatError`` ("not an hf_vkv prefix"), never "not whole"."""
    model, _, _ = saved
    for name, content in (("notes.txt", b"These are my notes about the system prompt.\n" * 20),
                          ("short.txt", b"hello"), ("cfg.json", b'{"model_type": "llama"}'),
                          ("noise.bin", bytes(random.Random(2).randrange(1, 256) for _ in range(4096)))):
        err = refused(model, tmp_path / name, content)
        assert isinstance(err, PrefixFormatError) and "not an hf_vkv prefix" in str(err), (name, str(err))

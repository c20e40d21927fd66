"""A saved prefix store's pages mapped into later stores and processes (``prefix_store.kv``).

``PrefixStore.save(folder)`` writes the entries' pages once, page-aligned; ``PrefixStore.load``
maps them as external pages: nothing of the K/V is read or copied at open, a row that writes into a
mapped page gets its own copy and the file never changes, damaged or foreign files are refused with
typed errors (the store stays usable), and a conversation saved after turn 5 continues in another
process exactly as in the first.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from models import PAD, save_chat_model, tiny

import hf_vkv
from hf_vkv import PrefixFileCorruptError, PrefixMismatchError, PrefixStore, cli_prefix
from hf_vkv.devices import UnsupportedDeviceError
from hf_vkv.memory.errors import ArgumentTypeError
from hf_vkv.prefix.mapped import PAGES_FILE
from hf_vkv.prefix.store import STORE_INDEX

pytestmark = pytest.mark.integration

NEW = 6


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _generate(model: Any, tokens: list[int], store: PrefixStore | None, *, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    extra = {"cache_implementation": "vkv", "cache_config": {"prefix_store": store}} if store is not None else {}
    ids = torch.tensor([tokens])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, pad_token_id=PAD,
                          do_sample=False, return_dict_in_generate=True, output_logits=True, **extra)


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def _arena(store: PrefixStore) -> Any:
    arenas = [a for a in store.memory("cpu")._arenas.values() if not a.closed]
    assert len(arenas) == 1
    return arenas[0]


def _saved_store(tmp_path: Path, model: Any, *, chats: int = 2, seed: int = 3,
                 cache_config: dict | None = None) -> tuple[PrefixStore, Path, list[list[int]]]:
    store = PrefixStore(model.config, cache_config=cache_config)
    g = torch.Generator().manual_seed(seed)
    system = _rand(70, g)
    prompts = [system + _rand(9 + k, g) for k in range(chats)]
    for p in prompts:
        _generate(model, p, store)
    folder = tmp_path / "store"
    store.save(folder, model=model)
    return store, folder, prompts


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_opening_maps_the_pages_without_reading_them(tmp_path: Path) -> None:
    model = tiny("llama")
    store, folder, prompts = _saved_store(tmp_path, model)
    kv = folder / PAGES_FILE
    before = _digest(kv)
    warm = PrefixStore(model.config)
    assert warm.load(folder, model=model) == sum(map(len, store.prefixes()))
    arena = _arena(warm)
    stats = arena.pool.stats()
    pages = json.loads((folder / STORE_INDEX).read_text())["mapped"]["pages"]
    assert stats.external == pages and stats.in_use == 0  # every held page is the file's
    assert arena.backend.resident_bytes() == 0  # nothing copied into the store's own memory
    warm.check_invariants()
    # each continuation: what the in-memory store gives, bit for bit; the file never changes
    g = torch.Generator().manual_seed(4)
    for p in prompts:
        follow = p + _rand(5, g)
        assert _same(_generate(model, follow, store), _generate(model, follow, warm))
    assert warm.stats().tokens_reused > 0
    assert _digest(kv) == before
    warm.check_invariants()
    # the rows that wrote after a mapped partial page got copies in the store's own memory
    assert arena.pool.stats().in_use > 0 and arena.backend.resident_bytes() > 0


def test_either_file_of_a_saved_folder_loads_the_folder(tmp_path: Path) -> None:
    """``load(folder / 'prefix_store.json')`` was refused as "not a safetensors file"; a user who
    points at the index (or the pages) means the folder."""
    model = tiny("llama")
    store, folder, _ = _saved_store(tmp_path, model)
    held = sum(map(len, store.prefixes()))
    for name in (STORE_INDEX, PAGES_FILE):
        warm = PrefixStore(model.config)
        assert warm.load(folder / name, model=model) == held
        warm.check_invariants()


def test_a_store_filled_by_hand_saves_a_folder_its_load_can_check(tmp_path: Path) -> None:
    """The docs' by-hand recipe (lookup, generate with the cache, insert) then ``store.save(folder)``
    wrote a folder without a weights fingerprint silently, and its load's refusal said to save
    again with ``save_prefix``, which writes a file: save warns now, the refusal names
    ``store.save(folder, model=model)``, and that folder loads."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    ids = torch.tensor([_rand(12, torch.Generator().manual_seed(1))])
    cache = store.lookup(ids[0].tolist())
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=PAD,
                         return_dict_in_generate=True, **{hf_vkv.generate.cache_kwarg(): cache})
    store.insert(out.sequences[0, :-1].tolist(), cache)
    with pytest.warns(UserWarning, match=r"no weights fingerprint.*store.save\(folder, model=model\)"):
        store.save(tmp_path / "bare")
    with pytest.raises(PrefixMismatchError, match=r"save it again with store.save\(folder, model=model\)"):
        PrefixStore(model.config).load(tmp_path / "bare", model=model)
    store.save(tmp_path / "checked", model=model)
    warm = PrefixStore(model.config)
    assert warm.load(tmp_path / "checked", model=model) == out.sequences.shape[1] - 1
    warm.check_invariants()


@pytest.mark.parametrize("device, error", [(5, ArgumentTypeError), ("gpu", ArgumentTypeError),
                                           ("meta", UnsupportedDeviceError)])
def test_a_memory_of_no_device_vkv_serves_is_refused(device: Any, error: type[Exception]) -> None:
    """``store.memory(5)`` raised torch's RuntimeError ("Cannot access accelerator device") and
    ``memory('meta')`` made a memory no cache could use."""
    store = PrefixStore(tiny("llama").config)
    with pytest.raises(error, match="device|meta"):
        store.memory(device)
    assert store.memory("cpu") is store.memory(torch.device("cpu"))
    store.check_invariants()


def test_indexes_of_versions_2_and_3_still_load_and_a_run_outside_the_file_is_refused(tmp_path: Path) -> None:
    """Version 4 checksums each page by its words weighed by their places (``"checksum":
    "weighted64"``); versions 2 and 3 summed the words (no ``"checksum"``), version 3 as one hex
    string with each table's pages as runs, version 2 both as lists of integers. Older indexes map
    the same pages and serve the same tokens; a checksum kind this version does not know is refused."""
    import numpy as np

    from hf_vkv.prefix.mapped import index_text
    from hf_vkv.prefix.page_check import SUM64, page_checksums

    model = tiny("llama")
    store, folder, prompts = _saved_store(tmp_path, model)
    index = folder / STORE_INDEX
    text = index.read_text()
    data = json.loads(text)
    assert data["version"] == 4 and data["mapped"]["checksum"] == "weighted64"
    assert isinstance(data["mapped"]["checksums"], str)
    tables = [t for e in data["mapped"]["entries"] for g in e["groups"] for t in g["tables"]]
    assert tables and all(isinstance(run, list) and len(run) == 2 for t in tables for run in t[2])
    section = data["mapped"]
    raw = (folder / section["file"]).read_bytes()[section["data_offset"]:]
    pages = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(section["pages"], section["page_bytes"])
    summed = page_checksums(pages, kind=SUM64)
    assert not np.array_equal(summed, np.frombuffer(bytes.fromhex(section["checksums"]), dtype="<i8"))
    v3 = copy.deepcopy(data)
    v3["version"] = 3
    del v3["mapped"]["checksum"], v3["sha256"]
    v3["mapped"]["checksums"] = summed.astype("<i8").tobytes().hex()
    v2 = copy.deepcopy(v3)
    v2["version"] = 2
    v2["mapped"]["checksums"] = summed.tolist()
    for e in v2["mapped"]["entries"]:
        for g in e["groups"]:
            g["tables"] = [[n, start, [i for first, k in runs for i in range(first, first + k)]]
                           for n, start, runs in g["tables"]]
    g = torch.Generator().manual_seed(5)
    follows = [p + _rand(4, g) for p in prompts]
    held = sum(map(len, store.prefixes()))
    want = [_generate(model, follow, store) for follow in follows]
    for old in (v3, v2):
        index.write_text(index_text(old))
        older = PrefixStore(model.config)
        assert older.load(folder, model=model) == held
        for follow, expected in zip(follows, want):
            assert _same(expected, _generate(model, follow, older))
        older.check_invariants()
    # a checksum kind of a later version is refused, naming it, nothing mapped
    later = copy.deepcopy(data)
    del later["sha256"]
    later["mapped"]["checksum"] = "crc128"
    index.write_text(index_text(later))
    _fresh_refusal(folder, model, hf_vkv.PrefixFormatError, "unknown kind 'crc128'")
    # a run past the file's last page (in an index whose digest is right) is refused, nothing mapped
    bad = copy.deepcopy(data)
    del bad["sha256"]
    first_table = bad["mapped"]["entries"][0]["groups"][0]["tables"][0]
    first_table[2] = [[bad["mapped"]["pages"] - 1, 2]]
    index.write_text(index_text(bad))
    _fresh_refusal(folder, model, hf_vkv.PrefixFormatError, "outside the file")
    index.write_text(text)
    assert PrefixStore(model.config).load(folder, model=model) > 0


def test_words_or_sectors_that_trade_places_in_a_page_are_refused_never_served(tmp_path: Path) -> None:
    """Page checksums were the plain sum of a page's words, which a page whose 512-byte sectors (or
    two words) traded places passed: its entry was served with K/V in the wrong places. Weighed by
    place, each such page of the saved file is refused at its first use and the store serves on."""
    from hf_vkv.prefix.page_check import SUM64, WEIGHTED64, page_checksums

    model = tiny("llama")
    store, folder, prompts = _saved_store(tmp_path, model)
    kv = folder / PAGES_FILE
    whole = kv.read_bytes()
    section = json.loads((folder / STORE_INDEX).read_text())["mapped"]
    offset, page_bytes = section["data_offset"], section["page_bytes"]
    want = [store.lookup(p + [5]) for p in prompts]
    swaps = [(0, 0, 512, 512), (1, 8, 24, 8), (section["pages"] - 1, 0, page_bytes - 512, 512)]  # page, a, b, bytes
    for page, a, b, n in swaps:
        data = bytearray(whole)
        at = offset + page * page_bytes
        first, second = bytes(data[at + a:at + a + n]), bytes(data[at + b:at + b + n])
        assert first != second
        data[at + a:at + a + n], data[at + b:at + b + n] = second, first
        moved = torch.frombuffer(bytearray(data[at:at + page_bytes]), dtype=torch.uint8).view(1, page_bytes)
        saved = torch.frombuffer(bytearray(whole[at:at + page_bytes]), dtype=torch.uint8).view(1, page_bytes)
        assert page_checksums(moved, kind=SUM64) == page_checksums(saved, kind=SUM64)  # what the sum passed
        assert page_checksums(moved, kind=WEIGHTED64) != page_checksums(saved, kind=WEIGHTED64)
        kv.write_bytes(bytes(data))
        fresh = PrefixStore(model.config)
        fresh.load(folder, model=model)
        with pytest.raises(PrefixFileCorruptError, match=f"page {page} differs from its checksum"):
            for p in prompts:
                fresh.lookup(p + [5]).close()
        fresh.check_invariants()
        ids = [7, 8, 9, 10]
        assert torch.equal(_generate(model, ids, fresh).sequences, _generate(model, ids, None).sequences)
        kv.write_bytes(whole)
    fresh = PrefixStore(model.config)
    fresh.load(folder, model=model)
    for p, w in zip(prompts, want):
        got = fresh.lookup(p + [5])
        assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(got.layers, w.layers))
        got.close()


def test_mapped_pages_retire_when_no_entry_holds_them(tmp_path: Path) -> None:
    model = tiny("llama")
    _, folder, prompts = _saved_store(tmp_path, model)
    warm = PrefixStore(model.config)
    warm.load(folder, model=model)
    arena = _arena(warm)
    fork = warm.lookup(prompts[0] + [5])  # a request still holding mapped pages
    warm.clear()
    assert arena.pool.stats().external > 0
    fork.close()
    gc.collect()
    assert arena.pool.stats().external == 0
    warm.check_invariants()
    assert warm.load(folder, model=model) > 0  # the same file maps again, to fresh ids
    warm.check_invariants()


def test_a_dropped_store_lets_go_of_its_pages_and_files_at_once(tmp_path: Path) -> None:
    """A store's memory calls back into the store when its budget is full: held weakly, so a store
    whose last reference goes is freed then, its mapped file closed and its pages let go, without
    waiting for a pass of the garbage collector (a bound method made a cycle that kept them, in a
    server or a benchmark opening stores one after another, until a collection came due)."""
    import weakref

    model = tiny("llama")
    _, folder, prompts = _saved_store(tmp_path, model)
    gc.collect()
    gc.disable()
    try:
        store = PrefixStore(model.config, budget_bytes=1 << 26)
        assert store.load(folder, model=model) > 0
        files = [weakref.ref(f) for f in store._files]
        assert files
        [f.wait() for f in store._files]
        out = _generate(model, prompts[0] + [7, 8], store)  # a call that reuses the mapped pages
        first = out.sequences
        del out  # its cache, which draws from the store's memory
        assert store.stats().tokens_reused > 0
        gone = weakref.ref(store)
        del store
        assert gone() is None
        assert all(f() is None for f in files)
    finally:
        gc.enable()
    assert torch.equal(first, _generate(model, prompts[0] + [7, 8], None).sequences)

def test_entries_are_installed_at_first_use_and_an_unused_one_lets_go_of_its_pages_alone(tmp_path: Path) -> None:
    """Opening makes no cache: each entry holds one reference on each of its pages until its first
    use installs its row. The two entries share the system prompt's pages; dropping one that was
    never used retires only the pages the other does not hold, and the other still serves exactly
    what the in-memory store does."""
    model = tiny("llama")
    small = {"page_bytes": 4096}  # 64 tokens a page: the 70-token system prompt fills one, which both chats share
    store, folder, prompts = _saved_store(tmp_path, model, cache_config=small)
    warm = PrefixStore(model.config, cache_config=small)
    warm.load(folder, model=model)
    arena = _arena(warm)
    entries = list(warm._entries.values())
    assert len(entries) == 2 and all(e.cache is None and e.pending is not None for e in entries)
    first, second = entries
    shared = set(first.pending.held) & set(second.pending.held)
    assert shared and all(arena.pool.refs[p] == 3 for p in shared)  # the pin and one reference per entry
    assert warm.stats().bytes_held == store.stats().bytes_held  # counted from the tables, nothing installed
    warm.check_invariants()
    only_first = set(first.pending.held) - shared
    warm._drop(first)  # as an eviction would: never used
    assert all(p not in arena.pool.refs for p in only_first) and all(arena.pool.refs[p] == 2 for p in shared)
    assert arena.pool.stats().external == len(second.pending.held)
    warm.check_invariants()
    follow = prompts[1] + [7, 8, 9]
    assert _same(_generate(model, follow, store), _generate(model, follow, warm))
    assert second.cache is not None and second.pending is None  # installed at its first use
    warm.check_invariants()
    warm.budget_bytes = 1  # every entry evicted; the request's copies went with it
    gc.collect()
    assert len(warm) == 0 and arena.pool.stats().external == 0
    warm.check_invariants()


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_a_new_prompt_beside_an_entry_not_used_yet_keeps_the_invariants(tmp_path: Path, layout: str) -> None:
    """A loaded store whose entries are not installed yet stores a prompt that shares nothing with
    them: the new entry's cache shares the arena with the mapped entries, whose references on the
    file's pages are held outside any table. The arena's check counts them (it used to find the
    pages referenced by no table), and the store serves both afterwards as an in-memory one does."""
    model = tiny("llama")
    store, folder, prompts = _saved_store(tmp_path, model, cache_config={"layout": layout})
    loaded = PrefixStore(model.config, cache_config={"layout": layout})
    loaded.load(folder, model=model)
    other = _rand(20, torch.Generator().manual_seed(11))
    assert _same(_generate(model, other, store), _generate(model, other, loaded))
    assert sum(e.pending is not None for e in loaded._entries.values()) == 2  # the saved ones, not used yet
    loaded.check_invariants()
    follow = prompts[0] + [7, 8]
    assert _same(_generate(model, follow, store), _generate(model, follow, loaded))
    loaded.check_invariants()
    store.check_invariants()


def test_a_folder_over_the_budget_loads_what_fits_and_says_what_did_not(tmp_path: Path) -> None:
    """Loading is an insert of each entry, least recently used first: a budget that holds only the
    newest entry evicts the older one at once. load returns the tokens it still holds (it returned
    every entry's, with the store empty or short, and said nothing)."""
    model = tiny("llama")
    store, folder, prompts = _saved_store(tmp_path, model)
    whole = PrefixStore(model.config)
    everything = whole.load(folder, model=model)
    assert len(whole) == 2 and everything == sum(len(e.tokens) for e in whole._entries.values())
    tight = PrefixStore(model.config, budget_bytes=store.stats().bytes_held - 1)  # not both
    with pytest.warns(UserWarning, match="1 of its 2 entries did not fit within the store's budget_bytes"):
        held = tight.load(folder, model=model)
    assert len(tight) == 1 and held == sum(len(e.tokens) for e in tight._entries.values()) < everything
    tight.check_invariants()
    newest = prompts[-1] + [5, 6]
    assert _same(_generate(model, newest, store), _generate(model, newest, tight))


def _fresh_refusal(folder: Path, model: Any, error: type[Exception], match: str, **kwargs: Any) -> None:
    fresh = PrefixStore(model.config, **kwargs)
    with pytest.raises(error, match=match):
        fresh.load(folder, model=model)
    assert len(fresh) == 0
    fresh.check_invariants()
    ids = [7, 8, 9, 10]
    assert torch.equal(_generate(model, ids, fresh).sequences, _generate(model, ids, None).sequences)  # still serves


def test_damaged_and_foreign_files_are_refused_and_the_store_stays_usable(tmp_path: Path) -> None:
    model = tiny("llama")
    _, folder, _ = _saved_store(tmp_path, model)
    kv, index = folder / PAGES_FILE, folder / STORE_INDEX
    whole, text = kv.read_bytes(), index.read_text()
    corrupt = hf_vkv.PrefixFileCorruptError
    kv.write_bytes(whole[:-100])  # truncated
    _fresh_refusal(folder, model, corrupt, "not whole \\(truncated\\)")
    kv.write_bytes(whole + b"\0" * 4096)  # bytes appended
    _fresh_refusal(folder, model, corrupt, "bytes appended")
    kv.write_bytes(b"X" + whole[1:])  # the header
    _fresh_refusal(folder, model, corrupt, "header")
    kv.write_bytes(whole)
    data = json.loads(text)
    data["mapped"]["entries"][0]["tokens"][3] += 1  # the index, edited
    index.write_text(json.dumps(data))
    _fresh_refusal(folder, model, corrupt, "digest")
    index.write_text(text)
    other_store, other_folder, _ = _saved_store(tmp_path / "b", model, seed=9)  # another save's pages
    kv.write_bytes((other_folder / PAGES_FILE).read_bytes())
    _fresh_refusal(folder, model, corrupt, "another save")
    kv.write_bytes(whole)
    kv.unlink()
    _fresh_refusal(folder, model, corrupt, "lacks")
    kv.write_bytes(whole)
    # another model, other weights, another dtype, other cache options
    _fresh_refusal(folder, tiny("llama", layers=3), PrefixMismatchError,
                   r"another model \(num_hidden_layers: file 2, model 3\)")
    _fresh_refusal(folder, tiny("llama", seed=1), PrefixMismatchError, "other weights")
    _fresh_refusal(folder, copy.deepcopy(model).to(torch.bfloat16), PrefixMismatchError, "bfloat16")
    _fresh_refusal(folder, model, hf_vkv.PrefixFormatError,  # in the words of cache_config, not class names
                   r"saved row head_major in .*cache_config=\{'layout': 'head_major'.*same cache_config",
                   cache_config={"layout": "token_major"})
    # and the untouched folder still loads
    assert PrefixStore(model.config).load(folder, model=model) > 0


def test_a_page_damaged_on_disk_is_refused_before_attention_reads_it(tmp_path: Path) -> None:
    model = tiny("llama")
    _, folder, prompts = _saved_store(tmp_path, model)
    kv = folder / PAGES_FILE
    offset = json.loads((folder / STORE_INDEX).read_text())["mapped"]["data_offset"]
    data = bytearray(kv.read_bytes())
    data[offset + 100] ^= 0x04  # a flipped bit in the first page
    kv.write_bytes(bytes(data))
    warm = PrefixStore(model.config)
    assert warm.load(folder, model=model) > 0  # opening reads no page
    follow = prompts[0] + [11, 12, 13]
    with pytest.raises(hf_vkv.PrefixFileCorruptError, match="page 0 differs"):
        _generate(model, follow, warm)
    assert len(warm) == 0  # every entry of the file went
    warm.check_invariants()
    assert torch.equal(_generate(model, follow, warm).sequences, _generate(model, follow, None).sequences)


_RESUME = r"""
import sys, torch
torch.set_num_threads({threads})  # the first process's: logits may differ between thread counts
sys.path.insert(0, {tests!r})
from models import PAD, save_chat_model, tiny
import hf_vkv
model = tiny("llama")
store = hf_vkv.PrefixStore(model.config)
store.load({folder!r}, model=model)
out = []
history = {history!r}
for turn, message in enumerate({messages!r}):
    history = history + message
    ids = torch.tensor([history])
    torch.manual_seed(turn)
    r = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens={new}, pad_token_id=PAD, do_sample=True,
                       top_k=0, return_dict_in_generate=True, output_logits=True, cache_implementation="vkv",
                       cache_config={{"prefix_store": store}})
    history = r.sequences[0].tolist()
    out.append((r.sequences, [x.clone() for x in r.logits], hf_vkv.reuse_report(r).reused_tokens))
torch.save(out, {result!r})
"""


def test_a_chat_saved_after_turn_5_resumes_in_another_process(tmp_path: Path) -> None:
    """Turns 6-8 of a sampled chat in a fresh process that loaded the store saved after turn 5:
    tokens and logits equal to the same turns continued in the first process."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    g = torch.Generator().manual_seed(5)
    history = _rand(40, g)
    kwargs = dict(max_new_tokens=NEW, pad_token_id=PAD, do_sample=True, top_k=0, return_dict_in_generate=True,
                  output_logits=True, cache_implementation="vkv", cache_config={"prefix_store": store})
    for turn in range(5):
        history = history + _rand(4, g)
        ids = torch.tensor([history])
        torch.manual_seed(100 + turn)
        history = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs).sequences[0].tolist()
    store.save(tmp_path / "chat")
    messages = [_rand(3 + k, g) for k in range(3)]
    want, h = [], list(history)
    for turn, message in enumerate(messages):
        h = h + message
        ids = torch.tensor([h])
        torch.manual_seed(turn)
        r = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        h = r.sequences[0].tolist()
        want.append((r.sequences, list(r.logits)))
    result = tmp_path / "resumed.pt"
    code = _RESUME.format(tests=str(Path(__file__).parents[1]), folder=str(tmp_path / "chat"), history=history,
                          messages=messages, new=NEW, result=str(result), threads=torch.get_num_threads())
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(Path(__file__).parents[2]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(result)
    assert len(got) == 3
    for (seq_a, logits_a), (seq_b, logits_b, reused) in zip(want, got):
        assert torch.equal(seq_a, seq_b)
        assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))
        assert reused > 0


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("tiny-llama-chat"))


def _main(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    from hf_vkv import cli

    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:
        code = int(e.code)
    return code, capsys.readouterr().out


def test_cli_saves_a_system_prompt_inspects_it_and_chats_from_it(chat_model_dir: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    system = tmp_path / "system.txt"
    system.write_text(" ".join(f"w{i}" for i in range(10, 90)))
    folder = tmp_path / "sys"
    code, out = _main(capsys, "prefix", "save", folder, "--model", chat_model_dir, "--system-file", system,
                      "--threads", "1")
    assert code == 0 and "system-prompt tokens computed" in out, out
    code, out = _main(capsys, "prefix", "inspect", folder, "--verify", "--json", tmp_path / "i.json")
    assert code == 0 and "every checksum equal" in out, out
    info = json.loads((tmp_path / "i.json").read_text())
    assert info["mapped_entries"][0] >= 80 and info["verified_pages"] == info["pages"] > 0
    assert info["layout"] and set(info["layout"]) <= {"head_major", "token_major"}, info["layout"]  # cache_config's words
    code, out = _main(capsys, "chat", "--model", chat_model_dir, "--system-file", system, "--store", folder,
                      "--message", "w5 w6", "--max-new-tokens", "4", "--threads", "1", "--json", tmp_path / "c.json")
    assert code == 0 and "mapped in" in out and "store saved" in out, out
    turn = json.loads((tmp_path / "c.json").read_text())["turns"][0]
    assert turn["reused_tokens"] >= 80 and turn["same_tokens"]  # the first turn starts from the file
    kv = folder / PAGES_FILE  # a damaged page: inspect --verify says so, exit 1
    data = bytearray(kv.read_bytes())
    data[json.loads((folder / STORE_INDEX).read_text())["mapped"]["data_offset"] + 8] ^= 0x10
    kv.write_bytes(bytes(data))
    code, out = _main(capsys, "prefix", "inspect", folder, "--verify")
    assert code == 1 and "NOT WHOLE" in out and "page 0 differs" in out, out
    code, out = _main(capsys, "prefix", "inspect", folder, "--json", "-")  # stdout: the JSON alone
    assert code == 0 and json.loads(out)["pages"] == info["pages"], out
    kv.write_bytes(bytes(data[:-1]))  # truncated: told by its size alone, without --verify (once: exit 0, silent)
    code, out = _main(capsys, "prefix", "inspect", folder)
    assert code == 1 and "NOT WHOLE" in out and "truncated" in out, out
    # a missing page file (not whole: exit 1) and an index that is not JSON (refused: exit 3), no traceback
    kv.unlink()
    with pytest.raises(PrefixFileCorruptError, match="lacks prefix_store.kv"):
        cli_prefix.verify_folder(folder)
    code, out = _main(capsys, "prefix", "inspect", folder, "--verify")
    assert code == 1 and "NOT WHOLE" in out and "lacks prefix_store.kv" in out, out
    (folder / STORE_INDEX).write_text("not an index")
    with pytest.raises(PrefixFileCorruptError, match="not JSON"):
        cli_prefix.summary(folder)
    assert _main(capsys, "prefix", "inspect", folder)[0] == 3


def test_bit_flips_anywhere_are_refused_never_served(tmp_path: Path) -> None:
    """A random bit flipped in the index, the page file's header or its pages: the index and the
    header are refused at open (nothing inserted), a page when its entry is first handed out; in
    no case does a lookup hand out K/V that differ from what was saved."""
    import random

    model = tiny("llama")
    store, folder, prompts = _saved_store(tmp_path, model)
    kv, index = folder / PAGES_FILE, folder / STORE_INDEX
    whole, text = kv.read_bytes(), index.read_bytes()
    offset = json.loads(text)["mapped"]["data_offset"]
    want = [store.lookup(p + [5]) for p in prompts]
    rng = random.Random(3)
    refused = served = 0
    for trial in range(60):
        target, data = (index, text) if trial % 3 == 0 else (kv, whole)
        at = rng.randrange(len(data)) if trial % 3 != 1 else rng.randrange(offset)  # 1 of 3: the header page
        bad = bytearray(data)
        bad[at] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(bad))
        fresh = PrefixStore(model.config)
        try:
            fresh.load(folder, model=model)
            for p, w in zip(prompts, want):
                got = fresh.lookup(p + [5])
                assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                           for a, b in zip(got.layers, w.layers))  # whatever is served is what was saved
                got.close()
            served += 1
        except hf_vkv.PrefixFileError:
            refused += 1
        fresh.check_invariants()
        target.write_bytes(data)
    assert refused > 30  # flips in the header page's zero padding beyond its JSON change nothing that is read
    assert served + refused == 60


_EXIT_WHILE_CHECKING = r"""
import sys, time, torch
sys.path.insert(0, {tests!r})
from models import tiny
import hf_vkv
import hf_vkv.prefix.page_check as page_check
plain = page_check.page_checksums
def slow(pages, *, kind):  # a file of gigabytes: the check is still inside torch when the process exits
    a = torch.randn(700, 700)
    for _ in range(40):
        a = torch.tanh(a @ a)
    return plain(pages, kind=kind)
page_check.page_checksums = slow
model = tiny("llama")
store = hf_vkv.PrefixStore(model.config)
store.load({folder!r}, model=model)
print("opened", flush=True)
"""


def test_a_process_that_exits_while_its_pages_are_checked_exits_cleanly(tmp_path: Path) -> None:
    """Opening starts the page check in a thread; a process that exits before it ends waits for
    it instead of aborting (a daemon thread inside a torch call at exit ends the process with
    SIGABRT)."""
    model = tiny("llama")
    _, folder, _ = _saved_store(tmp_path, model)
    code = _EXIT_WHILE_CHECKING.format(tests=str(Path(__file__).parents[1]), folder=str(folder))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(Path(__file__).parents[2]))
    assert proc.returncode == 0 and "opened" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("stop_at", [1, 2, 3, 4])
def test_a_save_stopped_at_any_point_leaves_a_folder_that_loads(tmp_path: Path, stop_at: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A save killed between renaming its page file over ``prefix_store.kv`` and renaming its index
    left the new pages beside the old index: every later load was refused ("another save's file")
    and the last good save was lost. The index is the commit now: stopped before it, the folder
    loads the last save; after it, the new one."""

    model = tiny("llama")
    old, folder, old_prompts = _saved_store(tmp_path, model, seed=3)
    new, _, new_prompts = _saved_store(tmp_path / "b", model, seed=5)
    real, calls = os.replace, []

    def replace(src: Any, dst: Any) -> None:  # the save's renames: pages, index, pages' name, index
        calls.append(Path(dst).name)
        if len(calls) == stop_at:
            raise KeyboardInterrupt("stopped")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        new.save(folder)
    monkeypatch.setattr(os, "replace", real)
    warm = PrefixStore(model.config)
    assert warm.load(folder, model=model) > 0
    source, want = (old, old_prompts) if stop_at <= 2 else (new, new_prompts)  # the 2nd rename, the index, commits
    assert {tuple(p[:70]) for p in want} <= {tuple(p[:70]) for p in warm.prefixes()}
    warm.check_invariants()
    assert _same(_generate(model, want[0] + [7, 8], warm), _generate(model, want[0] + [7, 8], source))
    for left in (f".{PAGES_FILE}.tmp-{2**22 + 7}-140123", f"prefix_store.{2**22 + 7}-0123abcd.kv"):  # a killed save's
        (folder / left).write_bytes(b"x")  # (a pid past Linux's highest: no such process)
    new.save(folder)  # the next save finishes, and what stopped saves left behind is gone
    assert sorted(p.name for p in folder.iterdir()) == sorted([PAGES_FILE, STORE_INDEX])
    assert [p.name for p in new.save(folder)] == [PAGES_FILE]  # the data files; the index names them


def test_a_load_that_a_save_overtakes_reads_the_new_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process saving into the folder while this one loads it: half the loads were refused
    as a damaged file. A load that finds its pages replaced under it reads the new index again.
    (A save's commit now waits for a load's reading, under a shared lock of the folder: what
    replaces the files here is a writer that takes no lock, as an earlier version's save.)"""
    import hf_vkv.prefix.store as store_module

    model = tiny("llama")
    _, folder, _ = _saved_store(tmp_path, model, seed=3)
    new, _, new_prompts = _saved_store(tmp_path / "b", model, seed=5)
    real, raced = store_module.map_entries, []

    def overtaken(*args: Any, **kwargs: Any) -> Any:
        if not raced:
            raced.append(True)
            new.save(tmp_path / "side")  # the index this load read is the old save's; the pages are the new one's now
            for name in (PAGES_FILE, STORE_INDEX):
                os.replace(tmp_path / "side" / name, folder / name)
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, "map_entries", overtaken)
    warm = PrefixStore(model.config)
    assert warm.load(folder, model=model) > 0 and raced
    assert {tuple(p[:70]) for p in new_prompts} <= {tuple(p[:70]) for p in warm.prefixes()}
    warm.check_invariants()


def test_two_stores_of_one_process_saving_into_one_folder_at_once_leave_a_folder_that_loads(tmp_path: Path) -> None:
    """Two stores in two threads of one process saving into one folder, over and over: a save's
    clean-up took the other's page file (same process, not yet named by an index) as one a
    stopped save left. Saves in a process take turns now; every save ends, the folder loads one
    of the two stores whole."""
    import threading

    model = tiny("llama")
    first, folder, first_prompts = _saved_store(tmp_path, model, seed=3)
    second, _, second_prompts = _saved_store(tmp_path / "b", model, seed=5)
    failed: list[BaseException] = []

    def save_often(store: PrefixStore) -> None:
        try:
            for _ in range(12):
                store.save(folder)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            failed.append(exc)

    threads = [threading.Thread(target=save_often, args=(s,)) for s in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed
    warm = PrefixStore(model.config)
    assert warm.load(folder, model=model) > 0
    held = {tuple(p[:70]) for p in warm.prefixes()}
    assert {tuple(p[:70]) for p in first_prompts} <= held or {tuple(p[:70]) for p in second_prompts} <= held
    warm.check_invariants()
    assert sorted(p.name for p in folder.iterdir()) == sorted([PAGES_FILE, STORE_INDEX])


@pytest.mark.parametrize("saver", ["itself", "another store", "another store, the page file hard-linked"])
def test_a_save_into_a_served_folder_leaves_the_stores_that_opened_it_serving(tmp_path: Path, saver: str) -> None:
    """What the docs prescribe for updating a served folder: save into it. The save renames a new
    page file over the old one, which unlinks the old file and so changes its change time, not its
    bytes: a store that had opened the folder took that for a write in place, warned, and dropped
    every entry (the next turn reused nothing). It keeps serving the file it opened now, bit for bit."""
    model = tiny("llama")
    first, folder, prompts = _saved_store(tmp_path, model)
    if "hard-linked" in saver:  # the file keeps a name elsewhere: the save takes one link, not its last
        os.link(folder / PAGES_FILE, tmp_path / "kept.kv")
    served = PrefixStore(model.config)
    held = served.load(folder, model=model)
    old = (folder / PAGES_FILE).stat().st_ino
    (served if saver == "itself" else first).save(folder, model=model)
    assert (folder / PAGES_FILE).stat().st_ino != old  # a new file
    turn = prompts[0] + [7, 8]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _generate(model, turn, served)
    assert hf_vkv.reuse_report(out).reused_tokens >= len(prompts[0]) - 1
    assert _same(out, _generate(model, turn, first))  # what the store that computed them gives
    assert sum(map(len, served.prefixes())) >= held
    served.check_invariants()


_WRITTEN_UNDER = r"""
import sys, warnings
sys.path.insert(0, {tests!r})
import torch
from models import PAD, tiny
import hf_vkv
model = tiny("llama")
store = hf_vkv.PrefixStore(model.config)
store.load({folder!r}, model=model)
ids = torch.tensor([{prompt}])
first = store.lookup(ids)  # its pages checked, as a first turn's are (and no entry of its own added)
assert first.get_seq_length() > 0
first.close()
print("opened", flush=True)
sys.stdin.readline()  # the parent writes the file meanwhile
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=PAD,
                         return_dict_in_generate=True, output_logits=True, cache_implementation="vkv",
                         cache_config={{"prefix_store": store}})
ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=PAD,
                     return_dict_in_generate=True, output_logits=True)
assert torch.equal(out.sequences, ref.sequences) and all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
assert hf_vkv.reuse_report(out).reused_tokens == 0
assert any("was written after it was opened" in str(w.message) for w in caught), [str(w.message) for w in caught]
store.check_invariants()
print("served", flush=True)
"""


@pytest.mark.parametrize("write", ["zeros in place", "truncated", "copied over"])
def test_a_page_file_written_while_it_is_open_is_dropped_not_read(tmp_path: Path, write: str) -> None:
    """A served folder's page file written in place after it was opened and checked (``cp`` or
    ``rsync --inplace`` over it, a truncation): the store drops the entries holding its pages,
    with a warning, and the next turn computes them again, DynamicCache's tokens and logits. Before,
    zeros written in place were reused (other tokens, HTTP 200 through the server) and a truncated
    file's pages were read past its end (SIGBUS: the process died), so the process that opens the
    file is a child here."""
    model = tiny("llama")
    _, folder, prompts = _saved_store(tmp_path, model)
    other, other_folder, _ = _saved_store(tmp_path / "other", model, chats=1, seed=9)
    pages = folder / PAGES_FILE
    code = _WRITTEN_UNDER.format(tests=str(Path(__file__).parents[1]), folder=str(folder), prompt=prompts[0] + [7, 8])
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                             cwd=str(Path(__file__).parents[2]))
    try:
        assert child.stdout.readline().strip() == "opened", child.stderr.read()[-3000:]
        size = pages.stat().st_size
        if write == "zeros in place":
            with open(pages, "r+b") as f:
                f.seek(4096)
                f.write(b"\0" * (size - 4096))
        elif write == "truncated":
            os.truncate(pages, size // 2)
        else:  # cp's way: the same file, truncated and written again
            pages.write_bytes((other_folder / PAGES_FILE).read_bytes())
        out, err = child.communicate("go\n", timeout=300)
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip().endswith("served"), (child.returncode, err[-3000:])


def test_wrong_typed_paths_folders_in_a_folder_and_text_token_ids_are_typed_errors(tmp_path: Path) -> None:
    """Bad input a user may give, each a typed error where it was a bare one (``TypeError`` from
    ``Path(None)``, ``IsADirectoryError`` from a file that is a folder, ``TypeError`` from comparing
    text ids); the store stays usable."""
    from hf_vkv.prefix.errors import PrefixIsAFolderError
    from hf_vkv.prefix.mapped import index_text

    model = tiny("llama")
    store, folder, prompts = _saved_store(tmp_path, model)
    for call in (lambda: store.save(None), lambda: PrefixStore(model.config).load(None, model=model),
                 lambda: hf_vkv.save_prefix(None, store.lookup(torch.tensor([prompts[0]])), prompts[0][:-1]),
                 lambda: hf_vkv.load_prefix(None, model=model)):
        with pytest.raises(ArgumentTypeError, match="takes a path"):
            call()
    with pytest.raises(hf_vkv.ArgumentError, match="an empty one"):  # Path("") is the current folder
        store.save("")
    for name in (PAGES_FILE, STORE_INDEX):
        broken = tmp_path / f"broken_{name}"
        broken.mkdir()
        (broken / name).mkdir()
        with pytest.raises(PrefixFileCorruptError, match=f"its {name} is a folder"):
            PrefixStore(model.config).load(broken, model=model)
        with pytest.raises(PrefixIsAFolderError, match=f"writes its {name} as a file"):
            store.save(broken, model=model)
    original = json.loads((folder / STORE_INDEX).read_text())
    del original["sha256"]  # index_text writes it again: files made to pass the digest
    text_ids, no_size = copy.deepcopy(original), copy.deepcopy(original)
    text_ids["mapped"]["entries"][0]["tokens"] = [str(t) for t in text_ids["mapped"]["entries"][0]["tokens"]]
    del no_size["mapped"]["file_bytes"]  # its message said "bytes appended: N bytes, the index gives N"
    for index, error, match in ((text_ids, hf_vkv.PrefixFormatError, "token ids are not integers"),
                                (no_size, PrefixFileCorruptError, "its index's file_bytes is None")):
        (folder / STORE_INDEX).write_text(index_text(index))
        fresh = PrefixStore(model.config)
        with pytest.raises(error, match=match):
            fresh.load(folder, model=model)
        assert len(fresh) == 0
    store.check_invariants()
    assert hf_vkv.reuse_report(_generate(model, prompts[0] + [7], store)).reused_tokens > 0


def test_a_folder_removed_while_it_is_loaded_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder another process removed between the load's look at it and its read of the index
    raised a bare FileNotFoundError; it is the documented PrefixNotFoundError, nothing inserted."""
    import shutil

    model = tiny("llama")
    _, folder, _ = _saved_store(tmp_path, model)
    read = Path.read_text

    def removed_first(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == STORE_INDEX and self.parent == folder:
            shutil.rmtree(folder)
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", removed_first)
    store = PrefixStore(model.config)
    from hf_vkv.prefix.errors import PrefixNotFoundError

    with pytest.raises(PrefixNotFoundError, match="was removed while it was read"):
        store.load(folder, model=model)
    assert len(store) == 0
    store.check_invariants()


def _save_rounds(folder: str, seed: int, start: Any, done: Any, rounds: int) -> None:  # a saving process (forked)
    import random
    import time

    import hf_vkv.prefix.store as store_module

    write = store_module._write_index

    def slowly(out: Path, index: dict) -> None:  # widens the window between a save's rename and its last index
        if index.get("mapped") and index["mapped"]["file"] == PAGES_FILE:
            time.sleep(random.random() * 0.02)
        write(out, index)

    store_module._write_index = slowly
    model = tiny("llama")
    store, _, _ = _saved_store(Path(folder) / f"own-{seed}", model, seed=seed)
    for _ in range(rounds):
        start.wait()
        store.save(folder, model=model)
        done.wait()


def test_saves_of_two_processes_into_one_folder_leave_a_folder_that_loads(tmp_path: Path) -> None:
    """Two processes saving into one folder at once, both saves returning: one's rename of its
    page file to prefix_store.kv could fall between the other's rename and the other's last index,
    which then named prefix_store.kv over the first one's pages: a folder that never loaded (3 of
    30 rounds). Saves now commit one at a time (a file lock in the folder)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    rounds = 6
    start, done = context.Barrier(3), context.Barrier(3)
    folder = tmp_path / "shared"
    savers = [context.Process(target=_save_rounds, args=(str(folder), seed, start, done, rounds)) for seed in (3, 5)]
    for saver in savers:
        saver.start()
    model = tiny("llama")
    try:
        for _ in range(rounds):
            start.wait(timeout=120)
            done.wait(timeout=120)
            store = PrefixStore(model.config)
            assert store.load(folder, model=model) > 0
            store.check_invariants()
            store.clear()
    finally:
        for saver in savers:
            saver.join(timeout=60)
            if saver.is_alive():
                saver.kill()
    assert all(saver.exitcode == 0 for saver in savers)


def test_loading_a_folder_again_and_again_keeps_a_bounded_number_of_descriptors(tmp_path: Path) -> None:
    """Every load kept a descriptor of the page file in the store's memory for the store's life
    (a retired page kept its file), and a load whose entries the store already held kept the
    opened file too: 150 descriptors after 50 loads, and a process with a limit of 128 open files
    failed at its 121st load with a bare OSError. Files whose pages all retired are let go now."""
    import time

    model = tiny("llama")
    _, folder, prompts = _saved_store(tmp_path, model)
    page_file = str((folder / PAGES_FILE).resolve())

    def descriptors() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}") == page_file
        return count

    store = PrefixStore(model.config)
    for clear in (False, True):
        counts = []
        for _ in range(10):
            store.load(folder, model=model)
            if clear:
                store.clear()
            gc.collect()
            counts.append(descriptors())
        assert max(counts[3:]) <= 4, counts  # not one more a load
        store.check_invariants()
    store.load(folder, model=model)
    fresh = PrefixStore(model.config)
    fresh.load(folder, model=model)
    assert _same(_generate(model, prompts[0] + [5, 6], store), _generate(model, prompts[0] + [5, 6], fresh))
    store.clear()
    fresh.clear()
    deadline = time.monotonic() + 5
    while descriptors() and time.monotonic() < deadline:  # a page check still running holds its file until it ends
        gc.collect()
        time.sleep(0.05)
    assert descriptors() == 0


def test_a_load_beside_a_save_s_commit_keeps_its_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save commits its index naming the page file by a name of its own, then renames the file
    to prefix_store.kv. A load between the two opened the file by the first name, the rename moved
    its change time, and the load's first lookup took the file for rewritten and dropped every
    entry (90 of 997 loads beside a saving process). Loads now wait for a commit to end."""
    import re
    import threading

    model = tiny("llama")
    g = torch.Generator().manual_seed(19)
    system = _rand(40, g)
    saver = PrefixStore(model.config)
    for _ in range(3):
        _generate(model, system + _rand(5, g), saver)
    saver.save(tmp_path, model=model)
    _generate(model, system + _rand(5, g), saver)

    renaming, real_replace = threading.Event(), os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if re.fullmatch(r"prefix_store\.\d+-[0-9a-f]+\.kv", Path(src).name):  # the commit's index names src now
            renaming.set()
            threading.Event().wait(0.5)  # a load starts meanwhile
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    save = threading.Thread(target=saver.save, args=(tmp_path,), kwargs={"model": model})
    save.start()
    assert renaming.wait(60)
    loaded = PrefixStore(model.config)
    loaded.load(tmp_path, model=model)
    save.join()
    entries = len(loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "written after it was opened ... dropped" was a warning
        out = _generate(model, system + _rand(3, g), loaded)
    assert hf_vkv.reuse_report(out).reused_tokens >= len(system) and len(loaded) >= entries == 4
    loaded.check_invariants()

"""Caches and prefix stores across ``os.fork()`` (multiprocessing's default start method on Linux).

A memfd's pages are shared with a forked child, not copied: a child that wrote into a cache made
before the fork wrote into its parent's K/V, and a child that merely exited (its finalizers freeing
the inherited caches) punched holes in the parent's pages, which then read as zeros: the parent's
next step computed from zeroed keys and values, silently. Now the child refuses to use memory its
parent made (``ForkedMemoryError``) and leaves it alone at exit; caches it makes itself work.
Each scenario runs in a process of its own (a forked pytest would run pytest's teardown twice).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r"""
import os, sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from models import PAD, tiny
import hf_vkv
from hf_vkv.memory.process import ForkedMemoryError

model = tiny("llama")
kw = dict(max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 30, 2, 19]])
mask = torch.ones_like(ids)
store = hf_vkv.PrefixStore(model.config)
out = model.generate(ids, attention_mask=mask, cache_implementation="vkv", cache_config={{"prefix_store": store}}, **kw)
cache = out.past_key_values
snapshot = [(l.keys.clone(), l.values.clone()) for l in cache.layers]

def child():
    verdicts = []
    more = torch.cat([out.sequences, torch.tensor([[4, 8]])], 1)
    for name, call in [
        ("cache", lambda: model.generate(more, attention_mask=torch.ones_like(more), past_key_values=cache, **kw)),
        ("store", lambda: model.generate(more, attention_mask=torch.ones_like(more), cache_implementation="vkv",
                                         cache_config={{"prefix_store": store}}, **kw)),
        ("crop", lambda: cache.crop(-2)),
    ]:
        try:
            call()
            verdicts.append(name + ": ran")
        except ForkedMemoryError as e:
            verdicts.append(name + ": refused" if "forked from it" in str(e) else name + ": " + str(e))
    # a cache made in the child is the child's own: exact against DynamicCache
    a = model.generate(more, attention_mask=torch.ones_like(more), cache_implementation="vkv", **kw)
    b = model.generate(more, attention_mask=torch.ones_like(more), **kw)
    same = torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    verdicts.append("own cache: " + ("exact" if same else "differs"))
    with open({report!r}, "w") as f:
        f.write("\n".join(verdicts))

pid = os.fork()
if pid == 0:
    try:
        child()
    finally:
        {child_exit}
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
# the parent's K/V are as they were, and it goes on exactly
kept = all(torch.equal(k, a) and torch.equal(v, b) for (k, v), (a, b) in zip(snapshot, [(l.keys, l.values) for l in cache.layers]))
cache.check_invariants()
store.check_invariants()
more = torch.cat([out.sequences, torch.tensor([[4, 8]])], 1)
dyn = model.generate(more, attention_mask=torch.ones_like(more), **kw)
legacy = [(k.clone(), v.clone()) for k, v in snapshot]
from transformers import DynamicCache
held = DynamicCache(config=model.config)
for i, (k, v) in enumerate(legacy):
    held.update(k, v, i)
want = model.generate(more, attention_mask=torch.ones_like(more), past_key_values=held, **kw)
got = model.generate(more, attention_mask=torch.ones_like(more), past_key_values=cache, **kw)
continued = torch.equal(want.sequences, got.sequences) and all(torch.equal(x, y) for x, y in zip(want.logits, got.logits))
print("parent:", "kept" if kept else "CHANGED", "continued" if continued else "DIFFERS")
"""


@pytest.mark.parametrize("child_exit", ["sys.exit(0)", "os._exit(0)"])
def test_a_forked_child_refuses_its_parents_memory_and_leaves_it_whole(tmp_path: Path, child_exit: str) -> None:
    """``sys.exit`` in the child runs its finalizers (the inherited caches freed): before, the
    parent's K/V read as zeros afterwards; ``os._exit`` runs none (the child's own uses alone)."""
    report = tmp_path / "child.txt"
    code = _SCRIPT.format(tests=str(Path(__file__).parents[1]), report=str(report), child_exit=child_exit)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=str(Path(__file__).parents[2]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report.read_text().splitlines() == ["cache: refused", "store: refused", "crop: refused", "own cache: exact"]
    assert "parent: kept continued" in proc.stdout, proc.stdout + proc.stderr[-2000:]


_HELD_AT_FORK = r"""
import os, sys, threading, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from models import PAD, tiny
import hf_vkv
from hf_vkv.generate.proof_file import proof_file
from hf_vkv.prefix import store as store_module

model = tiny("llama")
ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 30, 2, 19]])
held, done = threading.Event(), threading.Event()

def saving():  # a thread in the middle of a save (and of a proof file's write) when the main thread forks
    with store_module._SAVING, proof_file()._lock:
        held.set()
        done.wait()

threading.Thread(target=saving, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(60)  # a child waiting for the parent's thread forever is killed: the test fails
    store = hf_vkv.PrefixStore(model.config)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=PAD, num_return_sequences=2,
                   do_sample=True, cache_implementation="vkv", cache_config={{"prefix_store": store}})
    store.save({folder!r}, model=model)
    os._exit(0)
_, status = os.waitpid(pid, 0)
done.set()
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_while_a_thread_saved_saves_its_own_store(tmp_path: Path) -> None:
    """A thread of the parent held the process's save lock (and the proof file's) when the main
    thread forked: the child's own save waited for a thread it does not have, forever."""
    folder = tmp_path / "child_store"
    code = _HELD_AT_FORK.format(tests=str(Path(__file__).parents[1]), folder=str(folder))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_VKV_PROOF_CACHE": str(tmp_path / "proofs.jsonl")},
                          cwd=str(Path(__file__).parents[2]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "child exit 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert (folder / "prefix_store.json").is_file()

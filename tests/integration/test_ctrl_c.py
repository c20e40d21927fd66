"""Ctrl-C at random moments of ``generate`` with a prefix store (real SIGINTs, sent by this test to
a child process that generates in a loop and catches each ``KeyboardInterrupt``, as a notebook
does): afterwards the store is consistent and serves DynamicCache's tokens, no page, memfd, cache,
forward hook or torch function mode is left behind. Before ``hf_vkv.memory.interrupts`` such a run
ended in a refcount that no table held, a pool transaction left open (every later call failed), a
forward hook of prefill once left on the model, or pages kept by a finalizer cut short."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_SECONDS = 6.0  # of SIGINTs
_CHILD = r'''
import gc, json, os, signal, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from torch.overrides import _get_current_function_mode_stack
sys.path.insert(0, TESTS)
from models import tiny
import hf_vkv
from hf_vkv import PrefixStore
from hf_vkv.cache.cache import VKVCache
torch.set_num_threads(THREADS)
model = tiny("llama")
store = PrefixStore(model.config)

def ids(n, seed=0):
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))

def call(x, store=store, **kw):
    kw.setdefault("do_sample", False)
    extra = {"cache_implementation": "vkv", "cache_config": {"prefix_store": store}} if store is not None else {}
    return model.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0, max_new_tokens=6, **kw, **extra)

def in_use():
    memory = store.memory("cpu")
    return sum(a.pool.stats().in_use for a in memory._arena_for.arenas.values() if not a.closed)

def memfds():
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += "memfd" in os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass
    return n

def live():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, VKVCache))

def hooks():
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

base = ids(30)
call(base)
call(torch.cat([base, ids(4, 1)], 1), num_beams=2)
call(torch.cat([base, ids(4, 2)], 1), do_sample=True, num_return_sequences=2)
store.clear()
gc.collect()
before = {"in_use": in_use(), "memfds": memfds(), "live": live(), "hooks": hooks(), "modes": 0}
print("READY", flush=True)
interrupts = k = 0

def interrupt(signum, frame):
    # Ctrl-C as Python's own handler raises it, but only while a call runs: the loop's own bytecodes
    # (its back-jump, its except clause) are not under test, and an interrupt there would end this process
    while frame is not None:
        if frame.f_code is call.__code__:
            raise KeyboardInterrupt
        frame = frame.f_back

signal.signal(signal.SIGINT, interrupt)
while not os.path.exists(STOP):
    k += 1
    x = torch.cat([base, ids(3 + k % 7, k)], 1)
    try:
        if k % 3 == 0:
            call(x, num_beams=2)
        elif k % 3 == 1:
            call(x, do_sample=True, num_return_sequences=2)
        else:
            call(x)
    except KeyboardInterrupt:
        interrupts += 1
signal.signal(signal.SIGINT, signal.SIG_IGN)
time.sleep(0.2)  # a SIGINT raised again by a timer lands now
gc.collect()
store.check_invariants()
x = torch.cat([base, ids(5, 99)], 1)
same = call(x).tolist() == call(x, store=None).tolist() == call(x).tolist()
store.check_invariants()
store.clear()
gc.collect()
after = {"in_use": in_use(), "memfds": memfds(), "live": live(), "hooks": hooks(),
         "modes": len(_get_current_function_mode_stack())}
print("RESULT " + json.dumps({"interrupts": interrupts, "calls": k, "same": same, "before": before, "after": after}),
      flush=True)
'''


@pytest.mark.parametrize("seed,threads", [(0, 1), (1, 2)])
def test_ctrl_c_at_random_moments_leaves_nothing_behind(tmp_path: Path, seed: int, threads: int) -> None:
    stop = tmp_path / "stop"
    code = (_CHILD.replace("TESTS", repr(str(Path(__file__).parents[1])))
            .replace("STOP", repr(str(stop))).replace("THREADS", str(threads)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY", child.stderr.read() if child.stderr else ""
        rng = random.Random(seed)
        end = time.monotonic() + _SECONDS
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.005, 0.1))
            child.send_signal(signal.SIGINT)
        stop.touch()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["interrupts"] >= 20, result  # the calls were interrupted, many times
    assert result["same"], "after the interrupts, a call with the store gave other tokens than DynamicCache's"
    assert result["after"] == result["before"], result

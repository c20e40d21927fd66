"""The ctypes-built DLPack capsule of ``hf_vkv.cuda.dlpack`` on the CPU (``kDLCPU``).

The CUDA backend wraps device addresses the same way with ``kDLCUDA``; everything but the device
type is the same code, so its lifetime rules are tested here: the owner lives exactly as long as
the tensor or any view of it, bytes are shared with the memory under the address, typed views
(bf16 included) are zero-copy, and a deleter that frees another such tensor does not deadlock.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_owner_lives_with_views

from hf_vkv.cuda.dlpack import tensor_over


def _memory(nbytes: int) -> tuple[ctypes.Array, int]:
    buf = (ctypes.c_uint8 * nbytes)()
    return buf, ctypes.addressof(buf)


def test_tensor_over_shares_the_bytes_and_keeps_its_owner_alive() -> None:
    buf, address = _memory(64)

    def make(owner: object) -> torch.Tensor:
        t = tensor_over(address, 64, owner, device=torch.device("cpu"))
        assert (t.dtype, t.shape, t.data_ptr(), t.device.type) == (torch.uint8, (64,), address, "cpu")
        t[3] = 7
        assert buf[3] == 7  # zero-copy: the tensor is the memory
        buf[5] = 9
        assert int(t[5]) == 9
        return t

    assert_owner_lives_with_views(make)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_typed_views_are_zero_copy(dtype: torch.dtype) -> None:
    buf, address = _memory(256)
    typed = tensor_over(address, 256, None, device=torch.device("cpu")).view(dtype)
    values = torch.linspace(-3, 3, typed.numel()).to(dtype)
    typed.copy_(values)
    again = tensor_over(address, 256, None, device=torch.device("cpu")).view(dtype)
    assert torch.equal(again, values) and again.data_ptr() == address
    raw = bytes(buf)
    assert raw == values.view(torch.uint8).numpy().tobytes()


def test_empty_and_bad_arguments() -> None:
    assert tensor_over(0, 0, None, device=torch.device("cpu")).numel() == 0
    with pytest.raises(ValueError, match="nbytes"):
        tensor_over(0, -1, None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU or CUDA"):
        tensor_over(0, 8, None, device=torch.device("meta"))


# Run in a child process: before the fix the deleter blocked forever on its own lock, which would
# hang this process (and every later tensor_over in it).
_REENTRANT = textwrap.dedent("""
    import ctypes, gc, torch
    from hf_vkv.cuda.dlpack import live_capsules, tensor_over

    mem = (ctypes.c_uint8 * 64)()
    cpu = torch.device("cpu")

    class Holder:  # like a reservation whose finalizer frees another tensor made by tensor_over
        pass

    holder = Holder()
    holder.inner = tensor_over(ctypes.addressof(mem) + 32, 32, None, device=cpu)
    outer = tensor_over(ctypes.addressof(mem), 32, holder, device=cpu)
    del holder
    assert live_capsules() == 2
    del outer  # deleter drops holder -> holder.inner's deleter runs inside the first one
    gc.collect()
    assert live_capsules() == 0, live_capsules()
    print("ok")
""")


@pytest.mark.slow  # a fresh interpreter: 13-23 s on a loaded 2-core machine
def test_a_deleter_that_frees_another_tensor_does_not_deadlock() -> None:
    try:
        proc = subprocess.run([sys.executable, "-c", _REENTRANT], capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("the DLPack deleter deadlocked: it re-entered itself while holding its lock")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]

"""The foundation's state machine (``tests/test_state_machine.py``) on device memory.

The very machine of the CPU suite runs over a :class:`~hf_vkv.cuda.CudaBackend` (through
:class:`FaultyCudaBackend`, which injects the same failures): random grow / write / share /
reorder / truncate / drop / clear / fork with backend failures armed before random operations,
every row read back from the device after every step and compared with a plain model, and the
driver asked (``cuMemRetainAllocationHandle``) whether it maps exactly what the page tables say.

Only the device-specific pieces are replaced: the page size (the machine's ``PAGE`` is set to
the device's granularity), the fixtures that read mappings and bytes, and the one invariant that
compares device bytes with host bytes (it reads them back first).
"""

from __future__ import annotations

import torch
from gpu_helpers import GPU, FaultyCudaBackend, check_mapped_pages, cuda_backend, gpu_snapshot
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

import test_state_machine as sm

pytestmark = GPU

EXAMPLES, STEPS = 25, 60  # 2 MiB pages: each step moves more bytes than on the CPU


class DeviceBufferMachine(sm.BufferMachine):
    """``BufferMachine`` whose rows live on the GPU (bytes compared on the host)."""

    @invariant()
    def reads_what_the_model_says(self):
        check_mapped_pages(*self.bufs)
        for buf, models in zip(self.bufs, self.models):
            buf.check_invariants()
            for r, m in enumerate(models):
                first = self._first_live(m)
                assert (buf.length(r), buf.first_live(r)) == (m.length, first), r
                row = buf.table.row(r)
                assert (row.length, row.start, row.end) == (m.length * self.item, m.start, self._end_page(m)), r
                got = buf.view(range(r, r + 1), first, m.length)[0]
                assert got.device.type == "cuda"
                got = got.cpu()
                span = slice(first * self.item, m.length * self.item)
                known = m.known[span]
                assert torch.equal(got[known], m.data[span][known]), f"row {r} reads other bytes"
        assert self.backend.resident_bytes() <= self.arena.pool.stats().resident_bytes


def test_random_operations_on_device_memory(monkeypatch):
    probe = cuda_backend(max_pages=1)
    granularity = probe.page_bytes
    probe.close()
    monkeypatch.setattr(sm, "PAGE", granularity)
    DeviceBufferMachine.make_backend = FaultyCudaBackend
    DeviceBufferMachine.tools = {"mapped_pages": check_mapped_pages, "snapshot": gpu_snapshot}
    DeviceBufferMachine.steps = 0
    run_state_machine_as_test(DeviceBufferMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    ))
    assert DeviceBufferMachine.steps >= 1_000, DeviceBufferMachine.steps

"""The foundation's state machine (``tests/stateful/test_state_machine.py``) on device memory.

The very machine of the CPU suite runs over a :class:`~hf_vkv.cuda.CudaBackend` (through
:class:`FaultyCudaBackend`, which injects the same failures): random grow / write / share /
reorder / truncate / drop / clear / fork with backend failures armed before random operations,
every row read back from the device after every step and compared with a plain model, and the
driver asked (``cuMemRetainAllocationHandle``) whether it maps exactly what the page tables say.

Only the device-specific pieces are replaced: the page size (the machine's ``PAGE`` is set to
the device's granularity) and the fixtures that read mappings.
"""

from __future__ import annotations

from gpu_helpers import GPU, FaultyCudaBackend, check_mapped_pages, cuda_backend, gpu_snapshot
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from stateful import test_state_machine as sm  # tests/stateful/ (tests/ is on sys.path: conftest.py)

pytestmark = GPU

EXAMPLES, STEPS = 25, 60  # 2 MiB pages: each step moves more bytes than on the CPU


class DeviceBufferMachine(sm.BufferMachine):
    """``BufferMachine`` whose rows live on the GPU (its invariants read the bytes back)."""


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

"""Random operations on real memory (HostBackend + Arena + VirtualBuffer) against a plain model.

The model keeps, per row, its length, the first page still held (sliding windows) and the bytes it
must read, as torch tensors, with a mask of the bytes that are defined (items grown but never
written are not). Rows are independent in the model: pages are shared underneath, but every write
goes through ``prepare_write``, which copies shared pages first, so no row can see another's write.

After every step each row of every buffer must read its model's bytes through ``view``, the kernel
must map exactly what the page tables say, and ``check_invariants()`` must pass. A rule also arms a
backend failure at a random upcoming call before a random operation: it must either succeed or
raise ``BackendError`` with everything as it was; another arms a second failure that hits the
rollback of the first: then the buffer may instead be closed (its reservation reset), and the
machine goes on without it. Teardown closes everything and checks that every
page went back and that the memfd holds no memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from hf_vkv.memory import Arena, BackendError, CapacityError, InvariantError, KVCacheOutOfMemory, VirtualBuffer

PAGE = 4096
EXAMPLES, STEPS = 200, 100  # ~15,000 steps a run (hypothesis starts with some short examples; 160 gave 9,616 once)
_names = itertools.count()


@dataclass
class RowModel:
    length: int  # items
    start: int  # first page index held
    data: torch.Tensor  # uint8 [capacity * item_bytes]: what the row must read
    known: torch.Tensor  # bool [capacity * item_bytes]: which of those bytes are defined

    def copy(self) -> RowModel:
        return RowModel(self.length, self.start, self.data.clone(), self.known.clone())


class BufferMachine(RuleBasedStateMachine):
    """Set ``make_backend`` and ``tools`` (the conftest fixtures) before running."""

    make_backend = None
    tools: dict = {}
    steps = 0
    closures = 0  # buffers closed because a rollback failed too

    # ------------------------------------------------------------------------------------ set-up
    @initialize(rows=st.integers(1, 4), pages=st.integers(2, 6), item=st.integers(8, 24),
                slack=st.integers(0, 40), budget=st.one_of(st.none(), st.integers(2, 40)))
    def setup(self, rows, pages, item, slack, budget):
        self.item = item
        self.rows, self.pages, self.slack = rows, pages, slack
        self.capacity = pages * PAGE // item - slack
        self.backend = type(self).make_backend(page_bytes=PAGE, name=f"hf_vkv-sm-{next(_names)}")
        self.budget = None if budget is None else budget * PAGE
        self.arena = Arena(self.backend, budget_bytes=self.budget)
        self.bufs = [VirtualBuffer(self.arena, rows=rows, capacity=self.capacity, item_bytes=item)]
        self.models = [[self._empty() for _ in range(rows)]]
        self.seeds = itertools.count()

    def _empty(self) -> RowModel:
        n = self.capacity * self.item
        return RowModel(0, 0, torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.bool))

    def _end_page(self, m: RowModel) -> int:
        return -(-m.length * self.item // PAGE)

    def _first_live(self, m: RowModel) -> int:
        return min(-(-m.start * PAGE // self.item), m.length)

    def _forget_after(self, m: RowModel, length: int) -> None:
        m.known[length * self.item:] = False

    # ------------------------------------------------------------------------------------ operations
    # Each returns (call, expected error or None, model update taking the call's result).
    def _pick(self, data):
        b = data.draw(st.integers(0, len(self.bufs) - 1), label="buffer")
        rows = data.draw(st.lists(st.integers(0, self.bufs[b].rows - 1), min_size=1, max_size=self.bufs[b].rows,
                                  unique=True), label="rows")
        return b, rows

    def _length(self, data):
        return data.draw(st.one_of(st.integers(0, self.capacity), st.integers(-2, self.capacity + 3)), label="items")

    def op_grow(self, data):
        b, rows = self._pick(data)
        n = self._length(data)
        error = CapacityError if n > self.capacity else ValueError if n < 0 else None

        def update(_):
            for r in rows:
                m = self.models[b][r]
                m.length = max(m.length, n)
        return lambda: self.bufs[b].grow(rows, n), error, update

    def op_write(self, data):
        b, rows = self._pick(data)
        end = self._length(data)
        start = data.draw(st.integers(max(0, end - 300) - 1, max(end, 0)), label="start")
        error = CapacityError if end > self.capacity else ValueError if start < 0 or start > end else None
        if error is None and start < end:
            for r in rows:
                if start * self.item // PAGE < self.models[b][r].start:
                    error = ValueError  # into pages dropped behind the window
        seed = next(self.seeds)

        def call():
            self.bufs[b].prepare_write(rows, start, end)
            gen = torch.Generator().manual_seed(seed)
            out = []
            for r in rows:
                values = torch.randint(0, 256, ((end - start) * self.item,), dtype=torch.uint8, generator=gen)
                self.bufs[b].view(range(r, r + 1), start, end)[0] = values
                out.append(values)
            return out

        def update(written):
            for r, values in zip(rows, written):
                m = self.models[b][r]
                m.length = max(m.length, end)
                m.data[start * self.item:end * self.item] = values
                m.known[start * self.item:end * self.item] = True
        return call, error, update

    def op_share(self, data):
        b, dsts = self._pick(data)
        src = data.draw(st.integers(0, self.bufs[b].rows - 1), label="src")
        source = self.models[b][src]
        n = data.draw(st.one_of(st.none(), st.integers(-1, source.length + 1)), label="length")
        length = source.length if n is None else n
        error = None
        if not 0 <= length <= source.length or (length and -(-length * self.item // PAGE) <= source.start):
            error = ValueError if any(d != src for d in dsts) else None  # a row is not shared with itself

        def update(_):
            for d in dsts:
                if d != src:
                    m = self.models[b][d] = source.copy()
                    m.length, m.start = length, source.start if length else 0
                    self._forget_after(m, length)
        return lambda: self.bufs[b].share(src, dsts, length=n), error, update

    def op_reorder(self, data):
        b = data.draw(st.integers(0, len(self.bufs) - 1), label="buffer")
        rows = self.bufs[b].rows
        index = data.draw(st.lists(st.integers(0, rows - 1), max_size=rows), label="index")  # duplicates, shorter
        private = data.draw(st.booleans(), label="private_tails")  # beams copy shared tails into their own pages

        def update(_):
            self.models[b] = [self.models[b][i].copy() for i in index] + [self._empty()
                                                                          for _ in range(rows - len(index))]
        return lambda: self.bufs[b].reorder(index, private_tails=private), None, update

    def op_truncate(self, data):
        b, rows = self._pick(data)
        n = data.draw(st.integers(-1, self.capacity), label="items")

        def update(_):
            for r in rows:
                m = self.models[b][r]
                if n < m.length:
                    m.length = n
                    m.start = min(m.start, self._end_page(m)) if n else 0
                    self._forget_after(m, n)
        return lambda: self.bufs[b].truncate(rows, n), ValueError if n < 0 else None, update

    def op_drop_before(self, data):
        b, rows = self._pick(data)
        n = data.draw(st.integers(-1, self.capacity), label="item")

        def update(_):
            for r in rows:
                m = self.models[b][r]
                unit = min(n * self.item, m.length * self.item)
                m.start = max(m.start, min(unit // PAGE, self._end_page(m)))
        return lambda: self.bufs[b].drop_before(rows, n), ValueError if n < 0 else None, update

    def op_clear(self, data):
        b, rows = self._pick(data)

        def update(_):
            for r in rows:
                self.models[b][r] = self._empty()
        return lambda: self.bufs[b].clear(rows), None, update

    def op_fork(self, data):
        src = data.draw(st.integers(0, len(self.bufs) - 1), label="buffer")
        rows = data.draw(st.integers(1, self.bufs[src].rows + 1), label="rows")
        models = self.models[src]
        error = ValueError if any(m.length for m in models[rows:]) else None

        def update(new):
            self.bufs.append(new)
            self.models.append([m.copy() for m in models[:rows]] + [self._empty() for _ in range(rows - len(models))])
            if len(self.bufs) == 3:  # keep two buffers: close the one that was not forked
                victim = 1 - src
                self.bufs.pop(victim).close()
                self.models.pop(victim)
        return lambda: self.bufs[src].fork(rows=rows), error, update

    OPS = ("grow", "write", "share", "reorder", "truncate", "drop_before", "clear", "fork")

    def _do(self, call, error, update, *, fork: bool = False) -> None:
        type(self).steps += 1
        armed = self.backend.armed
        snapshot = self.tools["snapshot"]
        may_fail = armed or error is not None or self.budget is not None  # else skip the costly snapshot
        before = snapshot(*self.bufs, id_space=not fork) if may_fail else None
        try:
            result = call()
        except BackendError as exc:
            assert armed and "injected failure" in str(exc), exc
        except KVCacheOutOfMemory as exc:
            assert self.budget == exc.budget_bytes and exc.free_bytes < exc.requested_bytes
        except (ValueError, IndexError) as exc:
            assert error is not None and isinstance(exc, error), (error, exc)
        else:
            assert error is None, f"expected {error.__name__}"
            self.backend.disarm()  # a failure armed for this call must not hit the model's own clean-up
            update(result)
            return
        assert snapshot(*self.bufs, id_space=not fork) == before

    # ------------------------------------------------------------------------------------ rules
    @rule(data=st.data())
    def grow(self, data):
        self._do(*self.op_grow(data))

    @rule(data=st.data())
    def write(self, data):
        self._do(*self.op_write(data))

    @rule(data=st.data())
    def share(self, data):
        self._do(*self.op_share(data))

    @rule(data=st.data())
    def reorder(self, data):
        self._do(*self.op_reorder(data))

    @rule(data=st.data())
    def truncate(self, data):
        self._do(*self.op_truncate(data))

    @rule(data=st.data())
    def drop_before(self, data):
        self._do(*self.op_drop_before(data))

    @rule(data=st.data())
    def clear(self, data):
        self._do(*self.op_clear(data))

    @rule(data=st.data())
    def fork(self, data):
        self._do(*self.op_fork(data), fork=True)

    @rule(data=st.data(), method=st.sampled_from(("create", "map", "unmap", "copy")), at=st.integers(1, 4),
          partial=st.booleans(), op=st.sampled_from(OPS))
    def fail_a_backend_call(self, data, method, at, partial, op):
        self.backend.arm(method, at, partial=partial)
        try:
            self._do(*getattr(self, f"op_{op}")(data), fork=op == "fork")
        finally:
            self.backend.disarm()

    @rule(data=st.data(), method=st.sampled_from(("map", "unmap")), at=st.integers(1, 3),
          then=st.sampled_from(("map", "unmap")), later=st.integers(1, 4), op=st.sampled_from(OPS))
    def fail_an_operation_and_its_rollback(self, data, method, at, then, later, op):
        """Two failures: the second hits the rollback of the first. The operation
        succeeds, or everything is as it was, or the buffer it ran on was closed (its reservation
        reset: no hole, nothing of its memfd mapped there) and the machine goes on without it."""
        type(self).steps += 1
        call, error, update = getattr(self, f"op_{op}")(data)
        self.backend.arm(method, at)
        self.backend.arm_also(then, later + (at if then == method else 0))
        before = self.tools["snapshot"](*self.bufs, id_space=op != "fork")
        try:
            result = call()
        except BackendError as exc:
            assert "injected failure" in str(exc) and "\n" not in str(exc), exc
            closed = [i for i, b in enumerate(self.bufs) if b.closed]
            if not closed:
                assert self.tools["snapshot"](*self.bufs, id_space=op != "fork") == before
            else:
                assert "create a new cache" in str(exc) and len(closed) == 1
                type(self).closures += 1
                gone = self.bufs.pop(closed[0])
                self.models.pop(closed[0])
                self.tools["mapped_pages"](*self.bufs)
                del gone
                if not self.bufs:  # that was the arena's last buffer: start again on a new one
                    assert self.arena.closed and self.backend.resident_bytes_at_close == 0
                    self.setup(rows=self.rows, pages=self.pages, item=self.item, slack=self.slack,
                               budget=None if self.budget is None else self.budget // PAGE)
        except KVCacheOutOfMemory as exc:
            assert self.budget == exc.budget_bytes
        except (ValueError, IndexError) as exc:
            assert error is not None and isinstance(exc, error), (error, exc)
        else:
            assert error is None, f"expected {error.__name__}"
            self.backend.disarm()
            update(result)
        finally:
            self.backend.disarm()

    @rule()
    def trim(self):
        type(self).steps += 1
        stats = self.arena.pool.stats()
        assert self.arena.trim() == stats.resident_free * PAGE
        assert self.backend.resident_bytes() <= stats.in_use * PAGE

    # ------------------------------------------------------------------------------------ checks
    @invariant()
    def reads_what_the_model_says(self):
        self.tools["mapped_pages"](*self.bufs)
        for buf, models in zip(self.bufs, self.models):
            buf.check_invariants()
            for r, m in enumerate(models):
                first = self._first_live(m)
                assert (buf.length(r), buf.first_live(r)) == (m.length, first), r
                row = buf.table.row(r)
                assert (row.length, row.start, row.end) == (m.length * self.item, m.start, self._end_page(m)), r
                got = buf.view(range(r, r + 1), first, m.length)[0].cpu()  # (device memory in the GPU suite)
                span = slice(first * self.item, m.length * self.item)
                known = m.known[span]
                assert torch.equal(got[known], m.data[span][known]), f"row {r} reads other bytes"
            self._shared_items_hold_equal_bytes(buf, models)
        assert self.backend.resident_bytes() <= self.arena.pool.stats().resident_bytes

    def _shared_items_hold_equal_bytes(self, buf: VirtualBuffer, models: list[RowModel]) -> None:
        """What the cascade attention reads once for two rows (``shared_items``) is the same bytes
        in both rows' models, and within both rows."""
        for a, b in itertools.combinations(range(len(models)), 2):
            n = buf.shared_items(a, b)
            assert n == buf.shared_items(b, a) and n <= min(models[a].length, models[b].length), (a, b)
            span = slice(0, n * self.item)
            both = models[a].known[span] & models[b].known[span]
            assert torch.equal(models[a].data[span][both], models[b].data[span][both]), f"rows {a}, {b}"

    def teardown(self):
        if not hasattr(self, "bufs"):
            return
        for buf in self.bufs:
            buf.close()
        assert self.arena.closed
        stats = self.arena.pool.stats()
        assert (stats.in_use, stats.resident_free) == (0, 0)
        assert self.backend.resident_bytes_at_close == 0  # the memfd's allocated blocks
        with open("/proc/self/maps") as f:
            assert self.backend.name not in f.read(), "a mapping of the memfd outlived the buffers"


@pytest.mark.slow
def test_random_operations_on_real_memory(faulty_backend, mapped_pages, buffer_snapshot):
    BufferMachine.make_backend = faulty_backend
    BufferMachine.tools = {"mapped_pages": mapped_pages, "snapshot": buffer_snapshot}
    BufferMachine.steps = BufferMachine.closures = 0
    run_state_machine_as_test(BufferMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    ))
    assert BufferMachine.steps >= 10_000, BufferMachine.steps
    assert BufferMachine.closures > 0  # failing rollbacks were reached, not only failing operations


def test_the_machine_check_catches_a_wrong_refcount(faulty_backend, mapped_pages, buffer_snapshot):
    """The machine's after-every-step check fails on a refcount that differs from the tables."""
    BufferMachine.make_backend = faulty_backend
    BufferMachine.tools = {"mapped_pages": mapped_pages, "snapshot": buffer_snapshot}
    machine = BufferMachine()
    machine.setup(rows=2, pages=2, item=8, slack=0, budget=None)
    machine.bufs[0].grow([0, 1], 600)
    for m in machine.models[0]:
        m.length = 600
    machine.reads_what_the_model_says()
    pool = machine.arena.pool
    page = machine.bufs[0].table.row(1).pages[0]
    pool._refs[page] += 1
    with pytest.raises(InvariantError, match="refcount != occurrences"):
        machine.reads_what_the_model_says()
    pool._refs[page] -= 1
    machine.teardown()

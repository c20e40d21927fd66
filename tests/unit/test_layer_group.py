"""Executable specs of :class:`hf_vkv.cache.group.LayerGroup` driven directly (no model, no
transformers cache): a token-major layout of two members, one KV head of 2 float32 dims (a token
of the group is 2 members x (K, V) x 2 x 4 bytes = 32 bytes), 4 KiB host pages (128 tokens).

Lengths per member, crop rules of sliding groups with and without recording, reorder/repeat on
exact row contents, and ``check_invariants`` catching a broken state.
"""

from __future__ import annotations

import pytest
import torch

from hf_vkv.cache.group import LayerGroup
from hf_vkv.cache.layouts.token_major import TokenMajorLayout
from hf_vkv.memory import Arena, HostBackend, InvariantError

PAGE = 4096


def make(*, window: int | None = None, rows: int = 2, repeats: int = 1) -> LayerGroup:
    arenas: dict[torch.device, Arena] = {}

    def arena_for(device: torch.device, layout: type) -> Arena:
        if device not in arenas:
            arenas[device] = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-group"))
        return arenas[device]

    return LayerGroup(name="g", members=[3, 5], sliding_window=window,
                      make_layout=lambda geometry, members: TokenMajorLayout(geometry, members=members),
                      arena_for=arena_for, rows_hint=rows, capacity=512, prompt_repeats=repeats, share_prompts=True)


def states(batch: int, tokens: int, first: float) -> torch.Tensor:
    """``[batch, 1, tokens, 2]`` whose token ``t`` of row ``b`` is ``first + 100 * b + t`` in both dims."""
    t = first + torch.arange(tokens, dtype=torch.float32) + 100 * torch.arange(batch, dtype=torch.float32)[:, None]
    return t[:, None, :, None].expand(batch, 1, tokens, 2).contiguous()


def step(group: LayerGroup, batch: int, tokens: int, first: float) -> None:
    """One model step: every member writes ``tokens`` new tokens (values = keys + 0.5)."""
    for layer in group.members:
        k = states(batch, tokens, first)
        group.init_layer(layer, k, k + 0.5)
        group.update(layer, k, k + 0.5)
    group.check_invariants()


def tokens_of(group: LayerGroup, layer: int) -> list[list[float]]:
    keys, values = group.cached(layer)
    assert torch.equal(values, keys + 0.5)
    return keys[:, 0, :, 0].tolist()


def test_each_member_keeps_its_own_length() -> None:
    g = make()
    k = states(2, 4, 0)
    g.init_layer(3, k, k + 0.5)
    g.update(3, k, k + 0.5)  # member 3 wrote a step, member 5 not yet
    assert (g.length(3), g.length(5), g.lengths, g.batch) == (4, 0, [4, 0], 2)
    g.check_invariants()
    g.init_layer(5, k, k + 0.5)
    g.update(5, k, k + 0.5)
    assert g.lengths == [4, 4] and g.member_of == {3: 0, 5: 1}
    step(g, 2, 1, 4)
    assert g.lengths == [5, 5] and tokens_of(g, 5) == [[0, 1, 2, 3, 4], [100, 101, 102, 103, 104]]
    g.close()


def test_a_sliding_group_shows_its_window_and_crops_only_when_recording() -> None:
    g = make(window=3)
    step(g, 1, 5, 0)
    assert g.window_start(5) == 3 and g.kept_from(3) == 3
    assert tokens_of(g, 3) == [[3, 4]]
    step(g, 1, 1, 5)
    assert tokens_of(g, 3) == [[4, 5]]  # 6 tokens, window 3: tokens 4 and 5 (the mask adds the next)
    with pytest.raises(RuntimeError, match="does not track past states"):
        g.check_crop(-1)
    g.close()

    r = make(window=3)
    step(r, 1, 2, 0)
    r.check_crop(-1)  # under the window: a crop is fine even without recording
    r.start_recording()
    step(r, 1, 4, 2)
    assert r.kept_from(3) == 0 and tokens_of(r, 3) == [[0, 1, 2, 3, 4, 5]]  # recording keeps every token
    r.check_crop(-2)
    r.crop(-2)
    assert r.lengths == [4, 4] and r.kept_from(3) == 2 and tokens_of(r, 3) == [[2, 3]]
    step(r, 1, 1, 40)
    assert tokens_of(r, 5) == [[2, 3, 40]]
    r.close()


def test_crop_of_a_full_group_truncates_every_row() -> None:
    g = make()
    step(g, 2, 6, 0)
    g.crop(-4)
    assert g.lengths == [2, 2] and [g.buffer.length(r) for r in range(2)] == [2, 2]
    assert tokens_of(g, 3) == [[0, 1], [100, 101]]
    g.crop(-9)  # more than it holds: empty, not negative
    assert g.lengths == [0, 0]
    g.check_invariants()
    g.close()


def test_reorder_and_repeat_move_rows_and_copy_only_a_tail_in_place() -> None:
    g = make(rows=2)
    step(g, 2, 3, 0)
    own = [g.buffer.table.row(r).pages for r in range(2)]
    g.reorder([1, 1])
    assert tokens_of(g, 3) == [[100, 101, 102], [100, 101, 102]]
    # row 0 took row 1's partly written page, and nobody holds row 0's own page any more: the
    # tokens were copied into it, so both rows keep their pages (and mappings) and write in place
    assert [g.buffer.table.row(r).pages for r in range(2)] == own
    assert g.buffer.table.tail_copies == 1 and g.buffer.table.cow_copies == 0
    assert g.buffer.stats().shared_pages == 0
    with pytest.raises(IndexError, match=r"row indices \[2\] are out of range for a batch of 2"):
        g.reorder([2])
    g.reorder([0])
    assert g.batch == 1
    g.repeat_rows(3)  # more rows than the buffer has: it moves to a larger one, sharing the pages
    assert g.batch == 3 and g.buffer.rows == 3
    assert tokens_of(g, 5) == [[100, 101, 102]] * 3
    g.check_invariants()
    step(g, 3, 1, 7)  # a write to the shared page copies it per row
    assert tokens_of(g, 5) == [[100, 101, 102, 7], [100, 101, 102, 107], [100, 101, 102, 207]]
    g.close()


def test_check_invariants_catches_a_broken_state() -> None:
    g = make(rows=3)
    step(g, 2, 4, 0)
    g.lengths[1] = 9  # a member longer than its rows
    with pytest.raises(InvariantError, match="group 'g': row 0 holds 4 tokens, a member has 9"):
        g.check_invariants()
    g.lengths[1] = 4
    g.buffer.grow([2], 1)  # a row past the batch holding tokens
    with pytest.raises(InvariantError, match=r"group 'g': row 2 is past the batch \(2\) but holds tokens"):
        g.check_invariants()
    g.buffer.clear([2])
    g.check_invariants()
    g.close()

    s = make(window=2)
    step(s, 1, 200, 0)
    step(s, 1, 1, 200)  # the page of tokens 0..127 lies wholly behind the window: dropped
    assert s.buffer.first_live(0) == 128
    s.lengths = [50, 50]  # a window at 49 would need a dropped page
    with pytest.raises(InvariantError, match="dropped tokens its window still needs"):
        s.check_invariants()
    s.close()


def _returned(copy_reads: bool, tokens: int) -> torch.Tensor:
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-group"))
    group = LayerGroup(name="g", members=[0], sliding_window=None,
                       make_layout=lambda geometry, members: TokenMajorLayout(geometry, members=members,
                                                                              copy_reads=copy_reads),
                       arena_for=lambda device, layout: arena, rows_hint=2, capacity=64, prompt_repeats=1,
                       share_prompts=False)
    k = states(2, 5, 0.0)
    group.init_layer(0, k, k)
    group.update(0, k, k)
    new = states(2, tokens, 5.0)
    keys, _ = group.update(0, new, new)
    assert keys[:, 0, :, 0].tolist() == [[float(t) + 100 * b for t in range(5 + tokens)] for b in range(2)]
    return keys


def test_token_major_hands_views_to_decode_steps_and_copies_to_several_tokens() -> None:
    """One new token: a strided view of the pages (zero copy); several: a contiguous copy, as
    DynamicCache's torch.cat; with copy_reads (eager attention, one K/V head per query head):
    always a contiguous copy."""
    view = _returned(False, 1)
    assert not view.is_contiguous() and view.stride(2) == 4  # a token: the one member's K and V, 2 elements each
    assert _returned(False, 3).is_contiguous()
    assert _returned(True, 1).is_contiguous()


def test_which_attention_reads_need_contiguous_states() -> None:
    from transformers import LlamaConfig

    from hf_vkv.cache.sources import reads_need_contiguous
    from hf_vkv.cache.geometry import GroupGeometry

    def need(attn: str, kv_heads: int, device: str = "cuda", dim: int = 16) -> bool:
        config = LlamaConfig(num_attention_heads=4, num_key_value_heads=kv_heads)
        config._attn_implementation = attn
        geometry = GroupGeometry(kv_heads=kv_heads, key_dim=dim, value_dim=dim, dtype=torch.float32,
                                 device=torch.device(device))
        return reads_need_contiguous(config, geometry)

    assert need("eager", 4)  # a matmul over the returned tensors themselves
    assert not need("eager", 2)  # repeat_kv copies grouped heads first
    assert not need("sdpa", 4) and not need("vkv_paged", 4)
    # on the host every attention but SDPA (over aligned views: tests/unit/test_host_stride_exact.py)
    # and vkv's own
    assert not need("sdpa", 2, "cpu") and not need("sdpa", 4, "cpu")
    assert need("eager", 2, "cpu") and need("eager", 4, "cpu") and need("flex_attention", 2, "cpu")
    assert not need("vkv_paged", 4, "cpu") and not need("vkv_cascade", 2, "cpu")
    assert need("sdpa", 2, "cpu", dim=50)  # 200 bytes a head's token: misaligned
    # on any device where a head's token is not a multiple of 64 bytes (views would start the
    # (row, head) blocks at other alignments than DynamicCache's), every attention but vkv's own
    assert need("sdpa", 2, dim=8) and need("eager", 2, dim=10) and not need("vkv_paged", 2, dim=8)

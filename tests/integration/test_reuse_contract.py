"""Prefix reuse's contract: the logits of a DynamicCache that holds the same history, continued.

A turn that reuses a stored prefix computes only the prompt's other tokens, over the stored K/V.
The honest reference is what transformers computes when a user reuses a cache by hand: the
DynamicCache that ``generate`` returned for the previous turn (``out.past_key_values``), passed to
the next turn's ``generate`` with the whole conversation's ids. Both caches then hold the same
history computed in the same chunks (the first prompt prefilled, each answer one decode step per
token) and compute the same new tokens: every step's logits must be ``torch.equal``, and the tokens.

What each side holds: ``generate`` feeds back every generated token but the last, so turn ``k``'s
DynamicCache holds its prompt and answer less the last token, and the store keeps exactly that
(greedy and sampling: prompt and answer up to the first end-of-sequence token; beam search: the
prompt only, which all beams share, so the reference is cut back to the prompt with
``crop``). The next turn's prompt extends it, so both compute the answer's last token and the new
message. Each case asserts that the store lent exactly the columns the reference holds.

A batch of questions about one stored document: the vkv rows start at column ``C`` (the longest
row's document end; a left-padded row holds its padding and the document's first ``C - pad``
tokens, and computes the rest of the document again with its question). The reference is a
DynamicCache holding the same columns: the document's K/V, computed once (batch 1, one chunk, as
the store computed it), placed after each row's left padding up to column ``C``, continued over the
batch (questions of one length: ``batch_repeat_interleave`` of the document's cache). A DynamicCache
continued per question (batch 1) is not the same computation: its matrix products have other
shapes, and it differs from the batched DynamicCache as much as from vkv
(:func:`test_per_question_references_differ_by_batching_alone`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from models import EOS, PAD, tiny
from transformers import DynamicCache

from hf_vkv import PrefixStore, reuse_report
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration

NEW = 6  # tokens generated per turn


@dataclasses.dataclass(frozen=True)
class Chat:
    arch: str
    mode: str  # greedy | beams | sample | sample_n2
    turns: int
    system: int  # tokens of the first prompt before its first message
    dtype: torch.dtype = torch.float32
    threads: int = 1
    num_beams: int = 3
    seed: int = 0
    page_bytes: int | None = None  # the store's (None: its default); 4 KiB pages let sliding windows drop pages


    @property
    def id(self) -> str:
        mode = f"beams{self.num_beams}" if self.mode == "beams" else self.mode
        return (f"{self.arch}-{mode}-{self.turns}turns-sys{self.system}-{str(self.dtype)[6:]}-{self.threads}t"
                f"-s{self.seed}" + (f"-{self.page_bytes}B" if self.page_bytes else ""))

    def kwargs(self) -> dict[str, Any]:
        return {"greedy": {"do_sample": False},
                "beams": {"do_sample": False, "num_beams": self.num_beams},
                "sample": {"do_sample": True, "top_k": 0},
                "sample_n2": {"do_sample": True, "top_k": 0, "num_return_sequences": 2}}[self.mode]

    @property
    def rows(self) -> int:
        return {"beams": self.num_beams, "sample_n2": 2}.get(self.mode, 1)


B16 = torch.bfloat16
CHATS = [
    # llama: every mode, 2-5 turns, short and long system prompts, both dtypes, 1 and 2 threads
    Chat("llama", "greedy", 2, 8),
    Chat("llama", "greedy", 5, 40, seed=1),
    Chat("llama", "greedy", 3, 100, dtype=B16, seed=2),
    Chat("llama", "greedy", 4, 24, threads=2, seed=3),
    Chat("llama", "greedy", 3, 60, dtype=B16, threads=2, seed=4),
    Chat("llama", "beams", 3, 24, num_beams=2, seed=5),
    Chat("llama", "beams", 4, 40, num_beams=3, seed=6),
    Chat("llama", "beams", 2, 70, num_beams=4, dtype=B16, seed=7),
    Chat("llama", "beams", 3, 16, num_beams=4, threads=2, seed=8),
    Chat("llama", "beams", 3, 32, num_beams=3, dtype=B16, threads=2, seed=9),
    Chat("llama", "sample", 4, 24, seed=10),
    Chat("llama", "sample", 3, 80, dtype=B16, seed=11),
    Chat("llama", "sample", 5, 12, threads=2, seed=12),
    Chat("llama", "sample_n2", 3, 30, seed=13),
    Chat("llama", "sample_n2", 2, 50, dtype=B16, threads=2, seed=14),
    # qwen2 (attention biases)
    Chat("qwen2", "greedy", 4, 30, seed=15),
    Chat("qwen2", "greedy", 3, 50, dtype=B16, threads=2, seed=16),
    Chat("qwen2", "beams", 3, 20, num_beams=3, seed=17),
    Chat("qwen2", "beams", 2, 40, num_beams=2, dtype=B16, seed=18),
    Chat("qwen2", "sample", 4, 36, dtype=B16, seed=19),
    Chat("qwen2", "sample", 3, 20, threads=2, seed=20),
    # gpt2 (learned positions, fused QKV, no GQA)
    Chat("gpt2", "greedy", 3, 30, seed=21),
    Chat("gpt2", "beams", 3, 20, num_beams=2, dtype=B16, seed=22),
    Chat("gpt2", "sample", 3, 40, threads=2, seed=23),
    # sliding-window layers (mistral: every layer, window 8; gemma3: two of three, window 6): rows shared from
    # token 0, the window of each stored row held
    Chat("mistral", "greedy", 4, 4, seed=24),
    Chat("mistral", "greedy", 4, 80, seed=31, page_bytes=4096),
    Chat("mistral", "sample", 3, 150, dtype=B16, threads=2, seed=25, page_bytes=4096),
    Chat("mistral", "sample_n2", 3, 90, seed=26, page_bytes=4096),
    Chat("gemma3", "greedy", 3, 30, dtype=B16, seed=27),
    Chat("gemma3", "greedy", 4, 70, threads=2, seed=28, page_bytes=4096),
    Chat("gemma3", "sample", 3, 100, seed=29, page_bytes=4096),
    Chat("gemma3", "sample_n2", 3, 140, dtype=B16, threads=2, seed=30, page_bytes=4096),
]


def _model(arch: str, dtype: torch.dtype) -> Any:
    """The tiny ``arch`` model in ``dtype`` (a copy: the shared float32 one is left as it is)."""
    model = tiny(arch)
    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, *, seed: int, store: PrefixStore | None = None,
              cache: DynamicCache | None = None, new: int = NEW, **kwargs: Any) -> Any:
    torch.manual_seed(seed)
    if store is not None:
        kwargs.update(cache_implementation="vkv", cache_config={"prefix_store": store})
    if cache is not None:
        kwargs[cache_kwarg()] = cache
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=PAD, output_logits=True,
                          return_dict_in_generate=True, **kwargs)


def _assert_identical(ref: Any, got: Any, where: str) -> None:
    """Tokens and every step's logits ``torch.equal`` (the first differing step named)."""
    assert torch.equal(ref.sequences, got.sequences), f"{where}: tokens differ\n{ref.sequences}\n{got.sequences}"
    assert len(ref.logits) == len(got.logits), where
    for step, (a, b) in enumerate(zip(ref.logits, got.logits)):
        if not torch.equal(a, b):
            diff = float((a.float() - b.float()).abs().max())
            raise AssertionError(f"{where}: logits differ at step {step} (max |difference| {diff:.3g})")


def _continue(cache: DynamicCache, *, columns: int, rows: int) -> DynamicCache:
    """The previous turn's DynamicCache made this turn's history, as a user does it by hand: cut
    to ``columns`` (beam search: the prompt), its first row (the sequence the chat continues)
    repeated for ``rows`` (beams, returned sequences)."""
    held = cache.get_seq_length()
    if held > columns:
        cache.crop(columns - held)  # a negative count: the tokens to remove (every supported transformers)
    if cache.layers[0].keys.shape[0] != 1:
        cache.batch_select_indices(torch.tensor([0]))
    if rows > 1:
        cache.batch_repeat_interleave(rows)
    return cache


def _play(chat: Chat) -> int:
    """Play ``chat`` with a store and with the continued DynamicCache; return the tokens reused."""
    model = _model(chat.arch, chat.dtype)
    store = PrefixStore(model.config, cache_config={"page_bytes": chat.page_bytes} if chat.page_bytes else None)
    g = torch.Generator().manual_seed(500 + chat.seed)
    history = _rand(chat.system, g)
    ref_cache: DynamicCache | None = None
    prompt_before = 0
    reused = 0
    for turn in range(chat.turns):
        history = history + _rand(4 + (turn + chat.seed) % 5, g)
        ids = torch.tensor([history])
        mask = torch.ones_like(ids)
        where = f"{chat.id}, turn {turn + 1}"
        lent = store.longest_prefix(history)
        if ref_cache is not None:
            held = ref_cache.get_seq_length()
            # what the store lends is what the reference holds: the prompt and answer but the answer's
            # last token (greedy, sampling), the prompt alone (beams: the store keeps the prompt)
            expected = prompt_before if chat.mode == "beams" else held
            assert lent == expected, f"{where}: the store lends {lent} tokens, the reference holds {held}"
            ref_cache = _continue(ref_cache, columns=lent, rows=chat.rows)
        else:
            assert lent == 0
        ref = _generate(model, ids, mask, seed=turn, cache=ref_cache, **chat.kwargs())
        got = _generate(model, ids, mask, seed=turn, store=store, **chat.kwargs())
        _assert_identical(ref, got, where)
        report = reuse_report(got)
        assert report is not None and report.refusal is None, report
        assert report.start_column == lent and report.reused_tokens == lent * chat.rows, report
        if turn:
            assert lent > 0, f"{where} reused nothing"
        reused += report.reused_tokens
        ref_cache = ref.past_key_values
        prompt_before = len(history)
        answer = got.sequences[0, len(history):].tolist()
        assert EOS not in answer[:-1], f"{where}: an early end of sequence (the tiny models make it rare)"
        history = history + answer
    store.check_invariants()
    if chat.page_bytes:  # the windows dropped pages: a stored row serves only prefixes whose window it holds
        forks = [store.lookup(list(tokens) + [3]) for tokens in store.prefixes()]
        assert any(fork.min_prefix_length() > 0 for fork in forks), f"{chat.id}: no sliding window dropped a page"
        for fork in forks:
            fork.close()
    return reused


@pytest.mark.parametrize("chat", CHATS, ids=[c.id for c in CHATS])
def test_chat_equals_the_continued_dynamic_cache(chat: Chat) -> None:
    """Every turn of ``chat``: tokens and every step's logits ``torch.equal`` to the previous
    turn's DynamicCache continued, and the store lent exactly the history that cache held."""
    before = torch.get_num_threads()
    torch.set_num_threads(chat.threads)
    try:
        assert _play(chat) > 0
    finally:
        torch.set_num_threads(before)


def test_the_battery_is_broad() -> None:
    assert len(CHATS) >= 20
    assert {c.mode for c in CHATS} == {"greedy", "beams", "sample", "sample_n2"}
    assert {c.num_beams for c in CHATS if c.mode == "beams"} == {2, 3, 4}
    assert {c.turns for c in CHATS} == {2, 3, 4, 5}
    assert {c.dtype for c in CHATS} == {torch.float32, B16} and {c.threads for c in CHATS} == {1, 2}
    assert {c.arch for c in CHATS} == {"llama", "qwen2", "gpt2", "mistral", "gemma3"}


# ------------------------------------------------------------------------------ a document, a batch
def _batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Left-padded ids, their mask and each row's padding."""
    width = max(map(len, rows))
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[PAD] * p + r for p, r in zip(pads, rows)])
    mask = torch.tensor([[0] * p + [1] * len(r) for p, r in zip(pads, rows)])
    return ids, mask, pads


def _document_cache(model: Any, doc: list[int]) -> DynamicCache:
    """The document's K/V in a DynamicCache: one prefill of it, batch 1 (as the store computes it)."""
    ids = torch.tensor([doc])
    out = _generate(model, ids, torch.ones_like(ids), seed=0, cache=DynamicCache(config=model.config), new=1)
    assert out.past_key_values.get_seq_length() == len(doc)
    return out.past_key_values


def _padded(doc_cache: DynamicCache, pads: list[int], column: int) -> DynamicCache:
    """A batch DynamicCache whose row ``r`` holds ``pads[r]`` padding columns (zeros: masked) and
    the document's first ``column - pads[r]`` tokens: the columns vkv's rows start from."""
    layers = []
    for layer in doc_cache.layers:
        pair = []
        for states in (layer.keys, layer.values):
            rows = [torch.cat([states.new_zeros(*states.shape[:2], p, states.shape[3]), states[:, :, :column - p]], 2)
                    for p in pads]
            pair.append(torch.cat(rows))
        layers.append(tuple(pair))
    return DynamicCache(ddp_cache_data=layers)


DOCUMENT_CASES = {
    # name: (arch, dtype, threads, question lengths, how the document gets into the store, generation kwargs)
    "stored-first-padded": ("llama", torch.float32, 1, (3, 9, 5, 12), "stored", {"do_sample": False}),
    "stored-first-padded-bf16-2t": ("llama", B16, 2, (7, 2, 10), "stored", {"do_sample": False}),
    "common-prefix-padded": ("llama", torch.float32, 2, (4, 11, 6), "common", {"do_sample": False}),
    "common-prefix-padded-bf16-sample": ("llama", B16, 1, (5, 8, 3, 6), "common", {"do_sample": True, "top_k": 0}),
    "stored-first-one-length-qwen2": ("qwen2", torch.float32, 1, (6, 6, 6, 6), "stored", {"do_sample": False}),
    "common-prefix-one-length-beams": ("llama", torch.float32, 1, (5, 5), "common", {"do_sample": False,
                                                                                     "num_beams": 3}),
    # sliding windows: questions of one length (a padded batch of such a model steps aside: below)
    "stored-first-one-length-gemma3": ("gemma3", torch.float32, 1, (6, 6, 6), "stored", {"do_sample": False}),
    "stored-first-one-length-gemma3-beams": ("gemma3", torch.float32, 1, (4, 4), "stored",
                                             {"do_sample": False, "num_beams": 3}),
    "common-prefix-one-length-mistral-bf16-sample": ("mistral", B16, 2, (5, 5), "common",
                                                     {"do_sample": True, "top_k": 0}),
}


@pytest.mark.parametrize("name", list(DOCUMENT_CASES))
def test_questions_about_one_document_equal_the_continued_batch(name: str) -> None:
    """One document stored (by a call of its own, or as the batch's common prefix prefilled once),
    then one call with a batch of questions appended to it: tokens and every step's logits
    ``torch.equal`` to a DynamicCache holding the same columns, continued over the batch."""
    arch, dtype, n_threads, lengths, how, kwargs = DOCUMENT_CASES[name]
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        model = _model(arch, dtype)
        g = torch.Generator().manual_seed(len(name))
        doc = _rand(48, g)
        questions = [_rand(n, g) for n in lengths]
        store = PrefixStore(model.config)
        doc_cache = _document_cache(model, doc)
        if how == "stored":
            ids = torch.tensor([doc])
            _generate(model, ids, torch.ones_like(ids), seed=0, store=store, new=1)  # stores the document whole
            assert store.longest_prefix(doc + [3]) == len(doc)
        ids, mask, pads = _batch([doc + q for q in questions])
        got = _generate(model, ids, mask, seed=1, store=store, **kwargs)
        report = reuse_report(got)
        assert report is not None and report.refusal is None, report
        assert report.common_prefix_tokens == (len(doc) if how == "common" else 0)
        column = report.start_column
        assert column == len(doc) + min(pads)  # the longest row's document end
        expand = kwargs.get("num_beams", 1)
        if len(set(lengths)) == 1:  # no padding: the document's cache, one row per question, as a user repeats it
            reference = copy.deepcopy(doc_cache)
            reference.batch_repeat_interleave(len(questions) * expand)
        else:
            reference = _padded(doc_cache, [p for p in pads for _ in range(expand)], column)
        ref = _generate(model, ids, mask, seed=1, cache=reference, **kwargs)
        _assert_identical(ref, got, name)
        assert report.reused_tokens == sum(column - p for p in pads) * expand
        store.check_invariants()
    finally:
        torch.set_num_threads(before)


#: fp32 max |Δlogit| between a batch over one document and each question continued alone (batch 1),
#: measured here up to 5.7e-6 (DynamicCache's batch and vkv's alike): matrix products of other shapes.
PER_QUESTION_FP32_BOUND = 2e-5


def test_per_question_references_differ_by_batching_alone() -> None:
    """Why the document's reference is the batch: a DynamicCache continued per question (batch 1)
    gives the same tokens and logits within :data:`PER_QUESTION_FP32_BOUND` of vkv's batch, and
    exactly the same differences as DynamicCache's own batch (vkv's batch is bit-equal to it)."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(3)
    doc = _rand(48, g)
    questions = [_rand(n, g) for n in (3, 9, 5, 12)]
    store = PrefixStore(model.config)
    doc_cache = _document_cache(model, doc)
    ids, mask, pads = _batch([doc + q for q in questions])
    got = _generate(model, ids, mask, seed=1, store=store)
    batched = _generate(model, ids, mask, seed=1, cache=_padded(doc_cache, pads, reuse_report(got).start_column))
    _assert_identical(batched, got, "the batch")
    worst = 0.0
    for row, (question, pad) in enumerate(zip(questions, pads)):
        one = torch.tensor([doc + question])
        alone = _generate(model, one, torch.ones_like(one), seed=1, cache=copy.deepcopy(doc_cache))
        assert torch.equal(alone.sequences[0], got.sequences[row, pad:])
        for a, b, c in zip(alone.logits, got.logits, batched.logits):
            assert torch.equal(a[0] - b[row], a[0] - c[row])
            worst = max(worst, float((a[0] - b[row]).abs().max()))
    assert worst <= PER_QUESTION_FP32_BOUND


# ------------------------------------------------------------------------------ sliding windows
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_sliding_window_model_reuses_its_beams_and_steps_aside_for_a_padded_batch(arch: str) -> None:
    """A sliding layer keeps only its window's pages: a 3-beam chat reuses its stored prompts (the
    tokens of vkv without a store; the exact reference, a continued DynamicCache, is the beams
    document case above), and a left-padded batch, whose rows would need a stored window copied to
    another offset, runs as without a store and says why."""
    model = tiny(arch)
    store = PrefixStore(model.config)
    g = torch.Generator().manual_seed(40)
    history = _rand(40, g)
    reused = 0
    for turn in range(3):
        ids = torch.tensor([history])
        got = _generate(model, ids, torch.ones_like(ids), seed=turn, store=store, num_beams=3)
        plain = _generate(model, ids, torch.ones_like(ids), seed=turn, num_beams=3, cache_implementation="vkv")
        assert torch.equal(got.sequences, plain.sequences)
        report = reuse_report(got)
        assert report is not None and report.refusal is None, report
        reused += report.reused_tokens
        history = history + got.sequences[0, len(history):].tolist() + _rand(4, g)
    assert reused > 0
    store.check_invariants()
    ids, mask, _ = _batch([history[:20], history[:27]])
    got = _generate(model, ids, mask, seed=0, store=store)
    report = reuse_report(got)
    assert report is not None and "left-padded" in (report.refusal or "") and report.reused_tokens == 0, report
    _assert_identical(_generate(model, ids, mask, seed=0, cache_implementation="vkv"), got, "padded batch")
    store.check_invariants()


def test_a_sliding_group_takes_shared_rows_that_hold_their_window_only() -> None:
    """``take_rows`` into a cache with sliding layers: a row shared from token 0 whose source
    holds the window; a row copied to another offset, or cut shorter than the source's window
    allows, is refused with nothing taken."""
    from hf_vkv.cache import RowSource
    model = tiny("mistral")  # window 8 on every layer; 4 KiB pages hold 64 tokens of a (layer, K/V, head)
    store = PrefixStore(model.config, cache_config={"page_bytes": 4096})
    ids = torch.tensor([_rand(100, torch.Generator().manual_seed(41))])
    out = _generate(model, ids, torch.ones_like(ids), seed=0, store=store, new=20)  # page 0 falls behind the window
    assert reuse_report(out).inserted == 1
    (entry,) = store.prefixes()
    source = store.lookup(list(entry) + [3])
    try:
        shortest = source.min_prefix_length()
        assert shortest == 64 + 8 - 1 < len(entry)  # page 0 is gone: the window of a row from 71 tokens on
        for sources, length, match in (([RowSource(source, offset=2)], len(entry), "cannot copy"),
                                       ([RowSource(source)], shortest - 1, "needs tokens from")):
            into = store.new_cache(batch_size=1)
            with pytest.raises(ValueError, match=match):
                into.take_rows(sources, length=length)
            assert into.get_seq_length() == 0 and into.rows == 0
            into.close()
        into = store.new_cache(batch_size=2)
        into.take_rows([RowSource(source), RowSource(source)], length=shortest)
        assert into.get_seq_length() == shortest and into.rows == 2
        into.close()
    finally:
        source.close()
    store.check_invariants()



def test_a_sliding_window_model_in_the_paged_layout_steps_aside() -> None:
    """Under ``vkv_paged`` a call's rows would copy the stored rows into its block pool, which a
    sliding window's pages do not allow: the call runs as without a store and says why."""
    model = tiny("gemma3", attn="vkv_paged")
    store = PrefixStore(model.config)
    ids = torch.tensor([_rand(60, torch.Generator().manual_seed(42))])
    for turn in range(2):
        got = _generate(model, ids, torch.ones_like(ids), seed=turn, store=store, do_sample=True,
                        num_return_sequences=2)
        report = reuse_report(got)
        assert report is not None and "paged layout" in (report.refusal or "") and report.reused_tokens == 0, report
        plain = _generate(model, ids, torch.ones_like(ids), seed=turn, do_sample=True, num_return_sequences=2,
                          cache_implementation="vkv")
        _assert_identical(plain, got, f"turn {turn + 1}")
        ids = got.sequences[:1]
    assert len(store) == 0

"""Prefill once (``hf_vkv.generate.prefill_once``): generate's prefill runs each repeated prompt once, and
tokens, scores and logits stay DynamicCache's (``torch.equal``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaForCausalLM, pipeline
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_vkv
from hf_vkv.generate import cache_kwarg
from models import SMALL_PAGE, LayoutRun, assert_same_tokens, prompts, tiny, tokenizer, words

pytestmark = [pytest.mark.integration, pytest.mark.threads(1, 2)]

SMALL = {"page_bytes": SMALL_PAGE}
NEW = 6


@contextlib.contextmanager
def prompt_tokens_computed(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the token rows the model embeds in each forward (the first entry is the prefill), by
    wrapping the embedding's ``forward``: a user's forward hook would turn prefill once off (it
    might act per row)."""
    counts: list[int] = []
    embed = model.get_input_embeddings()
    forward = embed.forward

    def counting(input_ids: torch.Tensor, *args, **kwargs):
        counts.append(input_ids.numel())
        return forward(input_ids, *args, **kwargs)

    embed.forward = counting
    try:
        yield counts
    finally:
        del embed.forward


def _both(layout: LayoutRun, model, inputs, **kwargs):
    with prompt_tokens_computed(model) as counts:
        ref, got = layout.generate_both(model, inputs, vkv=SMALL, output_logits=True, **kwargs)
    return ref, got, counts


def _same(ref, got) -> None:
    assert_same_tokens(ref.sequences, got.sequences)
    assert len(ref.logits) == len(got.logits)
    for step, (a, b) in enumerate(zip(ref.logits, got.logits)):
        assert torch.equal(a, b), f"logits differ at step {step}: max |diff| {(a - b).abs().max().item()}"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_sampling_computes_each_prompt_once(layout: LayoutRun, arch: str) -> None:
    inputs = prompts(2, 8, seed=5, left_pad=[0, 3])
    ref, got, counts = _both(layout, tiny(arch), inputs, seed=7, max_new_tokens=NEW, do_sample=True,
                             num_return_sequences=4)
    _same(ref, got)
    # the first forward of each generate is its prefill: 8 rows x 8 tokens for DynamicCache, 2 x 8 for vkv
    dynamic_prefill, vkv_prefill = counts[0], counts[NEW]
    assert (dynamic_prefill, vkv_prefill) == (64, 16)
    stats = got.past_key_values.stats()
    assert (stats.prompt_tokens_computed, stats.prompt_tokens_saved) == (16, 48) and stats.prefill_once.startswith("on")
    assert all(g.shared_prompt_rows == 6 for g in stats.groups)
    got.past_key_values.check_invariants()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_beam_search_scores_and_logits(layout: LayoutRun, arch: str) -> None:
    inputs = prompts(2, 8, seed=3, left_pad=[0, 2])
    ref, got, counts = _both(layout, tiny(arch), inputs, max_new_tokens=NEW, num_beams=4, num_return_sequences=2,
                             do_sample=False, output_scores=True)
    _same(ref, got)
    assert torch.equal(ref.sequences_scores, got.sequences_scores)
    assert got.past_key_values.stats().prompt_tokens_saved == 2 * 3 * 8
    got.past_key_values.check_invariants()


def test_hidden_states_and_attentions_are_expanded() -> None:
    model = tiny("llama", attn="eager")
    inputs = prompts(2, 8, seed=1, left_pad=[2, 0])
    ref, got, _ = _both(LayoutRun("head_major"), model, inputs, max_new_tokens=3, do_sample=True,
                        num_return_sequences=3, output_hidden_states=True, output_attentions=True)
    _same(ref, got)
    for name in ("hidden_states", "attentions"):
        for step_ref, step_got in zip(getattr(ref, name), getattr(got, name)):
            for a, b in zip(step_ref, step_got):
                assert a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("length", [5, 7, 11])
@pytest.mark.parametrize("mode", ["beams", "sample"])
def test_one_prompt_of_one_key_head_under_eager_attention(length: int, mode: str) -> None:
    """Eager attention over one key/value head (``repeat_kv`` views one prompt's keys as
    ``[1, H, T, D]`` strides ``(0, 0, D, 1)``; DynamicCache's rows get ``(T*D, 0, D, 1)``): the
    prompt once on one row gives DynamicCache's logits (torch's matmul takes one ``mm`` for a
    batch whose every stride is 0, ``bmm`` for rows that follow one another: 4.8e-7 apart at 7 and
    11 tokens when the proofs expanded that one row as a broadcast)."""
    model = tiny("llama", attn="eager", kv_heads=1)
    options = dict(num_beams=2, do_sample=False) if mode == "beams" else dict(do_sample=True, num_return_sequences=2,
                                                                               seed=3)
    ref, got, counts = _both(LayoutRun("head_major"), model, prompts(1, length, seed=length), max_new_tokens=3,
                             **options)
    _same(ref, got)
    if torch.get_num_threads() == 1:  # at two threads a short prompt's repeats may differ (then every row prefills)
        assert counts[3] == length and got.past_key_values.stats().prefill_once.startswith("on")


def test_threads_sharing_one_model_prefill_their_own_calls() -> None:
    """Threads calling ``generate`` on one model at once (a web app's workers): prefill once's hooks
    sit on the shared base model, so another thread's forward ran them (its rows repeated by this
    call's count, this call's mode left from that thread): raw ``RuntimeError``s from transformers'
    loop. Each call's hooks now act on its own thread's forwards: greedy and beam calls give what
    they give alone, sampling calls run, every call's cache checks."""
    model = tiny("llama")
    inputs = prompts(1, 24, seed=11)
    kinds = [dict(do_sample=False), dict(do_sample=True, num_return_sequences=2), dict(num_beams=2, do_sample=False),
             dict(do_sample=True, num_return_sequences=3)]
    alone = {i: model.generate(**inputs, max_new_tokens=4, **kw) for i, kw in enumerate(kinds) if not kw["do_sample"]}
    failures: list[str] = []

    def worker(i: int) -> None:
        for _ in range(8):
            try:
                out = model.generate(**inputs, max_new_tokens=4, cache_implementation="vkv", return_dict_in_generate=True,
                                     **kinds[i])
                cache = out[cache_kwarg()]
                cache.check_invariants()
            except Exception as exc:  # noqa: BLE001 - reported below with the thread's options
                failures.append(f"{kinds[i]}: {type(exc).__name__}: {exc}")
                return
            if i in alone and not torch.equal(out.sequences, alone[i]):
                failures.append(f"{kinds[i]}: {out.sequences.tolist()} != {alone[i].tolist()} alone")
                return
            if out.sequences.shape[0] != max(kinds[i].get("num_return_sequences", 1), 1):
                failures.append(f"{kinds[i]}: {out.sequences.shape[0]} rows")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(kinds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not failures, failures


@pytest.mark.parametrize("arch", ["fsmt", "prophetnet"])
@pytest.mark.parametrize(("batch", "options"), [
    (2, dict(num_beams=2, num_return_sequences=2)), (2, dict(do_sample=True, num_return_sequences=2)),
    (2, dict(do_sample=True, num_beams=2)), (1, dict(num_beams=2)), (1, dict(do_sample=True, num_return_sequences=4)),
])
def test_sequence_first_layers_and_heads_of_other_outputs(arch: str, batch: int, options: dict) -> None:
    """Two premises of prefill once, broken by real models: FSMT's layers run ``[T, B, C]``
    (sequence first: the encoder's states transposed, dim 0 their tokens), which the expansion
    repeated as if dim 0 held rows, in place over its own memory (logits 0.1 off, tokens too with
    beam sampling); ProphetNet's head reads the decoder's n-gram streams, not its last hidden state,
    so the head ran on one row per prompt (logits 6e-8 off). Unpadded prompts, as a user sends one."""
    import breadth_models

    model = breadth_models.tiny(arch)
    ids = torch.randint(3, breadth_models.VOCAB, (batch, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def run(**extra):
        torch.manual_seed(0)
        return model.generate(**inputs, max_new_tokens=6, return_dict_in_generate=True, output_logits=True, **options,
                              **extra)

    ref, got = run(), run(cache_implementation="vkv")
    _same(ref, got)
    assert isinstance(got.past_key_values.self_attention_cache, hf_vkv.VKVCache)


def test_chunked_prefill_runs_once_per_prompt() -> None:
    inputs = prompts(2, 12, seed=2, left_pad=[0, 1])
    ref, got, counts = _both(LayoutRun("head_major"), tiny("llama"), inputs, max_new_tokens=NEW, num_beams=3,
                             do_sample=False, prefill_chunk_size=5)
    _same(ref, got)
    assert got.past_key_values.stats().prompt_tokens_saved == 2 * 2 * 12
    # DynamicCache embeds 6 rows in chunks of 5, 5, 2 tokens; vkv 2 rows
    assert counts[:3] == [30, 30, 12] and counts[3 + NEW - 1:3 + NEW + 2] == [10, 10, 4]


def test_static_layout_prefills_once() -> None:
    inputs = prompts(2, 8, seed=4)
    model = tiny("llama")
    kwargs = dict(max_new_tokens=NEW, num_beams=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(**inputs, cache_implementation="static", **kwargs)  # attention over the whole capacity
    with prompt_tokens_computed(model) as counts:
        static = model.generate(**inputs, cache_implementation="vkv", cache_config={"layout": "static", **SMALL},
                                **kwargs)
    _same(ref, static)
    assert counts[0] == 16 and static.past_key_values.stats().prefill_once.startswith("on")


def test_pipeline_num_return_sequences() -> None:
    model, tok = tiny("llama"), tokenizer()
    text = words(prompts(1, 10, seed=9)["input_ids"][0])
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    kwargs = dict(max_new_tokens=NEW, do_sample=True, num_return_sequences=4, return_full_text=False)
    torch.manual_seed(3)
    ref = pipe(text, **kwargs)
    with prompt_tokens_computed(model) as counts:
        torch.manual_seed(3)
        got = pipe(text, cache_implementation="vkv", **kwargs)
    assert [r["generated_text"] for r in ref] == [g["generated_text"] for g in got]
    assert counts[0] == 10  # one row of 10 tokens, not 4


def test_fallbacks_are_visible_and_exact() -> None:
    model = tiny("llama")
    # rows that differ inside a repeated prompt: the caller built the cache, generate did not expand
    cache = hf_vkv.VKVCache(model.config, batch_size=4, prompt_repeats=2, page_bytes=SMALL_PAGE)
    ids = prompts(4, 6, seed=8)
    ref = model.generate(**ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    got = model.generate(**ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True,
                         **{cache_kwarg(): cache})
    _same(ref, got)
    stats = cache.stats()
    assert stats.prefill_once == "the rows of 'input_ids' differ within a repeated prompt"
    assert (stats.prompt_tokens_computed, stats.prompt_tokens_saved) == (24, 0)
    # a forward of 2 token rows: served (its calls probed) unless DynamicCache's own repeats differ; and switched off
    one = prompts(1, 2, seed=8)
    for config in ({}, {"prefill_once": False}):
        ref, got = LayoutRun("head_major").generate_both(model, one, vkv={**SMALL, **config}, max_new_tokens=3,
                                                         num_beams=2, do_sample=False, output_logits=True)
        _same(ref, got)
        said = got.past_key_values.stats().prefill_once
        if config:
            assert said.startswith("cache_config sets") and got.past_key_values.stats().prompt_tokens_saved == 0
        else:
            assert said.startswith("on") or "repeats differently from each other" in said, said


def test_inputs_embeds_prefill_once() -> None:
    model = tiny("llama")
    ids = prompts(2, 8, seed=6)
    embeds = model.get_input_embeddings()(ids["input_ids"]).detach()
    kwargs = dict(inputs_embeds=embeds, attention_mask=ids["attention_mask"], max_new_tokens=4, num_beams=2,
                  do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(**kwargs)
    got = model.generate(**kwargs, cache_implementation="vkv", cache_config=SMALL)
    _same(ref, got)
    assert got.past_key_values.stats().prompt_tokens_saved == 2 * 8


class _WholeStateLlama(LlamaForCausalLM):
    """A Llama whose forward reads its base model's whole last hidden state before its head slices
    it (a scale: per element, so it is exact on any number of rows)."""

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state * 0.5
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, keep, :]), past_key_values=out.past_key_values)


@pytest.mark.parametrize("whole", [False, True], ids=["head-slices", "whole-state-read"])
def test_the_head_gets_only_the_positions_it_keeps(whole: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base model's output is repeated for the head only at the positions ``logits_to_keep``
    keeps (one a row: ~1.2 GB less to write at 8,000 tokens x 64 rows); a model that reads more of
    it gets the rest written first, so its tokens and logits are DynamicCache's either way."""
    from hf_vkv.generate.head_rows import RepeatedRows

    model = tiny("llama")
    if whole:
        model = _WholeStateLlama(model.config).eval()
        model.load_state_dict(tiny("llama").state_dict())
    fills = []
    fill = RepeatedRows.fill
    monkeypatch.setattr(RepeatedRows, "fill", lambda self: (fills.append(self.first), fill(self))[1])
    ref, got, counts = _both(LayoutRun("head_major"), model, prompts(2, 8, seed=5, left_pad=[0, 3]), seed=7,
                             max_new_tokens=NEW, do_sample=True, num_return_sequences=4)
    _same(ref, got)
    assert counts[NEW] == 16 and got.past_key_values.stats().prefill_once.startswith("on")
    assert fills == ([7] if whole else [])  # 7 of 8 positions written only where the model read them


def _noise(module, args, out):  # a user's hook that draws random numbers (the test module is no library's)
    return out + 0.1 * torch.randn_like(out)


def _per_row(module, args, out):  # a user's hook that acts on each row of the batch
    hidden = out[0] if isinstance(out, tuple) else out
    scaled = hidden * (1 + 0.1 * torch.arange(1, hidden.shape[0] + 1, dtype=hidden.dtype).view(-1, 1, 1))
    return (scaled, *out[1:]) if isinstance(out, tuple) else scaled


@pytest.mark.parametrize("case", ["a layer in training mode", "the base model in training mode", "a noise hook",
                                  "a per-row hook", "a pre-hook on the model"])
@pytest.mark.parametrize("mode", [dict(num_beams=3, do_sample=False),
                                  dict(do_sample=True, num_return_sequences=4, top_k=0)])
def test_a_model_whose_rows_a_module_tells_apart_prefills_every_row(case: str, mode: dict) -> None:
    """Prefill once checked ``model.training`` only, and knew nothing of hooks: with dropout active
    in a submodule (the model itself in eval mode), or a user's forward hook that draws random
    numbers or acts per row, the prompt's forward on one row per prompt gave other tokens and
    logits than DynamicCache's (max |dlogit| 0.03-0.9), silently. Such a model prefills every row now,
    and stats() says why."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny("llama").config.__class__(**{**tiny("llama").config.to_dict(),
                                                                "attention_dropout": 0.1})).eval()
    handles = []
    if case == "a layer in training mode":
        model.model.layers[0].self_attn.train()
    elif case == "the base model in training mode":
        model.model.train()
    elif case == "a noise hook":
        handles.append(model.model.embed_tokens.register_forward_hook(_noise))
    elif case == "a per-row hook":
        handles.append(model.model.layers[0].register_forward_hook(_per_row))
    else:
        handles.append(model.register_forward_pre_hook(
            lambda m, args, kwargs: (args, {**kwargs, "input_ids": kwargs["input_ids"] % 7 + torch.randint_like(
                kwargs["input_ids"], 0, 3)}) if kwargs.get("input_ids") is not None else None, with_kwargs=True))
    ids = prompts(1, 9, seed=3)
    kwargs = dict(max_new_tokens=4, return_dict_in_generate=True, output_logits=True, pad_token_id=0, **mode)
    torch.manual_seed(5)
    ref = model.generate(**ids, **kwargs)
    torch.manual_seed(5)
    got = model.generate(**ids, cache_implementation="vkv", **kwargs)
    _same(ref, got)
    said = got[cache_kwarg()].stats().prefill_once
    assert ("training mode" in said) if "training" in case else said.startswith("forward hooks a user put"), said
    for handle in handles:
        handle.remove()

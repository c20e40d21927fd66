"""Tiny random-initialized models (and a tokenizer) for the cache's integration tests.

Every model is float32 on the CPU, built from a config (no download), with ``lm_head`` scaled up
so argmax and beam decisions are far from ties: a token-level mismatch against ``DynamicCache``
then means different K/V, not float noise. Models are built once per process (``functools.cache``)
and are in ``eval()`` mode; do not modify them in tests.

Architectures (what each one exercises):

* ``llama``: GQA (4 query heads, 2 KV heads), full attention only;
* ``qwen2``: GQA with attention biases;
* ``mistral``: every layer sliding with a window of 8 (exceeded by every generation here);
* ``gemma3``: mixed layers (sliding, sliding, full) with a window of 6, so two layer groups;
* ``gpt2``: fused QKV, learned positions, multi-head (no GQA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer, LinearAttentionLayer  # noqa: E402

import hf_vkv  # noqa: E402,F401  (registers "vkv")

VOCAB = 512
PAD, EOS, BOS = 0, 1, 2
FIRST_WORD = 3  # ids below are special tokens
LOGIT_SCALE = 20.0
MISTRAL_WINDOW = 8
GEMMA3_WINDOW = 6
#: A small page for the tiny models, so a generation crosses many page boundaries (a llama
#: token of both layers is 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes: 8 tokens a page).
SMALL_PAGE = 4096

ARCHS = ("llama", "qwen2", "mistral", "gemma3", "gpt2")

_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)


def _finish(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    model.eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(LOGIT_SCALE)
        head[EOS].mul_(1 / LOGIT_SCALE**2)  # EOS rare: generations run their full length
    model.generation_config = GenerationConfig(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    return model


def _seeded(seed: int, build: Callable[[], PreTrainedModel]) -> PreTrainedModel:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return _finish(build(), seed)
    finally:
        torch.random.set_rng_state(state)


def _attn(config: Any, attn: str) -> Any:
    config._attn_implementation = attn
    return config


@functools.cache
def tiny(arch: str, *, attn: str = "sdpa", layers: int | None = None, seed: int = 0,
         kv_heads: int | None = None) -> PreTrainedModel:
    """The tiny ``arch`` model (see the module docstring); ``layers`` overrides its depth,
    ``kv_heads`` a Llama's key/value heads (4: one per query head, MHA; default 2, GQA)."""
    if kv_heads is not None and arch != "llama":
        raise ValueError("kv_heads is a Llama option here")
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2, num_attention_heads=4,
                          num_key_value_heads=kv_heads or 2, max_position_embeddings=256, **_COMMON)
        return _seeded(seed, lambda: LlamaForCausalLM(_attn(cfg, attn)))
    if arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, **_COMMON)
        return _seeded(seed, lambda: Qwen2ForCausalLM(_attn(cfg, attn)))
    if arch == "mistral":
        cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            sliding_window=MISTRAL_WINDOW, **_COMMON)
        return _seeded(seed, lambda: MistralForCausalLM(_attn(cfg, attn)))
    if arch == "gemma3":
        n = layers or 3
        types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n)]
        cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=n, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                               sliding_window=GEMMA3_WINDOW, layer_types=types, query_pre_attn_scalar=16,
                               **_COMMON)
        return _seeded(seed, lambda: Gemma3ForCausalLM(_attn(cfg, attn)))
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=layers or 2, n_head=4, n_positions=256, n_inner=128,
                         **_COMMON)
        return _seeded(seed, lambda: GPT2LMHeadModel(_attn(cfg, attn)))
    raise ValueError(f"unknown architecture {arch!r}; known: {ARCHS}")


def assistant(arch: str) -> PreTrainedModel:
    """A one-layer model of the same architecture and vocabulary (for assisted decoding)."""
    return tiny(arch, layers=1, seed=1)


@functools.cache
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary: word ``w<i>`` is id ``i``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"<pad>": PAD, "</s>": EOS, "<s>": BOS, **{f"w{i}": i for i in range(FIRST_WORD, VOCAB)}}
    core = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    from tokenizers import decoders

    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   padding_side="left")


def prompts(batch: int, length: int, *, seed: int = 0, left_pad: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Random prompt ids ``[batch, length]`` and their attention mask; row ``i`` is left-padded
    with ``left_pad[i]`` pad tokens (its prompt is that much shorter)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_WORD, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(left_pad or []):
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def words(ids: torch.Tensor) -> str:
    """A prompt string for :func:`tokenizer` from ids."""
    return " ".join(f"w{int(i)}" for i in ids)


#: The VKV layouts the A/B suites run every case in (the conftest ``layout`` fixture).
LAYOUTS = ("token_major", "head_major", "paged")
#: Tokens per block of the paged layout in tests: small, so generations cross many blocks.
PAGED_BLOCK_TOKENS = 4


@dataclasses.dataclass(frozen=True)
class LayoutRun:
    """The VKV layout one test runs in, and the A/B helpers that run it (the conftest ``layout``
    fixture gives one per layout; ``LayoutRun()`` is the default, token-major)."""

    name: str = "token_major"

    def config(self) -> dict[str, Any]:
        """The ``cache_config`` that selects this layout (paged: chosen by the ``"vkv_paged"``
        attention, so an assistant model with its own attention gets the device default; small blocks)."""
        if self.name == "paged":
            return {"block_tokens": PAGED_BLOCK_TOKENS}
        return {"layout": self.name}

    @contextlib.contextmanager
    def attention(self, model: PreTrainedModel) -> Iterator[None]:
        """The model's attention for a VKV run of this layout: ``"vkv_paged"`` for the paged layout
        (a ``VKVCache`` made meanwhile is paged), the model's own otherwise."""
        if self.name != "paged":
            yield
            return
        before = model.config._attn_implementation
        model.set_attn_implementation("vkv_paged")
        try:
            yield
        finally:
            model.set_attn_implementation(before)

    def generate_both(self, model: PreTrainedModel, inputs: dict[str, torch.Tensor], *, seed: int = 0,
                      vkv: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Any, Any]:
        """``generate`` with ``DynamicCache`` (the model's own attention) and with
        ``cache_implementation="vkv"`` (``vkv`` is the ``cache_config``) in this layout, the same
        seed before each; returns both outputs (``return_dict_in_generate``)."""
        vkv = {**self.config(), **(vkv or {})}
        # the reference passes no cache_implementation: the default is DynamicCache (and an explicit
        # "dynamic" breaks assisted decoding in transformers itself: the assistant inherits it)
        torch.manual_seed(seed)
        ref = model.generate(**inputs, return_dict_in_generate=True, **kwargs)
        with self.attention(model):
            torch.manual_seed(seed)
            got = model.generate(**inputs, return_dict_in_generate=True, cache_implementation="vkv",
                                 cache_config=vkv, **kwargs)
        assert isinstance(ref.past_key_values, DynamicCache)
        assert isinstance(got.past_key_values, hf_vkv.VKVCache)
        assert got.past_key_values.layout == self.name
        return ref, got


def generate_both(model: PreTrainedModel, inputs: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Any, Any]:
    """:meth:`LayoutRun.generate_both` in the default (token-major) layout."""
    return LayoutRun().generate_both(model, inputs, **kwargs)


def assert_same_tokens(expected: torch.Tensor, got: torch.Tensor) -> None:
    """Token identity, with the first differing position in the message."""
    assert expected.shape == got.shape, f"shapes differ: {tuple(expected.shape)} vs {tuple(got.shape)}"
    if not torch.equal(expected, got):
        where = (expected != got).nonzero()[0].tolist()
        raise AssertionError(f"tokens differ first at {where}:\n{expected}\n{got}")


def _dynamic_sliding_layer_rolls_back() -> bool:
    """Whether transformers' own sliding-window layer works while recording its past (assisted
    decoding): transformers 5.17 returns every recorded token from ``update`` while
    ``get_mask_sizes`` advertises the window, so the DynamicCache reference itself fails."""
    layer = DynamicSlidingWindowLayer(sliding_window=3)
    layer.activate_past_recording()
    states = torch.zeros(1, 1, 4, 2)
    layer.update(states, states)
    kv_length, _ = layer.get_mask_sizes(1)
    keys, _ = layer.update(states[:, :, :1], states[:, :, :1])
    return keys.shape[2] == kv_length


#: Skip marker for recording (assisted-decoding) sliding-window cases the reference cannot run.
needs_sliding_rollback = pytest.mark.skipif(
    not _dynamic_sliding_layer_rolls_back(),
    reason="this transformers' DynamicSlidingWindowLayer returns more K/V than its mask covers while recording "
           "its past (fixed after 5.17): the DynamicCache reference fails, there is nothing to compare with",
)


def assistant_keeps_cache_implementation() -> bool:
    """Whether transformers' assistant inherits ``cache_implementation`` (5.17-5.23: with "vkv" its
    cache is a VKVCache); 5.24's candidate generator clears it and builds the assistant's cache itself."""
    import inspect

    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    return "cache_implementation = None" not in inspect.getsource(AssistedCandidateGenerator.__init__)


#: A chat template for :func:`tokenizer`'s word vocabulary: messages joined, then ``w7``.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w7 {% endif %}"


def save_chat_model(path: Any) -> Any:
    """Save the tiny llama and :func:`tokenizer` with :data:`CHAT_TEMPLATE` into ``path`` (a folder
    ``hf-vkv --model`` loads); return ``path``."""
    import copy

    tiny("llama").save_pretrained(path)
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


#: Whether this transformers records a recurrent state's past while recording (5.25 and later:
#: ``activate_past_recording(recurrent_states_to_keep=...)``), so that a crop can restore it and
#: speculative decoding runs on recurrent and hybrid models.
RECORDS_RECURRENT = "recurrent_states_to_keep" in inspect.signature(
    LinearAttentionLayer.activate_past_recording).parameters

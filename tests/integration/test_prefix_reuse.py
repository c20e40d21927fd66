"""Prefix reuse inside generate(): ``cache_config={"prefix_store": store}``.

Here the reference is DynamicCache's full prefill of every call's whole prompt: prefilling only
the new tokens over stored K/V is a different computation (the stored answers' K/V come from
decode steps), so against it the tokens must be the very same on multi-turn chats (greedy, beams,
seeded sampling) and reuse must really have happened (tokens reused > 0). The contract itself —
identical logits to a DynamicCache holding the same history, continued — is
``tests/integration/test_reuse_contract.py``; files and stores are tested here too.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from models import EOS, PAD, assert_same_tokens, save_chat_model, tiny, tokenizer, words

import hf_vkv
from hf_vkv import KVCacheOutOfMemory, PrefixFileError, PrefixStore, VKVCache
from hf_vkv.devices import MIN_COMMON_PREFIX
from hf_vkv.generate import cache_kwarg
from hf_vkv.prefix.store import STORE_INDEX
from hf_vkv import ReuseReport, reuse_report

pytestmark = pytest.mark.integration

NEW = 6  # tokens generated per turn


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, store: PrefixStore | None, *, seed: int = 0,
              **kwargs: Any) -> torch.Tensor:
    torch.manual_seed(seed)
    extra = {"cache_implementation": "vkv", "cache_config": {"prefix_store": store}} if store is not None else {}
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD, **kwargs, **extra)


def _reuse(model: Any, ids: torch.Tensor, mask: torch.Tensor, store: PrefixStore, *, seed: int = 0,
           **kwargs: Any) -> tuple[torch.Tensor, ReuseReport]:
    """A call with ``store``: its sequences and what it reused (read from the cache it returned)."""
    out = _generate(model, ids, mask, store, seed=seed, return_dict_in_generate=True, **kwargs)
    report = reuse_report(out)
    assert report is not None
    return out.sequences, report


def _batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask."""
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


MODES = {
    "greedy": {"do_sample": False},
    "beams": {"do_sample": False, "num_beams": 3},
    "sample": {"do_sample": True, "top_k": 0},
    "sample_n2": {"do_sample": True, "top_k": 0, "num_return_sequences": 2},
}


def _chat(model: Any, store: PrefixStore, *, conversation: int, mode: str, turns: int = 4) -> int:
    """One multi-turn chat: each turn appends the answer (row 0) and a new user message; every
    turn's tokens must equal DynamicCache's full prefill. Returns the tokens reused."""
    g = torch.Generator().manual_seed(1000 + conversation)
    history = _rand(24, g)  # a system prompt
    reused = 0
    for turn in range(turns):
        history = history + _rand(5 + turn, g)
        ids, mask = _batch([history])
        want = _generate(model, ids, mask, None, seed=turn, **MODES[mode])
        got, report = _reuse(model, ids, mask, store, seed=turn, **MODES[mode])
        assert_same_tokens(want, got)
        assert report.refusal is None, report
        if turn:
            assert report.reused_tokens > 0, f"turn {turn} of chat {conversation} reused nothing: {report}"
        reused += report.reused_tokens
        store.check_invariants()
        answer = got[0, ids.shape[1]:].tolist()
        if EOS in answer:
            answer = answer[:answer.index(EOS) + 1]
        history = history + answer
    return reused


@pytest.mark.parametrize("mode", list(MODES))
def test_chat_battery_same_tokens_as_full_prefill(mode: str) -> None:
    """Five 4-turn chats per mode (20 conversations over the four modes), one store for all."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    total = sum(_chat(model, store, conversation=c + 10 * list(MODES).index(mode), mode=mode) for c in range(5))
    assert total > 0
    stats = store.stats()
    assert stats.hits > 0 and stats.tokens_reused > 0 and stats.prompt_tokens_computed < stats.prompt_tokens


def test_chat_at_two_threads() -> None:
    torch.set_num_threads(2)
    model = tiny("llama")
    store = PrefixStore(model.config)
    for c in range(2):
        assert _chat(model, store, conversation=100 + c, mode="greedy") > 0


def test_batch_with_left_padding_and_different_reused_lengths() -> None:
    """Questions of different lengths about one document: the document is prefilled once (a
    common prefix), padded rows are copied, and a second batch starts from the stored rows."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    g = torch.Generator().manual_seed(7)
    doc = _rand(MIN_COMMON_PREFIX + 40, g)
    questions = [_rand(n, g) for n in (3, 9, 5, 12)]
    ids, mask = _batch([doc + q for q in questions])
    want = _generate(model, ids, mask, None)
    got, report = _reuse(model, ids, mask, store)
    assert_same_tokens(want, got)
    assert report.common_prefix_tokens == len(doc)
    assert report.start_column == len(doc)  # the longest row has no padding: the document's end
    assert report.copied_rows == 3  # the three padded rows
    assert report.computed_tokens == len(doc) + 4 * (ids.shape[1] - len(doc))
    assert report.inserted == 4
    store.check_invariants()
    # the same questions again: each row starts from its own stored row (prompt and answer)
    got2, again = _reuse(model, ids, mask, store)
    assert_same_tokens(want, got2)
    assert again.common_prefix_tokens == 0 and again.start_column == ids.shape[1] - 1
    store.check_invariants()


@pytest.mark.threads(1, 2)
def test_beams_and_samples_compose_with_prefill_once() -> None:
    model = tiny("llama")
    store = PrefixStore(model.config)
    g = torch.Generator().manual_seed(3)
    system = _rand(40, g)
    for kwargs in ({"num_beams": 3, "do_sample": False}, {"num_return_sequences": 3, "do_sample": True}):
        ids, mask = _batch([system + _rand(6, g), system + _rand(4, g)])
        want = _generate(model, ids, mask, None, return_dict_in_generate=True, **kwargs)
        got = _generate(model, ids, mask, store, return_dict_in_generate=True, **kwargs)
        assert_same_tokens(want.sequences, got.sequences)
        assert got.past_key_values.stats().prefill_once.startswith("on")
        report = reuse_report(got)
        assert report.reused_tokens > 0 and report.refusal is None
        store.check_invariants()


def test_no_store_changes_nothing() -> None:
    model = tiny("llama")
    ids, mask = _batch([list(range(3, 30))])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, cache_implementation="vkv",
                         return_dict_in_generate=True)
    assert reuse_report(out) is None and out.past_key_values.stats().reuse is None
    assert out.past_key_values.stats().pool_resident_bytes > 0
    with pytest.raises(ValueError, match="cache_implementation='vkv'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_config={"prefix_store": PrefixStore(model.config)})
    with pytest.raises(TypeError, match="PrefixStore"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="vkv",
                       cache_config={"prefix_store": object()})
    with pytest.raises(ValueError, match="store.lookup"):
        VKVCache(model.config, prefix_store=PrefixStore(model.config))


def test_refusals_run_as_without_a_store() -> None:
    """A left-padded batch of a sliding-window model (a stored window is shared from token 0,
    never copied to a padded row's offset) and a mask that is not left padding: reuse steps
    aside, says why, and the tokens are DynamicCache's."""
    model = tiny("mistral")
    store = PrefixStore(model.config)
    ids, mask = _batch([list(range(3, 40)), list(range(3, 30))])
    got, report = _reuse(model, ids, mask, store)
    assert_same_tokens(_generate(model, ids, mask, None), got)
    assert "sliding-window layers with left-padded rows" in report.refusal and len(store) == 0
    ids, mask = _batch([list(range(3, 40))])
    llama = tiny("llama")
    store = PrefixStore(llama.config)
    mask = torch.ones_like(ids)
    mask[0, 5] = 0
    got, report = _reuse(llama, ids, mask, store)
    assert_same_tokens(_generate(llama, ids, mask, None), got)
    assert report.refusal == "the attention mask is not left padding"
    other = PrefixStore(tiny("qwen2").config)
    assert "another model" in _reuse(llama, ids, torch.ones_like(ids), other)[1].refusal


def test_budget_is_never_exceeded() -> None:
    model = tiny("llama")
    store = PrefixStore(model.config, budget_bytes=96 * 1024)
    g = torch.Generator().manual_seed(5)
    for i in range(8):
        ids, mask = _batch([_rand(30 + 5 * i, g)])
        _generate(model, ids, mask, store)
        assert store.stats().bytes_held <= 96 * 1024
        store.check_invariants()
    assert store.stats().evictions > 0


def test_two_threads_share_one_store() -> None:
    """Two threads chat at once through one store (same system prompt): every answer equals
    DynamicCache's, and the store's and the caches' invariants hold afterwards."""
    model = tiny("llama")
    store = PrefixStore(model.config, budget_bytes=512 * 1024)
    g = torch.Generator().manual_seed(11)
    system = _rand(40, g)
    chats = [[system + _rand(5, g) for _ in range(6)] for _ in range(2)]
    want = [[_generate(model, *_batch([p]), None) for p in chat] for chat in chats]
    errors: list[BaseException] = []
    got: list[list[torch.Tensor]] = [[], []]

    def run(k: int) -> None:
        try:
            for p in chats[k]:
                got[k].append(_generate(model, *_batch([p]), store))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        for w, o in zip(want[k], got[k]):
            assert_same_tokens(w, o)
    store.check_invariants()
    stats = store.stats()
    assert stats.hits > 0 and stats.bytes_held <= 512 * 1024


def test_warm_start_from_files_and_save_back(tmp_path: Path) -> None:
    model = tiny("llama")
    store = PrefixStore(model.config)
    g = torch.Generator().manual_seed(9)
    system = _rand(50, g)
    ids, mask = _batch([system + _rand(4, g)])
    _generate(model, ids, mask, store)
    paths = store.save(tmp_path, model=model)
    assert len(paths) == 1
    warm = PrefixStore(model.config)
    assert warm.load(paths[0], model=model) == ids.shape[1] + NEW - 1
    ids2, mask2 = _batch([system + _rand(6, g)])
    got, report = _reuse(model, ids2, mask2, warm)
    assert_same_tokens(_generate(model, ids2, mask2, None), got)
    assert report.reused_tokens == len(system)
    assert warm.save(tmp_path, model=model)[0] in [*paths, *tmp_path.iterdir()]
    warm.check_invariants()
    # a corrupted file is refused and inserts nothing
    data = bytearray(paths[0].read_bytes())
    data[-10] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    fresh = PrefixStore(model.config)
    with pytest.raises(PrefixFileError):
        fresh.load(bad, model=model)
    assert len(fresh) == 0
    fresh.check_invariants()


def _kv(cache: VKVCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def test_store_folder_round_trip(tmp_path: Path) -> None:
    """``store.save(folder)`` writes what ``store.load(folder)`` reads back (it used to raise a raw
    ``IsADirectoryError``): the same entries in the same order, the same K/V, the weights
    fingerprint; generate with the loaded store gives the original store's tokens, reusing as
    much. A folder with one damaged file inserts nothing."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    g = torch.Generator().manual_seed(21)
    system = _rand(40, g)
    chats = [system + _rand(5, g), _rand(30, g), system + _rand(7, g)]
    for prompt in chats:
        _generate(model, *_batch([prompt]), store)
    assert len(store) == 3
    folder = tmp_path / "prefixes"
    paths = store.save(folder)  # no model=: the files carry the store's weights fingerprint
    saved = store.prefixes()
    warm = PrefixStore(model.config)
    assert warm.load(folder, model=model) == sum(map(len, store.prefixes()))
    assert [p.name for p in paths] == ["prefix_store.kv"] and (folder / STORE_INDEX).is_file()  # one mapped file
    assert warm.prefixes() == store.prefixes()  # least recently used first, as saved
    assert warm.weights_fingerprint == store.weights_fingerprint == store.fingerprint(model)
    warm.check_invariants()
    for tokens in store.prefixes():
        a, b = store.lookup([*tokens, 7]), warm.lookup([*tokens, 7])
        assert a.get_seq_length() == b.get_seq_length() == len(tokens)
        assert all(torch.equal(x, y) for x, y in zip(_kv(a), _kv(b)))
        a.close()
        b.close()
    for prompt in (system + _rand(6, g), chats[1] + _rand(4, g), _rand(20, g)):
        ids, mask = _batch([prompt])
        want, want_report = _reuse(model, ids, mask, store)
        got, report = _reuse(model, ids, mask, warm)
        assert_same_tokens(want, got)
        assert report.reused_tokens == want_report.reused_tokens
        assert_same_tokens(_generate(model, ids, mask, None), got)
    assert warm.stats().tokens_reused > 0 and warm.prefixes() == store.prefixes()
    warm.check_invariants()
    # a cut-short page file refuses the folder and inserts nothing
    whole = paths[-1].read_bytes()
    paths[-1].write_bytes(whole[:-3])
    fresh = PrefixStore(model.config)
    with pytest.raises(hf_vkv.PrefixFileCorruptError, match="not whole"):
        fresh.load(folder, model=model)
    assert len(fresh) == 0
    fresh.check_invariants()
    # a flipped bit in a page is refused when its entry is first handed out, before attention
    # reads it: the entries of that file go, and the store serves on (from scratch)
    data = bytearray(whole)
    data[-3] ^= 0x01
    paths[-1].write_bytes(bytes(data))
    assert fresh.load(folder, model=model) == sum(map(len, saved))
    last = list(saved[-1])
    with pytest.raises(hf_vkv.PrefixFileCorruptError, match="not whole"):
        fresh.lookup([*last, 7])
    assert len(fresh) == 0
    fresh.check_invariants()
    ids, mask = _batch([last + [7]])
    assert_same_tokens(_generate(model, ids, mask, None), _reuse(model, ids, mask, fresh)[0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(hf_vkv.PrefixFormatError, match="no hf_vkv prefix"):
        fresh.load(tmp_path / "empty", model=model)


def test_a_saved_store_carries_its_weights_fingerprint(tmp_path: Path) -> None:
    """A store filled by ``generate`` and saved without ``model=``: its files carry the weights
    fingerprint, so opening them for a model with the same config and other weights is refused
    (``PrefixMismatchError``, ``field="weights"``), from a folder or a file, into a new store or
    one holding the other model's entries, ``check_weights=False`` or not."""
    model, other = tiny("llama"), tiny("llama", seed=1)
    g = torch.Generator().manual_seed(22)
    store, other_store = PrefixStore(model.config), PrefixStore(other.config)
    ids, mask = _batch([_rand(30, g)])
    _generate(model, ids, mask, store)
    _generate(other, ids, mask, other_store)
    paths = store.save(tmp_path / "mine")
    theirs = other_store.save(tmp_path / "theirs")
    index = json.loads((tmp_path / "mine" / STORE_INDEX).read_text())
    assert index["weights_fingerprint"] == store.fingerprint(model)
    for source in (tmp_path / "mine", paths[0]):
        for check_weights in (True, False):
            fresh = PrefixStore(other.config)
            with pytest.raises(hf_vkv.PrefixMismatchError, match="other weights") as err:
                fresh.load(source, model=other, check_weights=check_weights)
            assert err.value.field == "weights" and len(fresh) == 0
            fresh.check_invariants()
    for check_weights in (True, False):  # the store's entries are the first model's
        with pytest.raises(hf_vkv.PrefixMismatchError, match="other weights") as err:
            store.load(theirs[0], model=other, check_weights=check_weights)
        assert err.value.field == "weights"
    with pytest.raises(hf_vkv.PrefixMismatchError, match="other weights"):
        store.save(tmp_path / "mislabelled", model=other)
    assert len(store) == 1 and store.weights_fingerprint == store.fingerprint(model)
    store.check_invariants()
    assert PrefixStore(model.config).load(tmp_path / "mine", model=model) == len(store.prefixes()[0])


def _serves_as_before(model: Any, folder: Path, history: list[int], g: torch.Generator) -> None:
    """A folder an older hf_vkv wrote loads for ``model`` and serves ``history`` as before."""
    fresh = PrefixStore(model.config)
    assert fresh.load(folder, model=model) > len(history)
    ids, mask = _batch([history + _rand(4, g)])
    sequences, report = _reuse(model, ids, mask, fresh)
    assert report.reused_tokens >= len(history) and report.refusal is None
    assert_same_tokens(_generate(model, ids, mask, None), sequences)


@pytest.mark.parametrize("earlier", [0, 1], ids=["evenly-spaced-values", "before-buffers"])
def test_a_folder_fingerprinted_by_an_earlier_version_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   earlier: int) -> None:
    """A folder an earlier hf_vkv wrote carries the fingerprint that version took (256 evenly
    spaced values of each tensor, with the buffers or, before buffers were sampled, without
    them): it still loads for its model and serves as before, and is still refused for other
    weights."""
    import hf_vkv.generate.reuse as reuse_module
    import hf_vkv.prefix.store as store_module
    from hf_vkv.prefix.fingerprint import earlier_fingerprints, weights_fingerprint, weights_identity

    model, other = tiny("llama"), tiny("llama", seed=1)
    g = torch.Generator().manual_seed(23)
    history = _rand(30, g)
    with monkeypatch.context() as old_version:
        def identity(m: torch.nn.Module) -> tuple:
            return weights_identity(m, buffers=earlier == 0, blocks=256)
        old_version.setattr(store_module, "weights_fingerprint", lambda m: identity(m)[0])
        old_version.setattr(reuse_module, "weights_identity", identity)
        store = PrefixStore(model.config)
        _generate(model, *_batch([history]), store)
        store.save(tmp_path / "old")
    saved = json.loads((tmp_path / "old" / STORE_INDEX).read_text())["weights_fingerprint"]
    assert saved == earlier_fingerprints(model)[earlier] != weights_fingerprint(model)
    _serves_as_before(model, tmp_path / "old", history, g)
    with pytest.raises(hf_vkv.PrefixMismatchError, match="other weights"):
        PrefixStore(other.config).load(tmp_path / "old", model=other)


def _moe_pair() -> tuple[Any, Any]:
    """A tiny Mixtral and the same weights built with ``num_experts_per_tok=1`` (what
    ``from_pretrained(path, num_experts_per_tok=1)`` makes): a field outside the config's list
    of attention and residual fields, which changes every hidden state."""
    import copy

    import breadth_models

    model = copy.deepcopy(breadth_models.tiny("mixtral"))
    config = copy.deepcopy(model.config)
    config.num_experts_per_tok = 1
    fewer = type(model)(config).eval()
    fewer.load_state_dict(model.state_dict())
    fewer.generation_config.pad_token_id = PAD
    return model, fewer


def test_a_model_built_with_another_config_value_is_another_model(tmp_path: Path) -> None:
    """Same weights, one config field apart (``num_experts_per_tok``): the store of one steps
    aside for the other, naming the field, and a folder or a prefix file saved by one is refused
    for the other (``PrefixMismatchError``, ``field="config"``); each model reuses its own."""
    from hf_vkv.prefix.fingerprint import weights_fingerprint

    model, fewer = _moe_pair()
    assert weights_fingerprint(model) == weights_fingerprint(fewer)
    g = torch.Generator().manual_seed(31)
    history = torch.randint(3, 128, (24,), generator=g).tolist()
    ids, mask = _batch([history])
    store = PrefixStore(model.config)
    out = _generate(model, ids, mask, store, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values  # "cache" from transformers 5.24
    turn, turn_mask = _batch([history + torch.randint(3, 128, (5,), generator=g).tolist()])
    sequences, report = _reuse(fewer, turn, turn_mask, store)
    assert report.refusal is not None and "num_experts_per_tok" in report.refusal and report.reused_tokens == 0
    assert_same_tokens(_generate(fewer, turn, turn_mask, None), sequences)
    store.save(tmp_path / "folder")
    path = hf_vkv.save_prefix(tmp_path / "p.safetensors", cache, out.sequences[0, :cache.get_seq_length()].tolist(),
                              model=model)
    for source in (tmp_path / "folder", path):
        fresh = PrefixStore(fewer.config)
        with pytest.raises(hf_vkv.PrefixMismatchError, match="num_experts_per_tok: file 2, model 1") as err:
            fresh.load(source, model=fewer)
        assert err.value.field == "config" and len(fresh) == 0
        fresh.check_invariants()
    with pytest.raises(hf_vkv.PrefixMismatchError, match="num_experts_per_tok"):
        hf_vkv.load_prefix(path, model=fewer)
    own = PrefixStore(model.config)
    assert own.load(tmp_path / "folder", model=model) >= len(history) - 1
    sequences, report = _reuse(model, turn, turn_mask, own)
    assert report.refusal is None and report.reused_tokens > 0
    assert_same_tokens(_generate(model, turn, turn_mask, None), sequences)


def test_a_folder_saved_before_the_other_config_fields_still_loads(tmp_path: Path) -> None:
    """An index written before the config's other fields were fingerprinted (no ``config_rest``,
    a fingerprint of the listed fields alone) still loads for its model and serves as before."""
    import hashlib

    from hf_vkv.prefix.fingerprint import config_fields
    from hf_vkv.prefix.mapped import index_text

    model = tiny("llama")
    g = torch.Generator().manual_seed(32)
    history = _rand(30, g)
    store = PrefixStore(model.config)
    _generate(model, *_batch([history]), store)
    store.save(tmp_path / "old")
    index_path = tmp_path / "old" / STORE_INDEX
    index = json.loads(index_path.read_text())
    index.pop("sha256")
    assert index.pop("config_rest") is not None and index["config_fields"] == config_fields(model.config)
    index["config_fingerprint"] = hashlib.sha256(json.dumps(index["config_fields"], sort_keys=True).encode()).hexdigest()
    index_path.write_text(index_text(index))
    _serves_as_before(model, tmp_path / "old", history, g)


def test_pipeline_with_chat_messages() -> None:
    from transformers import pipeline

    import copy

    model = tiny("llama")
    tok = copy.deepcopy(tokenizer())  # the shared tokenizer keeps no template (test_cli's model has none)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w7 {% endif %}")
    store = PrefixStore(model.config)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    g = torch.Generator().manual_seed(4)
    system = {"role": "system", "content": words(torch.tensor(_rand(40, g)))}
    messages = [system, {"role": "user", "content": words(torch.tensor(_rand(5, g)))}]
    common = {"max_new_tokens": NEW, "do_sample": False}
    first = pipe(messages, cache_implementation="vkv", cache_config={"prefix_store": store}, **common)
    assert first[0]["generated_text"] == pipe(messages, **common)[0]["generated_text"]
    messages = first[0]["generated_text"] + [{"role": "user", "content": words(torch.tensor(_rand(5, g)))}]
    reused = store.stats().tokens_reused
    second = pipe(messages, cache_implementation="vkv", cache_config={"prefix_store": store}, **common)
    assert store.stats().tokens_reused - reused >= 40  # a pipeline returns text: the store counts what it lent
    assert second[0]["generated_text"] == pipe(messages, **common)[0]["generated_text"]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("tiny-llama-chat"))


def _main(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    from hf_vkv import cli

    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:
        code = int(e.code)
    return code, capsys.readouterr().out


def test_cli_chat_prints_each_turns_reuse_beside_dynamic(chat_model_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    system = tmp_path / "system.txt"
    system.write_text(" ".join(f"w{i}" for i in range(10, 70)))
    code, out = _main(capsys, "chat", "--model", chat_model_dir, "--system-file", system, "--message", "w5 w6",
                      "--message", "w8 w9 w11", "--max-new-tokens", "4", "--threads", "1", "--json",
                      tmp_path / "chat.json")
    assert code == 0, out
    assert "turn 1:" in out and "turn 2:" in out and "same tokens: yes" in out and "DynamicCache re-prefill" in out
    import json

    turns = json.loads((tmp_path / "chat.json").read_text())["turns"]
    assert turns[0]["reused_tokens"] == 0 and turns[1]["reused_tokens"] >= 60
    assert turns[1]["computed_tokens"] < 12 and all(t["same_tokens"] for t in turns)


def test_cli_chat_json_to_stdout_is_json_alone_and_its_message_options_conflict(
        chat_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``chat --json -`` printed its turn lines on stdout before the JSON (stdout did not parse):
    they go to stderr, as ``ab``'s, ``demo``'s and ``prefix inspect``'s; ``--message`` beside
    ``--interactive`` was dropped without a word: a usage error."""
    import json

    from hf_vkv import cli

    code = cli.main(["chat", "--model", str(chat_model_dir), "--message", "w5 w6", "--max-new-tokens", "2",
                     "--threads", "1", "--no-compare", "--json", "-"])
    captured = capsys.readouterr()
    assert code == 0 and "turn 1:" in captured.err
    assert json.loads(captured.out)["schema"] == "hf_vkv.chat/1"
    code, out = _main(capsys, "chat", "--model", chat_model_dir, "--message", "w5", "--interactive")
    assert code == 2


def test_cli_ab_reuse_reports_tokens_and_logit_differences(chat_model_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import json

    prompt = " ".join(f"w{i}" for i in range(20, 60))
    code, out = _main(capsys, "ab", "--model", chat_model_dir, "--prompt", prompt, "--reuse", "2",
                      "--max-new-tokens", "4", "--quiet", "--threads", "1", "--json", tmp_path / "ab.json")
    assert code == 0, out
    assert "turn 2:" in out and "tokens identical: True" in out
    turns = json.loads((tmp_path / "ab.json").read_text())["turns"]
    assert turns[0]["prefix_reuse"]["reused_tokens"] == 0 and turns[1]["prefix_reuse"]["reused_tokens"] >= 40
    assert all(t["tokens_identical"] for t in turns)
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")
    from hf_vkv.ab.schema import AB_REPORT_SCHEMA

    for turn in turns:
        jsonschema.validate(turn, AB_REPORT_SCHEMA)
    # --json -: the JSON alone on stdout (the turns' lines and the table on stderr)
    code, out = _main(capsys, "ab", "--model", chat_model_dir, "--prompt", prompt, "--reuse", "2",
                      "--max-new-tokens", "4", "--quiet", "--threads", "1", "--json", "-")
    assert code == 0 and [t["tokens_identical"] for t in json.loads(out)["turns"]] == [True, True], out


#: fp32 max |Δlogit| of a reused prefix against DynamicCache's full prefill that the A/B harness
#: must stay within on the tiny Llama (measured: up to 2.4e-6 at 1 and 2 threads; SmolLM2-135M's
#: logits of 10-20 give up to 1.1e-4, ``benchmarks/results/prefix_reuse_exactness.json``).
FP32_LOGIT_BOUND = 1e-5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["greedy", "beams", "sample"])
def test_run_ab_reports_logits_within_the_fp32_bound(mode: str, threads: int) -> None:
    """Three-turn chats through ``run_ab(..., prefix_store=store, reference="prefill")`` (the full
    prefill as the reference; the default, the continued cache, is bit-exact:
    ``tests/integration/test_reuse_contract.py``): tokens identical, every
    step's max |Δlogit| within :data:`FP32_LOGIT_BOUND` (beams compared beam by beam, none
    unmatched), reuse really happened, and a turn that reuses nothing is bit-equal."""
    from hf_vkv.ab import run_ab

    torch.set_num_threads(threads)
    model = tiny("llama")
    store = PrefixStore(model.config)
    g = torch.Generator().manual_seed(7)
    history = _rand(30, g)
    for turn in range(3):
        history = history + _rand(4, g)
        ids, mask = _batch([history])
        report = run_ab(model, {"input_ids": ids, "attention_mask": mask}, max_new_tokens=NEW, tee=False,
                        prefix_store=store, reference="prefill", pad_token_id=PAD, **MODES[mode])
        assert report.tokens_identical and report.passed, report.first_divergence
        assert report.max_abs_logit_diff <= FP32_LOGIT_BOUND
        if mode == "beams":
            assert all(s.beams_unmatched == 0 for s in report.steps)
        else:
            assert all(s.beams_unmatched is None for s in report.steps)
        if turn == 0:
            assert report.identical and report.prefix_reuse["reused_tokens"] == 0
        else:
            assert report.prefix_reuse["reused_tokens"] > 0
        history = history + list(report.generated_vkv[0])


def test_run_ab_against_a_full_prefill_refuses_the_tee() -> None:
    """Compared with a full prefill (``reference="prefill"``) the prefills differ by design: the tee
    (every layer's K/V at every step) is refused; against the continued cache it is not."""
    from hf_vkv.ab import run_ab

    model = tiny("llama")
    ids, mask = _batch([list(range(3, 30))])
    with pytest.raises(ValueError, match="tee=False"):
        run_ab(model, {"input_ids": ids, "attention_mask": mask}, max_new_tokens=2, prefix_store=PrefixStore(model.config),
               reference="prefill")


@pytest.mark.parametrize("expand", [{"do_sample": True, "num_return_sequences": 2}, {"num_beams": 3}])
def test_rows_from_stored_sliding_windows_that_prefill_once_cannot_keep_run_on_every_row(expand: dict) -> None:
    """Gemma 3n (sliding and full layers; its AltUp ``matmul`` is not rows-first, so prefill once
    gives up on one row per prompt midway): a turn that reused a stored prefix and expanded its
    prompt (sampled sequences, beams) raised ``ArgumentError`` from ``cut_to`` in the middle of the
    call, since a sliding window cannot be cut back to the stored prefix it dropped pages of. Prefill
    once steps aside for rows that start from stored sliding windows now: the turn reuses the
    prefix, prefills on every row, and gives the tokens of the run without a store."""
    import breadth_models

    model = breadth_models.tiny("gemma3n")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(breadth_models.FIRST_WORD, breadth_models.VOCAB, (1, 7), generator=g)
    store = PrefixStore(model.config)
    first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, cache_implementation="vkv",
                           cache_config={"prefix_store": store}, return_dict_in_generate=True)
    turn = torch.cat([first.sequences, torch.randint(breadth_models.FIRST_WORD, breadth_models.VOCAB, (1, 5),
                                                     generator=g)], 1)
    runs = []
    for config in ({}, {"prefix_store": store}):
        torch.manual_seed(0)
        runs.append(model.generate(turn, attention_mask=torch.ones_like(turn), max_new_tokens=8,
                                   cache_implementation="vkv", cache_config=config, return_dict_in_generate=True,
                                   **expand))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    report = reuse_report(runs[1])
    assert report.refusal is None and report.reused_tokens > 0
    assert "sliding-window layers" in runs[1][cache_kwarg()].prefill_counts.verdict
    store.check_invariants()


@pytest.mark.parametrize("continues", [False, True])
def test_a_row_alone_over_the_budget_costs_the_store_none_of_its_entries(continues: bool) -> None:
    """A conversation that outgrew the store's budget emptied the store: its row, alone over the
    budget, was inserted first and evicted last, the least recently used entries going before it
    (a served system prompt among them), and a row that took a short entry over lost that entry
    too. Now the row is dropped as it goes in and the entries held stay; a row that took an entry
    over stores that entry again."""
    model = tiny("llama")
    store = PrefixStore(model.config, budget_bytes=64 * 1024, cache_config={"page_bytes": 4096})
    short = list(range(10, 30))  # 8 sub-rows x one 4 KiB page: 32 KiB
    long = short + list(range(40, 220)) if continues else list(range(300, 500))  # 8 x 4 pages: 128 KiB

    def run(tokens: list[int]) -> ReuseReport:
        ids = torch.tensor([tokens])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                             pad_token_id=PAD, cache_implementation="vkv", cache_config={"prefix_store": store},
                             return_dict_in_generate=True)
        report = reuse_report(out)
        assert report is not None
        return report

    run(short)
    assert store.serves(short)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the over-budget warning, where the store saw the row
        assert run(long).reused_tokens == (len(short) if continues else 0)
    assert store.serves(short) and store.stats().bytes_held <= 64 * 1024
    assert run(short).reused_tokens == len(short) - 1
    store.check_invariants()


@pytest.mark.parametrize("mode", ["greedy", "sample_n2"])
def test_a_prompt_asked_again_is_not_starved_by_its_own_stored_entry(mode: str) -> None:
    """A store whose memory held 1.5x what a call needs: the same prompt asked again failed with
    ``KVCacheOutOfMemory`` every time (a fresh store ran it). The call borrowed the stored entry,
    its writes needed copies of the pages they shared, and the store let no entry go because
    letting that one go freed no page. Now it goes (its pages then the row's alone, written in
    place), and the call reuses it and stores its own history again."""
    model = tiny("llama")
    ids = torch.tensor([_rand(62, torch.Generator().manual_seed(101))])
    mask = torch.ones_like(ids)
    kwargs = dict(MODES[mode], min_new_tokens=NEW)

    def needs(budget: int) -> bool:
        try:
            _generate(model, ids, mask, PrefixStore(model.config, cache_config={"budget_bytes": budget}), **kwargs)
        except KVCacheOutOfMemory:
            return False
        return True

    page = 16 * 1024  # the store's pages on the host
    least = next(n for n in range(1, 256) if needs(n * page))
    store = PrefixStore(model.config, cache_config={"budget_bytes": int(least * 1.5) * page})
    reference = _generate(model, ids, mask, None, **kwargs)
    for turn in range(3):
        out, report = _reuse(model, ids, mask, store, **kwargs)
        assert torch.equal(out, reference)
        rows = kwargs.get("num_return_sequences", 1)
        assert report.reused_tokens == (0 if turn == 0 else rows * (ids.shape[1] - 1))
        store.check_invariants()
    assert store.stats().entries >= 1


def test_rows_the_store_has_no_memory_to_copy_are_not_stored_and_the_call_returns_whole() -> None:
    """A padded batch whose rows the store copies into entries as the call ends: where the store's
    memory had room for the call but not for those copies, the call raised ``KVCacheOutOfMemory``
    after its last step, its output lost (and the error named a budget below the one that failed).
    Now the rows are not stored, with a warning, and the call returns what it computed."""
    model = tiny("llama", layers=4)
    g = torch.Generator().manual_seed(2)
    ids, mask = _batch([_rand(60, g), _rand(55, g)])
    kwargs = dict(do_sample=False, min_new_tokens=NEW)
    reference = _generate(model, ids, mask, None, **kwargs)
    page = 16 * 1024
    outcomes = set()
    for pages in range(8, 80, 4):
        store = PrefixStore(model.config, cache_config={"budget_bytes": pages * page})
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                out = _generate(model, ids, mask, store, **kwargs)
            except KVCacheOutOfMemory:
                outcomes.add("too small for the call")
                continue
        assert torch.equal(out, reference)
        stored = store.stats().entries > 0
        outcomes.add("stored" if stored else "not stored")
        assert stored or any("rows were not stored" in str(w.message) for w in said)
        store.check_invariants()
    assert outcomes == {"too small for the call", "not stored", "stored"}, outcomes

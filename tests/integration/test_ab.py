"""The A/B harness (``hf_vkv.ab``): it finds nothing where there is nothing, and it finds an
injected one-element error at exactly the step, layer and row where it was put.

Tiny random models (``models.py``); every run is a real ``generate()`` with both caches.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import torch
from models import SMALL_PAGE, assert_same_tokens, prompts, tiny

import hf_vkv
from hf_vkv import VKVCache
from hf_vkv.ab import (
    AB_REPORT_SCHEMA,
    SCHEMA_VERSION,
    ABReport,
    format_report,
    paged_attention_available,
    plot_report,
    run_ab,
)
from hf_vkv.ab.probes import kv_bytes_per_token, row_digests

pytestmark = pytest.mark.integration

NEW = 12
SMALL = {"page_bytes": SMALL_PAGE}

CASES = {
    "greedy-llama-padded": ("llama", dict(do_sample=False), dict(left_pad=[0, 4])),
    "beam-llama": ("llama", dict(num_beams=4, num_return_sequences=2, do_sample=False), dict(left_pad=[0, 3])),
    "sample-qwen2": ("qwen2", dict(do_sample=True, num_return_sequences=3, temperature=1.5), dict(left_pad=[2, 0])),
    "greedy-mistral-window": ("mistral", dict(do_sample=False), dict(left_pad=[0, 5])),
    "beam-gemma3-mixed": ("gemma3", dict(num_beams=3, do_sample=False), dict(left_pad=[4, 0])),
}


class OneElementError(VKVCache):
    """A VKV cache that adds 1.0 to one element of one layer's stored keys (or values) at one step:
    the newest token's first head and dim of ``row``, written through the view ``update`` returns
    (which is the cache's own memory in the head-major layout, which it asks for unless told
    otherwise; token-major hands attention copies on the host: the test checks the stored value
    changed)."""

    def __init__(self, config: Any, *, at_step: int, at_layer: int, at_row: int, tensor: str = "keys",
                 **kwargs: Any) -> None:
        kwargs.setdefault("layout", "head_major")
        super().__init__(config, **kwargs)
        self.at = (at_step, at_layer, at_row, tensor)
        self.updates: Counter[int] = Counter()
        self.injected = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        step, layer, row, tensor = self.at
        if self.updates[layer_idx] == step and layer_idx == layer:
            target = keys if tensor == "keys" else values
            before = float(target[row, 0, -1, 0])
            target[row, 0, -1, 0] += 1.0
            stored = getattr(self.layers[layer_idx], tensor)  # a copy read back from the pages
            assert float(stored[row, 0, -1, 0]) == float(target[row, 0, -1, 0]) != before, "fault not stored"
            self.injected = True
        self.updates[layer_idx] += 1
        return keys, values


def faulty(**at: Any) -> Any:
    """A :class:`OneElementError` class with the fault ``at`` built in (``.made`` lists its caches)."""
    made: list[OneElementError] = []

    class Faulty(OneElementError):
        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__(config, **at, **kwargs)
            made.append(self)

    Faulty.made = made  # type: ignore[attr-defined]
    return Faulty


@pytest.mark.parametrize("case", list(CASES))
def test_identical_runs_report_identical_everything(case: str) -> None:
    arch, kwargs, prompt_kwargs = CASES[case]
    model = tiny(arch)
    inputs = prompts(2, 10, seed=51, **prompt_kwargs)
    report = run_ab(model, inputs, max_new_tokens=NEW, cache_config=SMALL, seed=3, **kwargs)

    assert report.identical and report.tokens_identical and report.first_divergence is None
    assert len(report.steps) == NEW and report.dynamic.steps == report.vkv.steps == NEW
    assert report.rows == 2 * max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
    for s in report.steps:
        assert s.tokens_equal is True and s.kv_equal is True and s.max_abs_logit_diff == 0.0
        assert s.rows_differing == () and s.layers_differing == ()
        assert s.kv_bytes_dynamic > 0 and s.kv_bytes_vkv > 0
        assert s.time_dynamic_s > 0 and s.time_vkv_s > 0

    # the harness's prebuilt caches give the tokens of the plain calls a user makes
    torch.manual_seed(3)
    plain = model.generate(**inputs, max_new_tokens=NEW, **kwargs)
    torch.manual_seed(3)
    string = model.generate(**inputs, max_new_tokens=NEW, cache_implementation="vkv", cache_config=SMALL,
                            return_dict_in_generate=True, **kwargs)
    assert_same_tokens(plain[:, 10:], torch.tensor(report.generated_dynamic))
    assert_same_tokens(string.sequences[:, 10:], torch.tensor(report.generated_vkv))
    # ... and the same memory: the last step's resident bytes are what the string-built cache holds
    assert report.vkv.kv_final_bytes == string.past_key_values.stats().resident_bytes


def test_kv_bytes_per_step_are_exact_for_dynamic_cache() -> None:
    """Greedy on llama (no window): DynamicCache holds rows x tokens x layers x (K, V) x heads x dim
    float32 after each step's forward (prompt + step + 1 tokens)."""
    model = tiny("llama")
    report = run_ab(model, prompts(3, 7, seed=52), max_new_tokens=6, tee=False, do_sample=False)
    per_token = 3 * kv_bytes_per_token(model)  # 3 rows
    assert [s.kv_bytes_dynamic for s in report.steps] == [per_token * (7 + t) for t in range(6)]
    assert report.dynamic.kv_peak_bytes == per_token * 12
    assert all(s.kv_equal is None for s in report.steps)  # no tee, no K/V verdict


INJECTED = {
    # name: arch, generate kwargs, prompt kwargs, (step, layer, row, tensor)
    "greedy-keys": ("llama", dict(do_sample=False), dict(left_pad=[0, 2]), (3, 1, 1, "keys")),
    "beam-values": ("llama", dict(num_beams=3, do_sample=False), {}, (5, 0, 4, "values")),
    "sample-keys-last-row": ("qwen2", dict(do_sample=True, num_return_sequences=2), {}, (1, 1, 3, "keys")),
    "gemma3-sliding-layer-past-window": ("gemma3", dict(do_sample=False), {}, (9, 0, 0, "keys")),
}


@pytest.mark.parametrize("case", list(INJECTED))
def test_injected_one_element_error_is_pinpointed(case: str) -> None:
    arch, kwargs, prompt_kwargs, (step, layer, row, tensor) = INJECTED[case]
    factory = faulty(at_step=step, at_layer=layer, at_row=row, tensor=tensor)
    report = run_ab(tiny(arch), prompts(2, 8, seed=53, **prompt_kwargs), max_new_tokens=NEW, cache_config=SMALL,
                    vkv_cache_factory=factory, **kwargs)
    (cache,) = factory.made
    assert cache.injected

    assert not report.identical
    d = report.first_divergence
    assert (d.step, d.kind, d.layer, d.row, d.tensor) == (step, "kv", layer, row, tensor), d
    for s in report.steps[:step]:
        assert s.kv_equal and s.tokens_equal and s.max_abs_logit_diff == 0.0
    bad = report.steps[step]
    assert bad.kv_equal is False and layer in bad.layers_differing
    assert bad.max_abs_logit_diff > 0 and row in bad.rows_differing  # the error reached the logits of that row
    text = format_report(report)
    assert "DIVERGED" in text and f"step {step}, layer {layer}, row {row} ({tensor})" in text


def test_without_tee_the_error_shows_in_the_logits_of_the_same_step_and_row() -> None:
    factory = faulty(at_step=4, at_layer=1, at_row=1)
    report = run_ab(tiny("llama"), prompts(2, 8, seed=54), max_new_tokens=NEW, tee=False, vkv_cache_factory=factory)
    d = report.first_divergence
    assert (d.step, d.kind, d.layer, d.row) == (4, "logits", None, 1)
    assert all(s.max_abs_logit_diff == 0.0 for s in report.steps[:4])


def test_json_follows_the_documented_schema(tmp_path: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")
    good = run_ab(tiny("llama"), prompts(2, 6, seed=55), max_new_tokens=5, num_beams=2, do_sample=False)
    bad = run_ab(tiny("llama"), prompts(2, 6, seed=55), max_new_tokens=5, vkv_cache_factory=faulty(
        at_step=2, at_layer=0, at_row=1))
    for report in (good, bad):
        data = json.loads(report.write_json(tmp_path / "ab.json").read_text())
        jsonschema.validate(data, AB_REPORT_SCHEMA)
        assert data["schema"] == SCHEMA_VERSION == "hf_vkv.ab/1"
        assert set(data) == {"schema", "identical", *ABReport.__dataclass_fields__}  # nothing undocumented
        assert len(data["steps"]) == 5 and data["identical"] == report.identical
    assert data["first_divergence"] == {"step": 2, "kind": "kv", "layer": 0, "row": 1, "tensor": "keys",
                                        "detail": bad.first_divergence.detail}
    broken = json.loads(bad.to_json())
    broken["steps"][0]["kv_bytes_vkv"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, AB_REPORT_SCHEMA)
    del broken["steps"][0]
    broken["surprise"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, AB_REPORT_SCHEMA)


def test_plot_is_a_png(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib", reason="plots need the plot extra (matplotlib)")
    report = run_ab(tiny("llama"), prompts(1, 6, seed=56), max_new_tokens=6, vkv_cache_factory=faulty(
        at_step=3, at_layer=0, at_row=0))
    path = plot_report(report, tmp_path / "sub" / "kv.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_row_digests_are_exact() -> None:
    x = torch.randn(3, 2, 5, 4)
    y = x.clone()
    assert row_digests(x) == row_digests(y.transpose(1, 2).contiguous().transpose(1, 2))  # layout does not matter
    y[1, 1, 4, 3] = torch.nextafter(y[1, 1, 4, 3], torch.tensor(1e9))  # one ulp in one element of row 1
    a, b = row_digests(x), row_digests(y)
    assert [a[i] == b[i] for i in range(3)] == [True, False, True]
    assert row_digests(x[:, :, :4]) != row_digests(x[:, :, :4].contiguous().reshape(3, 2, 2, 8))  # shape counts
    assert row_digests(x.bfloat16())[0] != row_digests(x)[0]


def test_bad_arguments_are_named() -> None:
    model = tiny("llama")
    inputs = prompts(1, 5)
    with pytest.raises(ValueError, match="layout"):
        run_ab(model, inputs, layout="ring")
    with pytest.raises(ValueError, match="past_key_values"):
        run_ab(model, inputs, past_key_values=None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_ab(model, inputs, max_new_tokens=0)
    with pytest.raises(TypeError, match="input_ids"):
        run_ab(model, {"ids": inputs["input_ids"]})
    with pytest.raises(ValueError, match=r"\[batch, prompt\]"):
        run_ab(model, {"input_ids": inputs["input_ids"][0]})
    with pytest.raises(TypeError, match="tee"):
        run_ab(model, inputs, tee="yes")
    with pytest.raises(ValueError, match="cache_config"):
        run_ab(model, inputs, cache_config={"pages": 3})


@pytest.mark.skipif(paged_attention_available(), reason="'vkv_paged' is registered: the paged tests below run")
def test_paged_layout_without_the_attention_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="vkv_paged"):
        run_ab(tiny("llama"), prompts(1, 5), layout="paged")


@pytest.mark.skipif(not paged_attention_available(),
                    reason="the 'vkv_paged' attention implementation is not registered by this hf_vkv yet")
@pytest.mark.parametrize("kwargs", [dict(do_sample=False), dict(num_beams=3, num_return_sequences=2, do_sample=False)])
def test_paged_layout_is_identical(kwargs: dict[str, Any]) -> None:
    model = tiny("llama", layers=2, seed=7)  # its own instance: the attention is switched and restored
    before = model.config._attn_implementation
    report = run_ab(model, prompts(2, 9, seed=57, left_pad=[0, 3]), max_new_tokens=NEW, layout="paged",
                    cache_config=SMALL, **kwargs)
    assert report.layout == "paged" and report.identical, format_report(report)
    assert model.config._attn_implementation == before


def test_version_is_reported() -> None:
    report = run_ab(tiny("gpt2"), prompts(1, 4, seed=58), max_new_tokens=3)
    assert report.identical
    assert report.environment["hf_vkv"] == hf_vkv.__version__ and report.environment["device"].startswith("cpu")


# ---------------------------------------------------------------------------- with a prefix store
def _chat_inputs(history: list[int]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([history])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(num_beams=3, do_sample=False),
                                  dict(do_sample=True, num_return_sequences=2)], ids=["greedy", "beams", "sample-n2"])
def test_run_ab_with_a_store_is_exact_against_the_continued_dynamic_cache(mode: dict[str, Any], tmp_path: Any) -> None:
    """The default reference of ``run_ab(prefix_store=...)``: one DynamicCache passed to every turn
    (continued in place) holds the history the store lends; every turn is identical (tokens,
    logits and, with the tee, every layer's K/V), reuse happened, and the JSON says so."""
    from transformers import DynamicCache

    model = tiny("llama")
    store = hf_vkv.PrefixStore(model.config)
    history_cache = DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(8)
    history = torch.randint(3, 500, (30,), generator=g).tolist()
    for turn in range(3):
        history = history + torch.randint(3, 500, (4,), generator=g).tolist()
        report = run_ab(model, _chat_inputs(history), max_new_tokens=5, prefix_store=store,
                        reference_cache=history_cache, tee=turn != 1, **mode)
        assert report.identical and report.passed, report.first_divergence
        assert report.reference == "continued" and report.max_abs_logit_diff == 0.0
        assert (report.prefix_reuse["reused_tokens"] > 0) == (turn > 0)
        rows = report.rows
        assert history_cache.get_seq_length() == len(history) + 4 and history_cache.layers[0].keys.shape[0] == rows
        history = history + list(report.generated_vkv[0])
    data = json.loads(report.write_json(tmp_path / "ab.json").read_text())
    assert data["reference"] == "continued" and data["identical"]
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")
    jsonschema.validate(data, AB_REPORT_SCHEMA)
    for bad in ("prefilled", 1):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**data, "reference": bad}, AB_REPORT_SCHEMA)


def test_run_ab_reference_prefill_keeps_the_whole_prefill_comparison() -> None:
    """``reference="prefill"``: DynamicCache prefills every turn whole (a different sum: the verdict
    is the tokens, max |Δlogit| reported); the report says which reference it was; without a
    store, ``reference`` is ``None``."""
    model = tiny("llama")
    store = hf_vkv.PrefixStore(model.config)
    g = torch.Generator().manual_seed(9)
    history = torch.randint(3, 500, (30,), generator=g).tolist()
    for turn in range(2):
        history = history + torch.randint(3, 500, (4,), generator=g).tolist()
        report = run_ab(model, _chat_inputs(history), max_new_tokens=5, prefix_store=store, reference="prefill",
                        tee=False, do_sample=False)
        assert report.reference == "prefill" and report.tokens_identical and report.passed
        assert report.max_abs_logit_diff <= 1e-5
        history = history + list(report.generated_vkv[0])
    assert report.prefix_reuse["reused_tokens"] > 0
    assert run_ab(model, _chat_inputs(history), max_new_tokens=2, tee=False).reference is None


def test_run_ab_reference_arguments_are_checked_before_any_run() -> None:
    """Bad combinations are typed errors, raised before either run (the store is left as it was)."""
    from transformers import DynamicCache

    from hf_vkv.generate import cache_kwarg

    model = tiny("llama")
    store = hf_vkv.PrefixStore(model.config)
    g = torch.Generator().manual_seed(10)
    history = torch.randint(3, 500, (30,), generator=g).tolist()
    inputs = _chat_inputs(history)
    run_ab(model, inputs, max_new_tokens=3, prefix_store=store, tee=False)  # stores the prompt and its answer
    entries = store.prefixes()
    longer = _chat_inputs(history + [5, 6, 7, 8])
    with pytest.raises(ValueError, match="reference must be one of"):
        run_ab(model, inputs, max_new_tokens=2, prefix_store=store, reference="whole", tee=False)
    with pytest.raises(TypeError, match="DynamicCache"):
        run_ab(model, inputs, max_new_tokens=2, prefix_store=store, reference_cache=object(), tee=False)
    with pytest.raises(ValueError, match="pass prefix_store=store too"):
        run_ab(model, inputs, max_new_tokens=2, reference="prefill", tee=False)
    with pytest.raises(ValueError, match="pass prefix_store=store too"):
        run_ab(model, inputs, max_new_tokens=2, reference_cache=DynamicCache(config=model.config), tee=False)
    with pytest.raises(ValueError, match="drop reference_cache"):
        run_ab(model, inputs, max_new_tokens=2, prefix_store=store, reference="prefill",
               reference_cache=DynamicCache(config=model.config), tee=False)
    with pytest.raises(ValueError, match="tee=False"):
        run_ab(model, inputs, max_new_tokens=2, prefix_store=store, reference="prefill")
    with pytest.raises(ValueError, match="reference_cache holds 0"):  # the store lends history nobody holds
        run_ab(model, longer, max_new_tokens=2, prefix_store=store, tee=False)
    short = DynamicCache(config=model.config)
    model(input_ids=inputs["input_ids"][:, :10], **{cache_kwarg(): short})
    with pytest.raises(ValueError, match="reference_cache holds 10"):
        run_ab(model, longer, max_new_tokens=2, prefix_store=store, reference_cache=short, tee=False)
    two = prompts(2, 8, seed=56)
    rows3 = DynamicCache(config=model.config)
    model(input_ids=prompts(3, 4, seed=57)["input_ids"], **{cache_kwarg(): rows3})
    with pytest.raises(ValueError, match="not a multiple of the batch"):
        run_ab(model, two, max_new_tokens=2, prefix_store=store, reference_cache=rows3, tee=False)
    assert store.prefixes() == entries and short.get_seq_length() == 10


def _cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    from hf_vkv import cli

    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:
        code = int(e.code)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def raw_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from models import tokenizer

    path = tmp_path_factory.mktemp("tiny-llama-raw")
    tiny("llama").save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def test_cli_ab_reuse_compares_with_the_continued_dynamic_cache(raw_model_dir: Any, tmp_path: Any,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``hf-vkv ab --reuse N``: by default each turn's DynamicCache continues the previous turn's
    (identical, tee on); ``--reference prefill`` prefills every turn whole (tokens compared);
    ``--reference`` without ``--reuse`` is a usage error."""
    prompt = " ".join(f"w{i}" for i in range(20, 60))
    common = ("ab", "--model", raw_model_dir, "--prompt", prompt, "--raw", "--max-new-tokens", "4", "--quiet",
              "--threads", "1", "--reuse", "3")
    code, out = _cli(capsys, *common, "--json", tmp_path / "continued.json")
    assert code == 0, out
    assert "turn 3:" in out and "(against DynamicCache continued from the previous turn)" in out
    turns = json.loads((tmp_path / "continued.json").read_text())["turns"]
    assert [t["reference"] for t in turns] == ["continued"] * 3 and all(t["identical"] and t["tee"] for t in turns)
    assert turns[1]["prefix_reuse"]["reused_tokens"] >= 40 and turns[2]["prefix_reuse"]["reused_tokens"] >= 48
    code, out = _cli(capsys, *common, "--reference", "prefill", "--json", tmp_path / "prefill.json")
    assert code == 0, out
    assert "(against DynamicCache prefilling the whole prompt)" in out
    turns = json.loads((tmp_path / "prefill.json").read_text())["turns"]
    assert [t["reference"] for t in turns] == ["prefill"] * 3 and all(t["tokens_identical"] for t in turns)
    assert not any(t["tee"] for t in turns)
    code, out = _cli(capsys, "ab", "--model", raw_model_dir, "--reference", "prefill", "--quiet")
    assert code == 2 and "give --reuse TURNS" in out

"""The benchmark's machinery on a tiny random Llama: the ideal cache against DynamicCache, the
decode-cell measurement (prompt loading, interleaved steps, the divergence check), the grid, and
the two entry points (``hf-vkv bench``, ``benchmarks/generate_cpu.py``). No timing is asserted."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import prompts, tiny
from transformers.cache_utils import DynamicCache, DynamicLayer

from hf_vkv import VKVCache
from hf_vkv.ab import bench
from hf_vkv.ab.bench_args import add_arguments, grid_from_args, run_from_args
from hf_vkv.ab.decode import load_prompt, prefill, time_decode
from hf_vkv.ab.ideal import IdealCache
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NEW = 10


def _generate(model, inputs, cache, **kwargs):
    torch.manual_seed(0)
    return model.generate(**inputs, **{cache_kwarg(): cache}, max_new_tokens=NEW, min_new_tokens=NEW,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("left_pad", [None, [0, 3, 5]], ids=["full", "left-padded"])
@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beams3"])
def test_ideal_cache_is_token_identical_to_dynamic_cache(left_pad: list[int] | None, beams: int) -> None:
    model = tiny("llama")
    inputs = prompts(3, 9, seed=5, left_pad=left_pad)
    rows = 3 * beams
    ref = _generate(model, inputs, DynamicCache(config=model.config), num_beams=beams)
    ideal = IdealCache(model.config, capacity=9 + NEW)
    got = _generate(model, inputs, ideal, num_beams=beams)
    assert torch.equal(ref.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits))
    layer = ideal.layers[0]
    assert layer.key_buffer.shape[:3] == (rows, model.config.num_key_value_heads, 9 + NEW)
    assert layer.keys.data_ptr() == layer.key_buffer.data_ptr()  # a view of the buffer, not a copy
    assert ideal.get_seq_length() == 9 + NEW - 1 and ideal.nbytes() == 2 * 2 * layer.key_buffer.nbytes


def test_ideal_cache_refuses_overflow_and_sliding_layers() -> None:
    model = tiny("llama")
    cache = IdealCache(model.config, capacity=4)
    states = torch.zeros(1, 2, 3, 16)
    cache.update(states, states, 0)
    with pytest.raises(ValueError, match="holds 4 tokens per row"):
        cache.update(states, states, 0)
    with pytest.raises(ValueError, match="full-attention layers only"):
        IdealCache(tiny("gemma3").config, capacity=8)


def test_crop_and_reorder_keep_the_views_on_the_buffer() -> None:
    model = tiny("llama")
    cache = IdealCache(model.config, capacity=8)
    keys = torch.arange(3 * 2 * 5 * 16, dtype=torch.float32).view(3, 2, 5, 16)
    cache.update(keys, -keys, 0)
    cache.layers[0].reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.layers[0].keys, keys[[2, 0, 0]])
    cache.crop(-2)
    assert cache.layers[0].keys.shape[2] == 3 and cache.get_seq_length() == 3
    assert torch.equal(cache.layers[0].values, -keys[[2, 0, 0], :, :3])


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def _caches(model, batch: int, capacity: int, names=("dynamic", "ideal", "token_major", "head_major")):
    return {name: bench.make_cache(name, model, batch, capacity) for name in names}


def test_load_prompt_writes_the_same_kv_into_every_cache(model) -> None:
    state = prefill(model, bench.prompt_ids(model, 12, 2), chunk=5)  # chunked: 5 + 5 + 2
    assert state.length == 12 and state.distinct_rows == 2 and state.first_tokens.shape == (2,)
    # the chunked prefill gives the K/V of a one-shot forward
    one = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=bench.prompt_ids(model, 12, 2), **{cache_kwarg(): one}, use_cache=True)
    assert torch.allclose(one.layers[1].keys, state.keys[1], atol=1e-5, rtol=0)
    caches = _caches(model, 3, 12 + 4)
    load_prompt(caches, state, 3)
    expected = state.keys[1][[0, 1, 0]]  # three rows over two distinct prompts
    for name, cache in caches.items():
        assert cache.get_seq_length() == 12, name
        layer = cache.layers[1]
        assert isinstance(layer, DynamicLayer) or name != "dynamic"
        assert torch.equal(layer.keys, expected), name


def test_time_decode_agrees_with_dynamic_cache_and_reports_every_cache(model) -> None:
    state = prefill(model, bench.prompt_ids(model, 10, 2))
    caches = _caches(model, 2, 10 + 5)
    load_prompt(caches, state, 2)
    out = time_decode(model, caches, state, batch=2, new_tokens=5, rounds=3,
                      kv_bytes=dict.fromkeys(caches, bench.cache_kv_bytes),
                      extra={"head_major": lambda c: {"utilization": c.stats().utilization}})
    assert list(out) == list(caches)
    for name, timing in out.items():
        assert timing.tokens_equal and timing.first_mismatch is None, name
        assert len(timing.round_step_s) == 3 and timing.kv_end_bytes > 0, name
        assert caches[name].get_seq_length() == 15, name  # the last round's tokens are kept
    assert out["dynamic"].kv_end_bytes == 2 * 2 * 2 * 2 * 15 * 16 * 4  # layers x K/V x rows x heads x T x D x 4
    assert out["ideal"].kv_end_bytes == out["dynamic"].kv_end_bytes  # capacity == prompt + new tokens
    assert 0 < out["head_major"].extra["utilization"] <= 1
    # the vkv layouts and the ideal cache read what DynamicCache reads: logits bit for bit
    assert all(t.max_abs_logit_diff == 0 for t in out.values())


class _Corrupt(DynamicCache):
    """A DynamicCache that negates the values layer 0 returns: attention reads wrong V."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return (keys, -4 * values) if layer_idx == 0 else (keys, values)


def test_time_decode_reports_a_cache_that_diverges(model) -> None:
    state = prefill(model, bench.prompt_ids(model, 10, 3))
    caches = {"dynamic": DynamicCache(config=model.config), "broken": _Corrupt(config=model.config)}
    load_prompt(caches, state, 3)
    out = time_decode(model, caches, state, batch=3, new_tokens=6, rounds=2,
                      kv_bytes=dict.fromkeys(caches, bench.cache_kv_bytes))
    assert out["dynamic"].tokens_equal
    assert out["broken"].max_abs_logit_diff > 0
    assert not out["broken"].tokens_equal and out["broken"].first_mismatch.startswith("round 0, step ")


def test_grid_checks_and_distinct_prompts() -> None:
    grid = bench.Grid(prompt_lengths=(64, 8192), batches=(1, 8), distinct_tokens=8192)
    assert grid.cells() == [(64, 1), (64, 8), (8192, 1), (8192, 8)]
    assert grid.distinct_prompts(64) == 8 and grid.distinct_prompts(8192) == 1
    assert bench.Grid(prompt_lengths=(64,), batches=(1, 8), modes=("greedy", "beam4")).mode_points() == [
        (64, 1, "greedy"), (64, 1, "beam4"), (64, 8, "greedy")]
    for bad, match in ((dict(batches=(0,)), "batches must be positive"), (dict(rounds=0), "rounds must be"),
                       (dict(caches=("ideal",)), "must include 'dynamic'"), (dict(caches=("x",)), "caches must be")):
        with pytest.raises(ValueError, match=match):
            bench.Grid(**{"prompt_lengths": (8,), "batches": (1,), **bad})
    assert bench.FULL_GRID.prompt_lengths == (64, 512, 2048, 8192) and bench.FULL_GRID.batches == (1, 4, 8)
    assert bench.FULL_GRID.new_tokens == 24 and bench.FULL_GRID.rounds == 3


def test_layouts_are_spelled_in_one_place(model) -> None:
    assert bench.default_layout() in bench.VKV_LAYOUTS
    for layout in bench.VKV_LAYOUTS:
        cache = bench.make_cache(layout, model, 2, 20)
        assert isinstance(cache, VKVCache) and cache.options.max_tokens == 20
        cache.close()
    with pytest.raises(ValueError, match="unknown vkv layout"):
        bench.vkv_cache_config("diagonal")


def test_run_from_args_writes_the_report(model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, default="quick")
    args = parser.parse_args(["--prompts", "8", "--batches", "1", "2", "--new-tokens", "3", "--rounds", "2",
                              "--modes", "greedy", "sample8"])
    grid = grid_from_args(args)
    assert grid.new_tokens == 3 and grid.caches == bench.DEFAULT_CACHES
    code = run_from_args(args, model, grid=grid, model_name="tiny", command="test", json_path=tmp_path / "b.json")
    assert code == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["schema"] == bench.BENCH_SCHEMA_VERSION and data["command"] == "test"
    assert data["environment"]["timed_threads"] == "1" and "transformers" in data["environment"]
    assert [(c["prompt"], c["batch"]) for c in data["cells"]] == [(8, 1), (8, 2)]
    cell = data["cells"][1]
    assert cell["tokens_equal"] and set(cell["caches"]) == set(bench.DEFAULT_CACHES)
    assert set(cell["ratios"]) == {"token_major", "head_major"}
    assert cell["ratios"]["head_major"]["vs_ideal"] > 0 and 0 < cell["caches"]["token_major"]["utilization"] <= 1
    assert [(r["mode"], r["identical"]) for r in data["results"]] == [("greedy", True), ("sample8", True),
                                                                      ("greedy", True), ("sample8", True)]
    out = capsys.readouterr().out
    assert "head/ideal" in out and "identical" in out and "sample8" in out


def test_generate_cpu_script_documents_both_grids() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "benchmarks/generate_cpu.py", "--help"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "benchmarks/generate_cpu.py --threads 2" in out.stdout and "--quick" in out.stdout
    assert "prompts 64 512 2048 8192, batches 1 4 8, 24 new tokens, 3 rounds (default)" in " ".join(out.stdout.split())


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmark_scripts_import_their_shared_code_without_path_hacks(script: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each script imports as ``python benchmarks/<script>`` runs it (its folder first on
    ``sys.path``, so ``from common import ...`` works) and touches ``sys.path`` itself nowhere."""
    path = ROOT / "benchmarks" / script
    assert "sys.path" not in path.read_text()
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert script == "common.py" or callable(module.main)


def test_ideal_cache_is_bit_identical_under_eager_attention_without_gqa() -> None:
    """One KV head per query head: eager attention's matmul reads the cache's views directly. The
    ideal cache's ``[B, H, T, D]`` views have ``stride(B) == H * stride(H)`` (batch and heads merge),
    so ``torch.matmul`` folds them into one bmm without a copy, as for DynamicCache's tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=128,
                         attn_implementation="eager")
    mha = LlamaForCausalLM(config).eval()
    state = prefill(mha, bench.prompt_ids(mha, 20, 2))
    caches = _caches(mha, 2, 20 + 4, names=("dynamic", "ideal"))
    load_prompt(caches, state, 2)
    view = caches["ideal"].layers[0].keys
    assert view.stride(0) == view.shape[1] * view.stride(1) and not view.is_contiguous()
    out = time_decode(mha, caches, state, batch=2, new_tokens=4, rounds=1,
                      kv_bytes=dict.fromkeys(caches, bench.cache_kv_bytes))
    assert out["ideal"].tokens_equal and out["ideal"].max_abs_logit_diff == 0

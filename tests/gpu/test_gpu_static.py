"""The compileable static layout on a GPU: ``torch.compile`` (``mode="reduce-overhead"``: CUDA
graphs) over ``cache_config={"layout": "static"}``, token-identical to StaticCache compiled the
same way, greedy and beam-4; and its readable reservation (the scratch page at every unbacked
slot) read whole by captured kernels.

Written ahead of the static layout (docs/architecture.md): where this build has no ``"static"`` layout
the generate tests skip, saying so. The scratch mapping itself is checked under memcheck by
``test_gpu_sanitizer.py`` (``sanitizer_generate.py`` reads a readable reservation whole).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from gpu_helpers import GPU, cuda_backend
from models import assert_same_tokens, prompts, tiny

from hf_vkv.memory import PageId

pytestmark = [*GPU, pytest.mark.integration]

MODES = {
    "greedy": dict(do_sample=False),
    "beams4": dict(do_sample=False, num_beams=4, num_return_sequences=2),
}


def _compile_config():
    from transformers import CompileConfig

    return CompileConfig(mode="reduce-overhead", fullgraph=False)


def _generate(model, inputs, *, cache: str, new: int, **kwargs):
    config = dict(cache_implementation=cache, compile_config=_compile_config(), max_new_tokens=new,
                  return_dict_in_generate=True, **kwargs)
    if cache == "vkv":
        config["cache_config"] = {"layout": "static"}
    torch.manual_seed(0)
    return model.generate(**inputs, **config)


@pytest.mark.parametrize("mode", MODES)
def test_vkv_static_under_cuda_graphs_matches_static_cache(mode: str) -> None:
    model = copy.deepcopy(tiny("llama")).to("cuda", torch.float16)
    inputs = {k: v.to("cuda") for k, v in prompts(2, 12, seed=3, left_pad=[0, 4]).items()}
    ref = _generate(model, inputs, cache="static", new=24, **MODES[mode])
    try:
        got = _generate(model, inputs, cache="vkv", new=24, **MODES[mode])
    except (ValueError, TypeError) as exc:
        if "static" in str(exc) and "layout" in str(exc):
            pytest.skip(f"this build has no static layout yet: {exc}")
        raise
    cache = got.past_key_values
    assert getattr(cache, "is_compileable", False), "the static layout must say it is compileable"
    assert_same_tokens(ref.sequences, got.sequences)
    del ref, got, cache
    gc.collect()


def test_captured_graph_reads_scratch_then_real_pages_at_the_same_addresses() -> None:
    """A CUDA graph captured over a readable reservation keeps working while real pages are
    mapped under its fixed addresses (outside the graph) and unmapped again."""
    backend = cuda_backend(create_ahead=2, max_pages=8)
    page = backend.page_bytes
    backend.ensure_id_space(2)
    backend.create([PageId(0), PageId(1)])
    base = backend.reserve(4 * page, readable=True)
    view = backend.tensor(base, 4 * page, owner=None)
    out = torch.zeros((), dtype=torch.int64, device=view.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(view[page:2 * page].sum(dtype=torch.int64))  # warm-up before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(view[page:2 * page].sum(dtype=torch.int64))
    graph.replay()
    torch.cuda.synchronize()  # scratch: whatever it holds, no fault
    backend.map(base + page, [PageId(1)])
    view[page:2 * page].fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert int(out) == 3 * page  # the graph now reads the real page at the same address
    backend.unmap(base + page, 1)
    graph.replay()
    torch.cuda.synchronize()  # back to scratch: still no fault
    del graph, view
    backend.unreserve(base, 4 * page)
    backend.close()

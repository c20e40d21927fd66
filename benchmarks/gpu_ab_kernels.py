"""Does DynamicCache repeat itself, and does vkv match it, under a given kernel setting? (GPU probe)

    python3 benchmarks/gpu_ab_kernels.py warn     # hf_vkv.ab.deterministic.deterministic_kernels
    python3 benchmarks/gpu_ab_kernels.py strict   # torch.use_deterministic_algorithms(True)

SmolLM2's shape with random weights (``gpu_generate.py``'s model), bf16, batch 8 x 1,024 random
tokens (``gpu_generate.py``'s prompt for that cell), greedy, 128 new tokens, logits kept. One
DynamicCache run is the reference; then DynamicCache again, with and without a streamer, and vkv
token-major and default, each with and without a streamer. Prints per run: tokens equal, the first
step whose logits differ, max |Δlogit| at step 0. Output recorded in
``results/gpu_ab_kernels_h200.txt``.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers.generation.streamers import BaseStreamer

from gpu_generate import load_model  # noqa: E402
from hf_vkv.ab.deterministic import deterministic_kernels


class NullStreamer(BaseStreamer):
    def put(self, value) -> None:
        pass

    def end(self) -> None:
        pass


def main() -> None:
    mode = sys.argv[1]
    if mode == "warn":
        deterministic_kernels("cuda").__enter__()  # for the whole process
    elif mode == "strict":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    model, _ = load_model("smollm2-random", torch.bfloat16)
    gen = torch.Generator().manual_seed(1024 * 31 + 8)
    ids = torch.randint(10, model.config.vocab_size, (8, 1024), generator=gen).cuda()

    def go(cache, streamer: bool):
        kw = dict(max_new_tokens=128, min_new_tokens=128, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=model.generation_config.eos_token_id)
        if cache != "dynamic":
            kw.update(cache_implementation="vkv", cache_config=cache)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 streamer=NullStreamer() if streamer else None, **kw)
        return out.sequences.cpu(), [x.float().cpu() for x in out.logits]

    ref = go("dynamic", False)
    runs = [("dyn-again", "dynamic", False), ("dyn-stream", "dynamic", True),
            ("vkv-tok", {"layout": "token_major"}, False), ("vkv-tok-stream", {"layout": "token_major"}, True),
            ("vkv-default", {}, False), ("vkv-default-stream", {}, True)]
    for name, cache, streamer in runs:
        seq, logits = go(cache, streamer)
        diff = [i for i, (a, b) in enumerate(zip(ref[1], logits)) if not torch.equal(a, b)]
        print(mode, name, "tokens", torch.equal(seq, ref[0]), "first logit diff step", diff[:1],
              "dlogit0", (logits[0] - ref[1][0]).abs().max().item(), flush=True)


if __name__ == "__main__":
    main()

"""Is a one-row product at one thread bit-equal to the same row of a tall product at two threads?

    python benchmarks/row_threads_probe.py > benchmarks/results/row_threads_probe.txt

The MLP's ``down_proj`` of SmolLM2's shape (``[1, P, 1536] x [576, 1536]``), P = 128 and 512,
the tall product of k = 8 and 128 repeats of the row (what DynamicCache computes for k sampled
rows of one prompt), 5 random draws each: how often the one-row product equals the tall one's
first row at 2 threads, and at 1 thread. A probe for prefill once's rule (docs/scaling.md: at 128
tokens and 2 threads this product is not admitted on one row), not a proof.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def main() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=g) * 0.02
    print(f"torch {torch.__version__}, {torch.get_num_threads()} default threads")
    for prompt in (128, 512):
        for k in (8, 128):
            at_two = at_one = 0
            for _ in range(5):
                x = torch.randn(1, prompt, 1536, generator=g)
                torch.set_num_threads(2)
                tall = F.linear(x.expand(k, prompt, 1536).contiguous(), weight)
                one_two = F.linear(x, weight)
                torch.set_num_threads(1)
                one_one = F.linear(x, weight)
                torch.set_num_threads(2)
                at_two += torch.equal(one_two[0], tall[0])
                at_one += torch.equal(one_one[0], tall[0])
            print(f"P={prompt} k={k}: one row at 2 threads == tall (2 threads) {at_two}/5; "
                  f"one row at 1 thread == tall (2 threads) {at_one}/5", flush=True)


if __name__ == "__main__":
    main()

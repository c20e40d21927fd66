"""Tensor parallelism on the CPU: transformers' ``tp_plan="auto"`` over 2 processes (gloo).

Each rank holds half the KV heads; ``cache_implementation="vkv"`` (contiguous and paged) must give
the tokens DynamicCache gives under the same plan, on every rank.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from models import tiny

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RANKS = 2


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch without gloo")
def test_vkv_under_tensor_parallel_matches_dynamic_cache(tmp_path: Path) -> None:
    model = tiny("llama")  # tests/models.py: 4 query heads, 2 KV heads (one per rank)
    model.save_pretrained(tmp_path / "llama")
    worker = Path(__file__).with_name("tp_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
         str(worker), str(tmp_path / "llama")],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # the ranks share one stdout: their lines may interleave
    results = re.findall(r"RESULT (\d+) (\S+) (True|False) (\d+)", run.stdout)
    assert len(results) == RANKS * 4, run.stdout
    for rank, case, identical, heads in results:
        assert identical == "True", f"rank {rank}, {case}: vkv differs from DynamicCache under tp_plan='auto'"
        assert int(heads) == model.config.num_key_value_heads // RANKS  # the cache holds this rank's shard

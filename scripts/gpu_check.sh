#!/usr/bin/env bash
# The GPU verification of hf_vkv's CUDA path, in stages that each fit one device-tool call.
#
#   scripts/gpu_check.sh STAGE        (STAGE = 1 .. 6, or "list")
#
#   1  bindings, driver rules, backend, DLPack on the device + driver-latency benchmark (gpu_vmm.py)
#   2  generate() token identity: fp16/bf16 x sdpa/eager x greedy/beams/sampling, tiny models and
#      SmolLM2-shaped / wide llamas whose rows cross several 2 MiB pages
#   3  the state machine on device memory + compute-sanitizer memcheck (generate, page-crossing
#      beams, the readable reservation's scratch page)
#   4  gpu_generate.py at 1k / 4k context x batch 1 / 8 / 32 (DynamicCache, StaticCache without
#      compile, vkv token-major, vkv per-layer): decode tokens/s, KV bytes, mapping share
#   5  gpu_generate.py at 16k x batch 1 / 8 / 32, and beam search 4 at 4k (remaps and bytes
#      copied per step vs DynamicCache's index_select)
#   6  the compileable static layout: torch.compile reduce-overhead (CUDA graphs) vs StaticCache,
#      greedy and beam-4, and a captured graph over a readable reservation
#
# Each stage is bounded by `timeout` (STAGE_TIMEOUT, default 530 s, inside the tool's 600 s) and
# writes gpu_check_stageN.log and gpu_check_stageN.json into benchmarks/results/ and, when $OUT is
# set (the device tool), into $OUT too. Benchmark JSONs are written as each cell finishes, so a
# stage cut short by the timeout still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:-list}"
if [[ "$stage" == list || ! "$stage" =~ ^[1-6]$ ]]; then
  sed -n '2,20p' "$0"; exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
results=benchmarks/results
mkdir -p "$results"
log="$results/gpu_check_stage$stage.log"
xml="$results/gpu_check_stage$stage.xml"
limit="${STAGE_TIMEOUT:-530}"
pytest_gpu() { timeout "$limit" python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$xml" "$@"; }

start=$(date +%s)
{
  echo "stage $stage on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
  case "$stage" in
    1) pytest_gpu tests/unit/test_cuda_dlpack.py tests/unit/test_cuda_driver_rules.py tests/unit/test_cuda_memory.py \
         tests/unit/test_cuda_backend.py tests/gpu/test_gpu_backend.py -m "gpu or not gpu"
       rc=$?
       timeout 120 python3 benchmarks/gpu_vmm.py --pages 256 --out "$results/gpu_vmm.json" || rc=$((rc ? rc : $?)) ;;
    2) pytest_gpu -m gpu tests/gpu/test_gpu_generate.py; rc=$? ;;
    3) pytest_gpu -m gpu tests/gpu/test_gpu_state_machine.py tests/gpu/test_gpu_sanitizer.py; rc=$? ;;
    4) timeout "$limit" python3 benchmarks/gpu_generate.py --model smollm2-random --contexts 1024 4096 \
         --batches 1 8 32 --repeats 2 --new-tokens 512 --beam-context 0 --json "$results/gpu_generate_short.json"
       rc=$? ;;
    5) timeout "$limit" python3 benchmarks/gpu_generate.py --model smollm2-random --contexts 16384 \
         --batches 1 8 32 --repeats 1 --new-tokens 512 --beam-context 4096 --beam-new-tokens 128 \
         --json "$results/gpu_generate_long.json"
       rc=$? ;;
    6) pytest_gpu -m gpu tests/gpu/test_gpu_static.py; rc=$? ;;
  esac
  echo "stage $stage exit $rc after $(( $(date +%s) - start )) s"
  exit $rc
} 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}

python3 - "$stage" "$rc" "$(( $(date +%s) - start ))" "$xml" "$results/gpu_check_stage$stage.json" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
stage, rc, seconds, xml_path, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
report = {"stage": int(stage), "exit_code": rc, "timed_out": rc == 124, "seconds": seconds}
if os.path.exists(xml_path):
    cases = []
    for case in ET.parse(xml_path).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or "")[:500]
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), **({"detail": detail} if outcome != "passed" else {})})
    report["tests"] = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    report["not_passed"] = [c for c in cases if c["outcome"] != "passed"]
with open(out, "w") as f:
    json.dump(report, f, indent=2)
print(json.dumps({k: v for k, v in report.items() if k != "not_passed"}))
PY

if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  cp "$log" "$results/gpu_check_stage$stage.json" "$OUT/" 2>/dev/null
  case "$stage" in
    1) cp "$results/gpu_vmm.json" "$OUT/" 2>/dev/null ;;
    4) cp "$results/gpu_generate_short.json" "$OUT/" 2>/dev/null ;;
    5) cp "$results/gpu_generate_long.json" "$OUT/" 2>/dev/null ;;
  esac
fi
exit "$rc"

#!/usr/bin/env bash
# The GPU verification of hf_vkv's CUDA path, in stages that each fit one device-tool call.
#
#   scripts/gpu_check.sh quick        the first thing to run when a GPU is at hand: <= 7 minutes
#   scripts/gpu_check.sh quick --plan its parts, in the order they run, with their time budgets
#   scripts/gpu_check.sh STAGE        (STAGE = 1 .. 7, or "list"): the long stages, for spare time
#
#   quick  in one call, each part bounded by its own timeout, most valuable first: the bindings and
#      backend on the device (tests/gpu/test_gpu_backend.py, gpu_vmm.py --pages 64); token identity
#      with DynamicCache of greedy / beams / sampling in fp16 and bf16 on a SmolLM2-shaped llama
#      whose rows cross 2 MiB pages; a decode table (vkv, DynamicCache, StaticCache at 1k and 4k x
#      batch 1 and 8, 128 new tokens) with KV bytes; then the fake-driver unit tests of the CUDA
#      path. Without a GPU it runs the CPU-side parts (the pytest selections and the benchmarks'
#      arguments resolve, the fake-driver tests), names what it skipped, and exits 0 if they pass.
#      Writes gpu_check_quick.{log,json} (the JSON rewritten after every part) and the benchmark
#      JSONs gpu_vmm_quick.json, gpu_generate_quick.json into benchmarks/results/ and $OUT.
#
#   1  bindings, driver rules, backend, DLPack on the device + driver-latency benchmark (gpu_vmm.py)
#   2  generate() token identity: fp16/bf16 x sdpa/eager x greedy/beams/sampling, tiny models and
#      SmolLM2-shaped / wide llamas whose rows cross several 2 MiB pages; a chat with a prefix
#      store against the continued DynamicCache (tests/gpu/test_gpu_reuse.py)
#   3  the state machine on device memory + compute-sanitizer memcheck (generate, page-crossing
#      beams, the readable reservation's scratch page)
#   4  gpu_generate.py at 1k / 4k context x batch 1 / 8 / 32 (DynamicCache, StaticCache without
#      compile, vkv token-major, vkv per-layer): decode tokens/s, KV bytes, mapping share
#   5  gpu_generate.py at 16k x batch 1 / 8 / 32, and beam search 4 at 4k (remaps and bytes
#      copied per step vs DynamicCache's index_select)
#   6  the compileable static layout: torch.compile reduce-overhead (CUDA graphs) vs StaticCache,
#      greedy and beam-4, and a captured graph over a readable reservation
#   7  sharing device pages across processes (under 3 minutes): a parent exports shareable pages as
#      POSIX fds over a Unix socket, a child imports and maps them and reads the parent's bytes,
#      device memory grows by one copy only; write_pages round trip (tests/gpu/test_gpu_share.py)
#
# Each stage is bounded by `timeout` (STAGE_TIMEOUT, default 530 s, inside the tool's 600 s; stage 7
# at most 170 s) and writes gpu_check_stageN.log and gpu_check_stageN.json into benchmarks/results/
# and, when $OUT is set (the device tool), into $OUT too. Benchmark JSONs are written as each cell
# finishes, so a stage cut short by the timeout still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:-list}"

# ------------------------------------------------------------------------------------ quick
# Parts, most valuable first: "name|budget_s|what|JSONs it writes into $results|command" (the
# command runs under `timeout` in bash -c, with $results and $progress set). Device parts run
# where torch sees a CUDA GPU; the CPU parts run where it does not (the fake-driver tests run in
# both). The budgets add up to 400 s (on an H200: bindings 34 s, the VMM latencies 16 s, identity
# 128 s, the table's 1k cells 84 s); QUICK_BUDGET (400 s) bounds
# the whole stage: a part gets min(its budget, what is left - 10 s of kill grace), and a part left
# with under 5 s is skipped and said so. Environment (for tests and reruns): GPU_CHECK_PARTS
# (names to run, default all), GPU_CHECK_RESULTS (default benchmarks/results), QUICK_BUDGET,
# GPU_CHECK_FORCE_MODE (device or cpu: the flow of that mode whatever torch says, for the tests).
QUICK_IDENTITY=(  # modes and dtypes interleaved: a part cut short still saw each mode and dtype
  "tests/gpu/test_gpu_generate.py::test_smollm2_shape_rows_cross_several_pages[fp16-sdpa-greedy]"
  "tests/gpu/test_gpu_generate.py::test_smollm2_shape_rows_cross_several_pages[bf16-sdpa-beams]"
  "tests/gpu/test_gpu_generate.py::test_smollm2_shape_rows_cross_several_pages[fp16-sdpa-sampling]"
  "tests/gpu/test_gpu_generate.py::test_smollm2_shape_rows_cross_several_pages[bf16-sdpa-greedy]"
  "tests/gpu/test_gpu_generate.py::test_smollm2_shape_rows_cross_several_pages[fp16-sdpa-beams]"
  "tests/gpu/test_gpu_generate.py::test_smollm2_shape_rows_cross_several_pages[bf16-sdpa-sampling]"
  "tests/gpu/test_gpu_generate.py::test_pages_go_back_after_generate"
)
QUICK_BINDINGS=(tests/gpu/test_gpu_backend.py)
QUICK_CPU_UNIT=(tests/unit/test_cuda_dlpack.py tests/unit/test_cuda_driver_rules.py tests/unit/test_cuda_memory.py
                tests/unit/test_cuda_backend.py tests/unit/test_cuda_no_holes.py tests/unit/test_cuda_share.py)
QUICK_TABLE=(--model smollm2-random --dtype bf16 --contexts 1024 4096 --batches 1 8 --caches dynamic static vkv
             --repeats 1 --new-tokens 128 --beam-context 0)
QUICK_VMM=(--pages 64)
QUICK_DEVICE_PARTS=(
  "bindings|45|the CUDA bindings and backend on the device: tests/gpu/test_gpu_backend.py (maps, zero-copy views, aliasing, copy-on-write, the unmap wait and its negative control, the readable reservation, memory given back)||quick_pytest bindings -m gpu \"\${QUICK_BINDINGS[@]}\""
  "bindings-vmm|20|per-call latency of the driver's VMM calls and the backend's map/unmap: gpu_vmm.py --pages 64|gpu_vmm_quick.json|python3 benchmarks/gpu_vmm.py \"\${QUICK_VMM[@]}\" --out \"\$results/gpu_vmm_quick.json\""
  "identity|165|token identity with DynamicCache, greedy / beams (3, 2 returned) / sampling (3 returned) x fp16 / bf16 (sdpa) on a SmolLM2-shaped llama (30 layers x 3 KV heads x 64, ~91 tokens a 2 MiB page; 150 + 130 tokens, rows over 2-4 pages), then pages given back after generate||quick_pytest identity -m gpu \"\${QUICK_IDENTITY[@]}\""
  "table|135|decode table: gpu_generate.py, vkv vs DynamicCache vs StaticCache (no compile), 1k and 4k tokens x batch 1 and 8, 128 new tokens, bf16, SmolLM2's shape: decode tokens/s, KV bytes, mapping share, token identity|gpu_generate_quick.json|python3 benchmarks/gpu_generate.py \"\${QUICK_TABLE[@]}\" --json \"\$results/gpu_generate_quick.json\""
  "cpu-unit|35|the fake-driver / CPU tests of the CUDA path (tests/unit/test_cuda_*.py) on this torch and transformers||quick_pytest cpu-unit \"\${QUICK_CPU_UNIT[@]}\""
)
QUICK_CPU_PARTS=(
  "preflight-collect|60|the quick stage's pytest selections resolve (collect-only: the bindings, identity and fake-driver tests)||python3 -m pytest -q --collect-only -p no:cacheprovider \"\${QUICK_BINDINGS[@]}\" \"\${QUICK_IDENTITY[@]}\" \"\${QUICK_CPU_UNIT[@]}\""
  "preflight-table|40|the decode table's arguments parse and name its cells: gpu_generate.py --dry-run||python3 benchmarks/gpu_generate.py \"\${QUICK_TABLE[@]}\" --json \"\$results/gpu_generate_quick.json\" --dry-run"
  "preflight-vmm|40|gpu_vmm.py imports and parses its arguments, then stops for want of a GPU||quick_expect_no_gpu python3 benchmarks/gpu_vmm.py \"\${QUICK_VMM[@]}\" --out \"\$results/gpu_vmm_quick.json\""
  "cpu-unit|120|the fake-driver / CPU tests of the CUDA path (tests/unit/test_cuda_*.py)||quick_pytest cpu-unit \"\${QUICK_CPU_UNIT[@]}\""
)
QUICK_SKIPPED_WITHOUT_GPU=(bindings bindings-vmm identity table)

quick_pytest() {  # NAME ARGS...: pytest with each test's outcome appended to $progress as it ends
  local name=$1; shift
  PYTHONPATH="$PWD/tests/gpu:$PYTHONPATH" GPU_CHECK_PROGRESS="$progress" \
    python3 -m pytest -q -rs -p no:cacheprovider -p gpu_check_report "$@"
}

quick_expect_no_gpu() {  # CMD...: passes when CMD exits 1 saying it needs a CUDA GPU (its imports and arguments are fine)
  local out rc
  out=$("$@" 2>&1); rc=$?
  echo "$out"
  [[ $rc == 1 && "$out" == *"needs a CUDA GPU"* ]]
}

quick_plan() {  # MODE: "MODE NAME BUDGET WHAT" per part, in the order they run
  local mode=$1 spec name budget what writes rest
  local -n specs=$2
  for spec in "${specs[@]}"; do
    IFS='|' read -r name budget what writes rest <<<"$spec"
    printf '%s\t%s\t%s\t%s\n' "$mode" "$name" "$budget" "$what"
  done
}

quick_stage() {
  if [[ "${1:-}" == --plan ]]; then
    quick_plan device QUICK_DEVICE_PARTS
    quick_plan cpu QUICK_CPU_PARTS
    printf 'budget\t%s\n' "${QUICK_BUDGET:-400}"
    return 0
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  results="${GPU_CHECK_RESULTS:-benchmarks/results}"
  mkdir -p "$results"
  local budget="${QUICK_BUDGET:-400}" start=$SECONDS report="$results/gpu_check_quick.json"
  local log="$results/gpu_check_quick.log" scratch rc=0
  scratch=$(mktemp -d)
  local logs=("$log")
  if [[ -n "${OUT:-}" ]]; then mkdir -p "$OUT"; logs+=("$OUT/gpu_check_quick.log"); fi
  : >"$log"
  exec 3>&1 4>&2
  exec > >(tee -a "${logs[@]}") 2>&1  # the log reaches $OUT as it is written
  local tee_pid=$!

  local probe device mode
  [[ -n "${GPU_CHECK_FORCE_MODE:-}" ]] && probe="$GPU_CHECK_FORCE_MODE|torch not asked" ||
  probe=$(timeout 60 python3 - <<'PY' 2>/dev/null
import importlib.util
import torch
if not torch.cuda.is_available():
    print("cpu|torch.cuda.is_available() is False")
else:
    try:
        bindings = importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:
        bindings = False
    print(f"device|{torch.cuda.get_device_name()}, torch {torch.__version__}, cuda-bindings {'found' if bindings else 'MISSING (the device tests will skip: scripts/gpu_wheels.sh)'}")
PY
  ) || probe="cpu|torch could not be asked (python3 -c 'import torch' failed or hung)"
  mode=${probe%%|*}; device=${probe#*|}
  [[ -n "${GPU_CHECK_FORCE_MODE:-}" ]] && device="$device: mode $mode forced by GPU_CHECK_FORCE_MODE"
  echo "gpu_check quick: $mode mode: $device; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
  echo "gpu_check quick: budget ${budget} s in all, each part bounded by its own timeout; results in $results${OUT:+ and $OUT}"
  python3 tests/gpu/gpu_check_report.py start "$report" "$mode" "$device" "$budget"

  if [[ $mode == device ]]; then local -n parts=QUICK_DEVICE_PARTS; else local -n parts=QUICK_CPU_PARTS; fi
  local wanted=" ${GPU_CHECK_PARTS:-} " spec name part_budget what writes cmd left limit t0 prc files f
  if [[ $mode != device ]]; then
    local skipped=() s
    for spec in "${QUICK_DEVICE_PARTS[@]}"; do
      IFS='|' read -r name part_budget what writes cmd <<<"$spec"
      [[ " ${QUICK_SKIPPED_WITHOUT_GPU[*]} " == *" $name "* ]] || continue
      skipped+=("$name")
      python3 tests/gpu/gpu_check_report.py skip "$report" "$name" "$what" "no CUDA GPU here ($device)"
    done
    echo "gpu_check quick: SKIPPED, no CUDA GPU here ($device): the device parts ${skipped[*]}:"
    for spec in "${QUICK_DEVICE_PARTS[@]}"; do
      IFS='|' read -r name part_budget what writes cmd <<<"$spec"
      [[ " ${skipped[*]} " == *" $name "* ]] && echo "  - $name: $what"
    done
    echo "gpu_check quick: running the CPU-side parts only"
  fi
  for spec in "${parts[@]}"; do
    IFS='|' read -r name part_budget what writes cmd <<<"$spec"
    if [[ -n "${GPU_CHECK_PARTS:-}" && "$wanted" != *" $name "* ]]; then
      python3 tests/gpu/gpu_check_report.py skip "$report" "$name" "$what" "not in GPU_CHECK_PARTS"
      echo "== $name: skipped (not in GPU_CHECK_PARTS)"; continue
    fi
    left=$(( budget - (SECONDS - start) - 10 ))
    limit=$(( part_budget < left ? part_budget : left ))
    if (( limit < 5 )); then
      python3 tests/gpu/gpu_check_report.py skip "$report" "$name" "$what" "no time left in the stage's ${budget} s"
      echo "== $name: SKIPPED, no time left in the stage's ${budget} s"; continue
    fi
    echo "== $name (timeout ${limit} s): $what"
    progress="$scratch/$name.jsonl"
    t0=$SECONDS
    timeout -s INT -k 10 "$limit" bash -c "$(declare -p QUICK_IDENTITY QUICK_BINDINGS QUICK_CPU_UNIT QUICK_TABLE QUICK_VMM)
      $(declare -f quick_pytest quick_expect_no_gpu); results='$results'; progress='$progress'; $cmd"
    prc=$?
    (( prc == 124 || prc == 137 )) && echo "== $name: TIMED OUT after ${limit} s (what it measured is kept)"
    files=()
    for f in $writes; do files+=("$results/$f"); done
    python3 tests/gpu/gpu_check_report.py part "$report" "$name" "$what" "$part_budget" "$limit" \
      "$(( SECONDS - t0 ))" "$prc" "$progress" "${files[@]}"
    (( prc != 0 && rc == 0 )) && rc=$prc
    if [[ -n "${OUT:-}" ]]; then cp "$report" "${files[@]}" "$OUT/" 2>/dev/null; fi
  done
  python3 tests/gpu/gpu_check_report.py finish "$report" "$rc" "$(( SECONDS - start ))"
  [[ -n "${OUT:-}" ]] && cp "$report" "$OUT/"
  echo "gpu_check quick: $mode mode, exit $rc after $(( SECONDS - start )) s; $report"
  rm -rf "$scratch"
  exec 1>&3 2>&4 3>&- 4>&-
  wait "$tee_pid" 2>/dev/null  # the log complete before the device tool collects $OUT
  return "$rc"
}

if [[ "$stage" == quick ]]; then
  quick_stage "${@:2}"
  exit $?
fi
if [[ "$stage" == list || ! "$stage" =~ ^[1-7]$ ]]; then
  sed -n '2,37p' "$0"; exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
results=benchmarks/results
mkdir -p "$results"
log="$results/gpu_check_stage$stage.log"
xml="$results/gpu_check_stage$stage.xml"
limit="${STAGE_TIMEOUT:-530}"
if [[ "$stage" == 7 ]] && (( limit > 170 )); then limit=170; fi  # stage 7 stays under 3 minutes
pytest_gpu() { timeout "$limit" python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$xml" "$@"; }

start=$(date +%s)
{
  echo "stage $stage on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
  case "$stage" in
    1) pytest_gpu tests/unit/test_cuda_dlpack.py tests/unit/test_cuda_driver_rules.py tests/unit/test_cuda_memory.py \
         tests/unit/test_cuda_backend.py tests/gpu/test_gpu_backend.py -m "gpu or not gpu"
       rc=$?
       timeout 120 python3 benchmarks/gpu_vmm.py --pages 256 --out "$results/gpu_vmm.json" || rc=$((rc ? rc : $?)) ;;
    2) pytest_gpu -m gpu tests/gpu/test_gpu_generate.py tests/gpu/test_gpu_reuse.py; rc=$? ;;
    3) pytest_gpu -m gpu tests/gpu/test_gpu_state_machine.py tests/gpu/test_gpu_sanitizer.py; rc=$? ;;
    4) timeout "$limit" python3 benchmarks/gpu_generate.py --model smollm2-random --contexts 1024 4096 \
         --batches 1 8 32 --repeats 2 --new-tokens 512 --beam-context 0 --json "$results/gpu_generate_short.json"
       rc=$? ;;
    5) timeout "$limit" python3 benchmarks/gpu_generate.py --model smollm2-random --contexts 16384 \
         --batches 1 8 32 --repeats 1 --new-tokens 512 --beam-context 4096 --beam-new-tokens 128 \
         --json "$results/gpu_generate_long.json"
       rc=$? ;;
    6) pytest_gpu -m gpu tests/gpu/test_gpu_static.py; rc=$? ;;
    7) pytest_gpu tests/unit/test_cuda_share.py tests/gpu/test_gpu_share.py -m "gpu or not gpu"; rc=$? ;;
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
    7) cp "$results/gpu_share.json" "$OUT/" 2>/dev/null ;;
  esac
fi
exit "$rc"

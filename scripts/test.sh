#!/usr/bin/env bash
# Installs everything, then runs the whole test suite offline: once on the installed (newest)
# transformers, then the integration tests again on transformers 5.17, the oldest we support, and
# the architecture table (tests/integration/test_breadth.py, ~1 minute) on 5.20.2, a release between
# whose models differ from both ends'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -m pytest -q "$@"
OLD=${HF_VKV_OLD_TRANSFORMERS_DIR:-/tmp/hf_vkv_transformers_5_17}
if [ ! -d "$OLD/transformers" ]; then
    # 5.17 needs huggingface-hub < 2 (and with it httpx); they go beside it, not over the main install.
    "$PY" -m pip install -q --no-deps --target "$OLD" "transformers==5.17.0" "huggingface-hub==1.33.0" \
        "httpx==0.28.1" "httpcore==1.0.9" anyio h11 certifi idna sniffio
fi
if [ -n "$(find tests -name 'test_*.py' -exec grep -l 'pytest.mark.integration' {} +)" ]; then
    PYTHONPATH="$OLD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -m integration "$@"
fi
MID=${HF_VKV_MID_TRANSFORMERS_DIR:-/tmp/hf_vkv_transformers_5_20}
if [ $# -eq 0 ]; then  # (a run of chosen tests leaves it out)
    if [ ! -d "$MID/transformers" ]; then
        "$PY" -m pip install -q --no-deps --target "$MID" "transformers==5.20.2"  # its hub is the main install's
    fi
    PYTHONPATH="$MID${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q tests/integration/test_breadth.py
fi

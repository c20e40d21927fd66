"""A chat through transformers' server: stock ``transformers serve`` against ``hf-vkv serve``
(and ``--continuous-batching`` where it runs), time to first token per turn, with the ``openai``
client, streaming, greedy.

Each server runs alone in a subprocess on 127.0.0.1 with ``--threads`` intra-op threads (started,
played one chat of ``--turns`` turns over a ``--system-tokens`` system prompt, stopped), the
client in this process. A turn's TTFT is the time from the request to the first streamed chunk
with text. The reference the issue sets is computed here, in process, on the same model and
threads: a DynamicCache holding the conversation so far (the previous turn's cache, cut to the
tokens the new prompt shares with it), continued over the turn's new tokens - transformers'
documented idiom for reusing a cache by hand (``dynamic_continued``); its TTFT is the model's work
only (no HTTP, template or tokenizer), so the servers' ratios to it include what serving adds.
Every server's answers are compared with stock serve's (text, per turn). ``vkv_in_process``: the
same turns through ``generate(cache_implementation="vkv")`` with a prefix store in this process,
so a server's TTFT splits into vkv's (``vkv_in_process`` against ``dynamic_continued``) and the
server's (``serving_s``: the server's TTFT less ``vkv_in_process``'s: HTTP, the request's
validation, the chat template and tokenizer over the whole history, the hop to the inference
thread, the streamer). The two in-process columns run right after each turn of ``hf-vkv serve``
(interleaved per turn, the same conversation), so the machine's drift falls on all three alike.
Each timed call (a server's request, an in-process column's turn) starts ``--settle-s`` seconds
after the previous call in this process ended: torch's intra-op threads spin-wait after a burst of
work (at two threads on this machine, ~10 ms of CPU burnt over the 20-100 ms after a 512 x 512
matmul, ~0.1 ms with ``OMP_WAIT_POLICY=PASSIVE``), and without the pause the previous call's
spinning threads, in this process or in the server's, took the cores the next call needs (a chat's
next request comes after its user reads and types; this client does torch work between requests
only for the columns it measures). ``--settle-s 0`` runs the calls back to back.
``--servers ... vkv_dir``: ``hf-vkv serve --prefix-dir`` over the system prompt saved once before
any server starts (``save_system_prompt``, what ``hf-vkv prefix save`` runs; ``prefix_dir_saved``):
a fresh server whose first turn reuses the saved pages, mapped.

    HF_HUB_OFFLINE=1 python benchmarks/serve_chat.py --turns 20 --system-tokens 2048 --threads 1 2 \\
        --json benchmarks/results/serve_chat.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from hf_vkv.ab.harness import describe_environment
from hf_vkv.cli_prefix import save_system_prompt
from hf_vkv.default_model import default_model_dir, load_default_model
from hf_vkv.generate import cache_kwarg
from common import write_report
from prefix_reuse import USER_TURNS, long_text

SERVERS = {
    "stock": ("transformers serve", "from transformers.cli.transformers import app; app(['serve', *sys.argv[2:]])"),
    "vkv": ("hf-vkv serve", "from hf_vkv.cli import main; sys.exit(main(['serve', *sys.argv[2:]]))"),
    # a fresh server whose store starts from the system prompt saved once (`hf-vkv prefix save`): turn 1 too reuses
    "vkv_dir": ("hf-vkv serve --prefix-dir", "import os; from hf_vkv.cli import main; "
                "sys.exit(main(['serve', '--prefix-dir', os.environ['HF_VKV_BENCH_PREFIX_DIR'], *sys.argv[2:]]))"),
    "cb": ("transformers serve --continuous-batching",
           "from transformers.cli.transformers import app; app(['serve', '--continuous-batching', *sys.argv[2:]])"),
}
STARTUP_S = 180
PREFIX_DIR_VAR = "HF_VKV_BENCH_PREFIX_DIR"  # the folder the vkv_dir server starts from


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, code: str, argv: list[str], *, threads: int, port: int) -> subprocess.Popen:
    """``python -c code *argv`` with ``threads`` OpenMP threads, once it answers ``/health`` on
    ``port`` (``name`` in the errors: it exited, or did not answer within ``STARTUP_S``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{name} did not answer within {STARTUP_S} s")


def _start(kind: str, model_dir: str, threads: int, port: int) -> subprocess.Popen:
    code = f"import sys, torch; torch.set_num_threads(int(sys.argv[1])); {SERVERS[kind][1]}"
    return start_server(SERVERS[kind][0], code, [str(threads), model_dir, "--host", "127.0.0.1", "--port", str(port)],
                        threads=threads, port=port)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


class ServerChat:
    """One server in a subprocess and one chat through it with the ``openai`` client: per turn the
    TTFT, the whole turn's time and the answer (streaming, greedy)."""

    def __init__(self, kind: str, model_dir: str, *, threads: int, new_tokens: int) -> None:
        import openai

        self.kind, self.model_dir, self.new_tokens = kind, model_dir, new_tokens
        port = free_port()
        started = time.perf_counter()
        self.proc = _start(kind, model_dir, threads, port)
        self.startup_s = time.perf_counter() - started
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600,
                                    max_retries=0)

    def turn(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        start = time.perf_counter()
        first = None
        parts = []
        for chunk in self.client.chat.completions.create(model=self.model_dir, messages=messages, stream=True,
                                                         temperature=0, max_tokens=self.new_tokens):
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                first = first if first is not None else time.perf_counter() - start
                parts.append(text)
        return {"ttft_s": first, "turn_s": time.perf_counter() - start, "answer": "".join(parts)}

    def stop(self) -> None:
        _stop(self.proc)


def _ids(tok: Any, messages: list[dict[str, str]], *, prompt: bool) -> torch.Tensor:
    """``[1, T]`` ids of the conversation: as a request's prompt (``prompt``: the generation
    prompt added), or with the last answer as it goes into the next turn's cache."""
    return tok.apply_chat_template(messages, add_generation_prompt=prompt, return_tensors="pt",
                                   return_dict=True)["input_ids"]


class DynamicContinued:
    """The reference: per turn, the TTFT of a DynamicCache holding the conversation so far,
    continued (the previous turn's cache deep-copied and cut to the shared tokens outside the timed
    call)."""

    def __init__(self, model: Any, tok: Any) -> None:
        self.model, self.tok = model, tok
        self.previous: list[int] = []
        self.cache: Any = None

    def turn(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        from transformers import DynamicCache

        ids = _ids(self.tok, messages, prompt=True)
        prompt = ids[0].tolist()
        shared = 0
        while shared < min(len(prompt), len(self.previous)) and prompt[shared] == self.previous[shared]:
            shared += 1
        shared = min(shared, len(prompt) - 1)
        if self.cache is None or not shared:
            shared = 0
        held = DynamicCache(config=self.model.config)
        if shared:
            held = copy.deepcopy(self.cache)
            held.crop(shared - held.get_seq_length())  # transformers 5.24: tokens to remove, as a negative count
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(): held},
                                  max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
        ttft = time.perf_counter() - start
        self.cache = out.past_key_values
        return {"ttft_s": ttft, "new_tokens": len(prompt) - shared, "prompt_tokens": len(prompt)}

    def answered(self, messages: list[dict[str, str]]) -> None:
        """The conversation's cache for the next turn: the last prompt and the answer the server gave."""
        full = _ids(self.tok, messages, prompt=False)
        self.model.generate(full, attention_mask=torch.ones_like(full), **{cache_kwarg(): self.cache},
                            max_new_tokens=1, do_sample=False)
        self.previous = full[0].tolist()


class VkvInProcess:
    """Per turn: the TTFT of ``generate(cache_implementation="vkv")`` with a prefix store holding
    the conversation so far: what vkv costs without the server, beside :class:`DynamicContinued`."""

    def __init__(self, model: Any, tok: Any) -> None:
        from hf_vkv import PrefixStore

        self.model, self.tok = model, tok
        self.store = PrefixStore(model.config, budget_bytes=1 << 30)

    def _generate(self, ids: torch.Tensor) -> None:
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                            cache_implementation="vkv", cache_config={"prefix_store": self.store})

    def turn(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        ids = _ids(self.tok, messages, prompt=True)
        start = time.perf_counter()
        self._generate(ids)
        return {"ttft_s": time.perf_counter() - start}

    def answered(self, messages: list[dict[str, str]]) -> None:
        """The answer into the store, as the server's request inserts it."""
        self._generate(_ids(self.tok, messages, prompt=False))


def play(kind: str, model_dir: str, *, threads: int, system: str, turns: int, new_tokens: int,
         beside: list[Any] = (), settle_s: float = 0.0) -> dict[str, Any]:
    """One chat through one server; after each of its turns, the same turn of each of ``beside``
    (the in-process columns: interleaved per turn, so that the machine's drift falls on all of them
    alike), each timed call ``settle_s`` after the last call ended. Returns the server's result,
    with ``beside[i]``'s turns under ``beside_turns[i]``."""
    chat = ServerChat(kind, model_dir, threads=threads, new_tokens=new_tokens)
    messages = [{"role": "system", "content": system}]
    rows: list[dict[str, Any]] = []
    others: list[list[dict[str, Any]]] = [[] for _ in beside]
    try:
        for turn in range(turns):
            messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
            time.sleep(settle_s)
            rows.append({"turn": turn + 1, **chat.turn(messages)})
            for column, out in zip(beside, others):
                time.sleep(settle_s)
                out.append({"turn": turn + 1, **column.turn(messages)})
            messages.append({"role": "assistant", "content": rows[-1]["answer"]})
            for column in beside:
                column.answered(messages)
            print(f"  {kind} {threads}t turn {turn + 1}: TTFT {rows[-1]['ttft_s']:.3f} s", file=sys.stderr,
                  flush=True)
    except Exception as exc:  # a server that cannot run the chat (CB on this machine): recorded, not fatal
        return {"server": SERVERS[kind][0], "error": f"{type(exc).__name__}: {exc}"[:2000], "turns": rows}
    finally:
        chat.stop()
    return {"server": SERVERS[kind][0], "startup_s": chat.startup_s, "turns": rows, "beside_turns": others}


def _median_play(plays: list[dict[str, Any]]) -> dict[str, Any]:
    """The first chat's answers, each turn's median TTFT over the chats (each chat's in ``ttft_runs_s``)."""
    result = dict(plays[0])
    result.pop("beside_turns", None)
    if len(plays) == 1 or any("error" in p for p in plays):
        return result
    result["turns"] = [{**row, "ttft_runs_s": [p["turns"][i]["ttft_s"] for p in plays],
                        "ttft_s": statistics.median(p["turns"][i]["ttft_s"] for p in plays),
                        "answers_agree_across_runs": len({p["turns"][i]["answer"] for p in plays}) == 1}
                       for i, row in enumerate(plays[0]["turns"])]
    return result


def _median_beside(plays: list[dict[str, Any]], column: int) -> list[dict[str, Any]]:
    """Column ``column`` of the plays' in-process turns: per turn the median over the plays."""
    runs = [p["beside_turns"][column] for p in plays]
    return [{**runs[0][i], "ttft_runs_s": [r[i]["ttft_s"] for r in runs],
             "ttft_s": statistics.median(r[i]["ttft_s"] for r in runs)} for i in range(len(runs[0]))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=16, help="max_tokens per answer (default: %(default)s)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--servers", nargs="+", choices=sorted(SERVERS), default=["stock", "vkv", "cb"])
    parser.add_argument("--repeats", type=int, default=1, help="chats per server (a fresh server and fresh in-process "
                        "columns each); the median per turn (default: %(default)s)")
    parser.add_argument("--settle-s", type=float, default=0.05, help="pause before each timed call, so that the "
                        "last call's spinning threads are idle (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/serve_chat.json"))
    args = parser.parse_args(argv)
    model, tok = load_default_model()
    model_dir = str(default_model_dir())
    system = long_text(tok, args.system_tokens)
    report: dict[str, Any] = {
        "schema": "hf_vkv.serve_chat/1", "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "environment": describe_environment(), "model": "SmolLM2-135M-Instruct (embedded), float32, CPU",
        "turns": args.turns, "system_tokens": args.system_tokens, "new_tokens": args.new_tokens,
        "settle_s": args.settle_s,
        "method": "each server alone in a subprocess with the given torch threads; the openai client streams a greedy "
                  "chat; TTFT = request to the first chunk with text; dynamic_continued: in process, the same "
                  "threads, a DynamicCache of the conversation so far continued over the turn's new tokens",
        "runs": [],
    }
    if "vkv_dir" in args.servers:  # the system prompt computed once and saved, before any server starts
        folder = tempfile.mkdtemp(prefix="hf_vkv_serve_chat_")
        os.environ[PREFIX_DIR_VAR] = folder
        report["prefix_dir_saved"] = save_system_prompt(model, tok, system, folder)
    hosts = "vkv" if "vkv" in args.servers else args.servers[0]  # the server the in-process columns interleave with
    for threads in args.threads:
        torch.set_num_threads(threads)
        run: dict[str, Any] = {"threads": threads, "servers": {}}
        for kind in args.servers:
            plays = [play(kind, model_dir, threads=threads, system=system, turns=args.turns, new_tokens=args.new_tokens,
                          beside=[DynamicContinued(model, tok), VkvInProcess(model, tok)] if kind == hosts else [],
                          settle_s=args.settle_s)
                     for _ in range(args.repeats)]  # a fresh server and fresh columns per chat
            run["servers"][kind] = _median_play(plays)
            if kind == hosts and not any("error" in p for p in plays):
                run["dynamic_continued"], run["vkv_in_process"] = _median_beside(plays, 0), _median_beside(plays, 1)
        _summarize(run)
        report["runs"].append(run)
        write_report(args.json, report)
    return 0


def _summarize(run: dict[str, Any]) -> None:
    """Per server: answers equal to stock's per turn; TTFT ratios to dynamic_continued and stock."""
    reference = {row["turn"]: row["ttft_s"] for row in run["dynamic_continued"]}
    stock = {row["turn"]: row for row in run["servers"].get("stock", {}).get("turns", [])}
    for name, result in run["servers"].items():
        rows = result.get("turns", [])
        for row in rows:
            row["vs_dynamic_continued"] = row["ttft_s"] / reference[row["turn"]] if row["ttft_s"] else None
            if row["turn"] in stock and stock[row["turn"]]["ttft_s"]:
                row["vs_stock"] = row["ttft_s"] / stock[row["turn"]]["ttft_s"]
                row["answer_equals_stock"] = row["answer"] == stock[row["turn"]]["answer"]
        later = [row["vs_dynamic_continued"] for row in rows if row["turn"] >= 2 and row["vs_dynamic_continued"]]
        in_process = {row["turn"]: row["ttft_s"] for row in run.get("vkv_in_process", [])}
        for row in rows:
            if row["turn"] in in_process and row["ttft_s"]:
                row["serving_s"] = row["ttft_s"] - in_process[row["turn"]]  # the server's share of the turn's TTFT
        result["summary"] = {
            "answers_equal_stock": all(row.get("answer_equals_stock", True) for row in rows) if rows and stock else None,
            "max_vs_dynamic_continued_from_turn_2": max(later) if later else None,
            "median_vs_dynamic_continued_from_turn_2": statistics.median(later) if later else None,
            "turn_10_vs_stock": next((row.get("vs_stock") for row in rows if row["turn"] == 10), None),
            "median_serving_s_from_turn_2": statistics.median(r["serving_s"] for r in rows if r["turn"] >= 2)
            if any("serving_s" in r for r in rows) else None,
        }
    if run.get("vkv_in_process"):
        ratios = [row["ttft_s"] / reference[row["turn"]] for row in run["vkv_in_process"] if row["turn"] >= 2]
        run["vkv_in_process_summary"] = {"max_vs_dynamic_continued_from_turn_2": max(ratios),
                                         "median_vs_dynamic_continued_from_turn_2": statistics.median(ratios)}
        print(f"{run['threads']}t vkv in process: {json.dumps(run['vkv_in_process_summary'])}", file=sys.stderr)
        print(f"{run['threads']}t {name}: {json.dumps(result['summary'])}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

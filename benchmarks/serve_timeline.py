"""Where a chat turn's time goes through ``hf-vkv serve``: the ``openai`` client, HTTP, the chat
template and tokenizer, ``generate``, and the first token's way back, per turn.

    HF_HUB_OFFLINE=1 python benchmarks/serve_timeline.py --threads 1 --turns 12 \\
        --json benchmarks/results/serve_timeline_1t.json

``hf-vkv serve`` runs in a subprocess (the embedded SmolLM2, ``--threads`` intra-op threads) with
places wrapped to write wall-clock times to a log, by a ``sitecustomize`` module on the server's
``PYTHONPATH`` (so that the process transformers >= 5.25 spawns for the model is timed too): an
ASGI middleware around the server's app (the request has arrived), ``apply_chat_template`` (in and
out), vkv's ``prepare_request``, ``GenerationMixin.generate`` (in), the generate streamer's ``put``
(the second put is the first new token) and, since 5.25, the API server's ``Detokenizer.put_token``
(the token has crossed from the model's process). The client in this process sends one chat (streaming, greedy, ``--system-tokens`` of system
prompt, a pause of ``--pause-s`` before each request) and takes the time of each request and of its
first chunk with text; both processes read the same clock (``time.time``). Per turn: send to
arrival, arrival to the template, the template, the template to ``generate``, ``generate`` to the
first token, the token's way to the API server (5.25 on), and on to the client. ``client_only_ms``: the same streaming ``create()``
of the last turn's conversation handed to an in-memory ``httpx`` transport (no server): what the
``openai`` client itself takes before a request leaves it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import write_report  # noqa: E402
from prefix_reuse import USER_TURNS, long_text  # noqa: E402
from serve_chat import free_port, start_server  # noqa: E402

_SITE = r"""
# sitecustomize of the benchmark's server: runs in the server and in every process it spawns
# (transformers >= 5.25 runs the model in a process of its own), and wraps the places timed
import functools, os, time
log = open(os.environ["HF_VKV_TIMELINE_LOG"], "a", buffering=1)


def wrap(owner, name, tag, out=True):
    function = getattr(owner, name, None)
    if function is None:
        return
    @functools.wraps(function)
    def timed(*args, **kwargs):
        log.write(f"{tag}_in {time.time()}\n")
        try:
            return function(*args, **kwargs)
        finally:
            if out:
                log.write(f"{tag}_out {time.time()}\n")
    setattr(owner, name, timed)


from transformers import PreTrainedTokenizerBase
from transformers.generation.utils import GenerationMixin
import transformers.cli.serving.server as server
import transformers.cli.serving.utils as serving_utils
import hf_vkv.generate.serving as vkv_serving

wrap(PreTrainedTokenizerBase, "apply_chat_template", "template")
wrap(vkv_serving, "prepare_request", "prepare")
wrap(GenerationMixin, "generate", "generate", out=False)
# the token's way: made in the model's process (the generate streamer's put; before 5.25 the only
# one) and, since 5.25, read in the API server's (the Detokenizer)
wrap(getattr(serving_utils, "DirectStreamer", getattr(serving_utils, "_TokenStreamer", None)), "put", "put", out=False)
wrap(getattr(serving_utils, "Detokenizer", None), "put_token", "received", out=False)
build = server.build_server


class Arrival:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            log.write(f"arrive {time.time()}\n")
        await self.app(scope, receive, send)


def build_server(*args, **kwargs):
    app = build(*args, **kwargs)
    app.add_middleware(Arrival)
    return app


server.build_server = build_server
"""
_SERVER = "import sys; from hf_vkv.cli import main; sys.exit(main(['serve', sys.argv[2], '--host', '127.0.0.1', '--port', sys.argv[1]]))"


def _phases(sent: float, first: float, events: list[tuple[str, float]]) -> dict[str, float | None]:
    """Milliseconds of each phase of one turn from the server's events after ``sent``."""
    at: dict[str, list[float]] = {}
    for name, t in events:
        at.setdefault(name, []).append(t)

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((b - a) * 1e3, 2)

    first_of = lambda name: at[name][0] if name in at else None  # noqa: E731
    token = at["put_in"][1] if len(at.get("put_in", [])) > 1 else None  # the first put is the prompt
    return {"ttft_ms": ms(sent, first), "send_to_arrival_ms": ms(sent, first_of("arrive")),
            "arrival_to_template_ms": ms(first_of("arrive"), first_of("template_in")),
            "template_ms": round(sum(b - a for a, b in zip(at.get("template_in", []), at.get("template_out", [])))
                                 * 1e3, 2),
            "template_to_generate_ms": ms(at["template_out"][-1] if "template_out" in at else None,
                                          first_of("generate_in")),
            "generate_to_first_token_ms": ms(first_of("generate_in"), token),
            # since 5.25 the token crosses from the model's process to the API server's (absent before)
            "token_to_api_server_ms": ms(token, first_of("received_in")),
            "first_token_to_client_ms": ms(first_of("received_in") or token, first)}


def _client_only_ms(messages: list[dict[str, str]], repeats: int = 20) -> list[float]:
    """Milliseconds from a streaming ``create()`` to its request reaching an in-memory transport."""
    import openai

    try:
        import httpx
    except ImportError:  # the openai package's own fork of it, where that is what is installed
        import httpx2 as httpx
    reached: list[float] = []
    body = (b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
            b'"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n')

    def handler(request: Any) -> Any:
        reached.append(time.perf_counter())
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="unused",
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _chunk in client.chat.completions.create(model="m", messages=messages, stream=True, temperature=0,
                                                     max_tokens=16):
            pass
        out.append(round((reached[-1] - start) * 1e3, 2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--pause-s", type=float, default=0.3, help="pause before each request (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/serve_timeline.json"))
    args = parser.parse_args(argv)
    import openai
    import torch

    from hf_vkv.ab.harness import describe_environment
    from hf_vkv.default_model import default_model_dir, load_default_model

    torch.set_num_threads(args.threads)
    _, tok = load_default_model()
    model_dir = str(default_model_dir())
    log = tempfile.NamedTemporaryFile(prefix="hf_vkv_serve_timeline_", suffix=".log", delete=False).name
    port = free_port()
    site = tempfile.mkdtemp(prefix="hf_vkv_serve_timeline_")
    Path(site, "sitecustomize.py").write_text(_SITE)
    outer = {name: os.environ.get(name) for name in ("PYTHONPATH", "HF_VKV_TIMELINE_LOG")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, outer["PYTHONPATH"]) if p)
    os.environ["HF_VKV_TIMELINE_LOG"] = log
    try:
        proc = start_server("hf-vkv serve", _SERVER, [str(port), model_dir], threads=args.threads, port=port)
    finally:
        for name, value in outer.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0)
    messages = [{"role": "system", "content": long_text(tok, args.system_tokens)}]
    turns: list[tuple[float, float]] = []
    try:
        for turn in range(args.turns):
            messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
            time.sleep(args.pause_s)
            sent, first, parts = time.time(), None, []
            for chunk in client.chat.completions.create(model=model_dir, messages=messages, stream=True,
                                                        temperature=0, max_tokens=16):
                text = chunk.choices[0].delta.content if chunk.choices else None
                if text:
                    first = first if first is not None else time.time()
                    parts.append(text)
            turns.append((sent, first))
            messages.append({"role": "assistant", "content": "".join(parts)})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with open(log) as f:
        events = [(name, float(t)) for name, t in (line.split() for line in f)]
    os.unlink(log)
    rows = []
    for i, (sent, first) in enumerate(turns):
        until = turns[i + 1][0] if i + 1 < len(turns) else float("inf")
        rows.append({"turn": i + 1, **_phases(sent, first, [(n, t) for n, t in events if sent <= t < until])})
    later = rows[1:]
    medians = {key: statistics.median(r[key] for r in later if r[key] is not None)
               for key in later[0] if key.endswith("_ms")} if later else {}
    client_only = _client_only_ms(messages[:-1])
    report = {"schema": "hf_vkv.serve_timeline/1", "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
              "environment": describe_environment(), "model": "SmolLM2-135M-Instruct (embedded), float32, CPU",
              "threads": args.threads, "system_tokens": args.system_tokens, "pause_s": args.pause_s,
              "turns": rows, "medians_from_turn_2": medians, "client_only_ms": client_only,
              "client_only_median_ms": statistics.median(client_only)}
    write_report(args.json, report)
    print(json.dumps({"medians_from_turn_2": medians, "client_only_median_ms": report["client_only_median_ms"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

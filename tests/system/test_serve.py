"""``hf-vkv serve``: transformers' own server generating with vkv and one prefix store per model,
talked to by real clients (the ``openai`` package, ``transformers chat``) over 127.0.0.1.

Two servers on the embedded SmolLM2, both started here in subprocesses and stopped at the end
(bounded in time): ``hf-vkv serve`` and stock ``transformers serve``, the reference: every greedy or
seeded answer through vkv's server must be the stock server's text. Each model runs in a process
of its own that the server spawns (transformers >= 5.25); the tests read its prefix store through
the server's ``GET /v1/vkv/stores``, which checks the store's invariants before it counts.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402

if Version(transformers.__version__) < Version("5.25"):
    pytest.skip("hf-vkv serve needs transformers >= 5.25 (its server runs each model in a process of its own)",
                allow_module_level=True)

from hf_vkv import PrefixStats, PrefixStore  # noqa: E402
from hf_vkv.default_model import default_model_dir, load_default_model  # noqa: E402
from hf_vkv.generate import serving  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STARTUP_S = 120  # a server that does not answer /health by then fails the test
REQUEST_S = 120  # per request
SYSTEM = ("You are the assistant of a small bakery. The bakery opens at seven and closes at six. It sells bread, "
          "croissants, cakes and coffee. Answer in one short sentence. ") * 3
QUESTIONS = ["When do you open?", "What do you sell?", "Is there coffee?", "When do you close?"]
STORE_MIB = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(base: str, deadline: float, proc: subprocess.Popen | None = None) -> None:
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} did not answer /health within {STARTUP_S} s")


@pytest.fixture(scope="module")
def model_dir() -> str:
    load_default_model()  # converts the embedded GGUF on first use
    return str(default_model_dir())


@contextlib.contextmanager
def _server(code: str, args: list[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[str]:
    """``python -c code *args --host 127.0.0.1 --port P`` on a free port (one intra-op thread, offline;
    ``env`` over this process's, less vkv's serve variables), its base URL once it answers
    ``/health``; stopped on leaving. Its stderr goes to ``log`` when given."""
    port = _free_port()
    inherited = {k: v for k, v in os.environ.items() if k not in (serving.STORE_BYTES_ENV, serving.PREFIX_DIR_ENV)}
    with open(log or os.devnull, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *args, "--host", "127.0.0.1", "--port", str(port)],
                                env={**inherited, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, time.monotonic() + STARTUP_S, proc)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@contextlib.contextmanager
def _serving(model_dir: str, *, prefix_dir: Path | None = None, log: Path | None = None,
             serve_options: tuple[str, ...] = ()) -> Iterator[dict]:
    """``hf-vkv serve`` in a subprocess (see :func:`_server`), its store of ``STORE_MIB``;
    ``serve_options`` (transformers serve's) come first on its command line, before vkv's own."""
    args = ["serve", *serve_options, "--prefix-store-mib", str(STORE_MIB)]
    if prefix_dir is not None:
        args += ["--prefix-dir", str(prefix_dir)]
    code = "import sys; from hf_vkv.cli import main; sys.exit(main(sys.argv[1:]))"
    with _server(code, [*args, model_dir], log=log) as base:
        yield {"base": base, "model": model_dir}


@pytest.fixture(scope="module")
def vkv_server(model_dir: str) -> Iterator[dict]:
    with _serving(model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def stock_server(model_dir: str) -> Iterator[str]:
    """Stock ``transformers serve`` in a subprocess (no hf_vkv imported), one intra-op thread as ``hf-vkv serve``."""
    code = ("import sys, torch; torch.set_num_threads(1); from transformers.cli.transformers import app; "
            "app(sys.argv[1:])")
    with _server(code, ["serve", model_dir]) as base:
        yield base


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=REQUEST_S, max_retries=0)


def _store(server: dict) -> PrefixStats:
    """The served model's store as ``GET /v1/vkv/stores`` answers it (counted after its invariants
    were checked in the model's process: an HTTP error otherwise)."""
    with urllib.request.urlopen(f"{server['base']}{serving.STORES_ROUTE}", timeout=REQUEST_S) as response:
        data = json.loads(response.read())["data"]
    (entry,) = [d for d in data if d["model"].startswith(server["model"])]
    return PrefixStats(**entry["store"])


def _chat(base: str, model: str, questions: list[str], *, stream: bool = False, **options) -> list[str]:
    """A multi-turn chat: each answer goes back into the history before the next question."""
    client = _client(base)
    messages = [{"role": "system", "content": SYSTEM}]
    answers = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        if stream:
            parts = client.chat.completions.create(model=model, messages=messages, stream=True, **options)
            answer = "".join(chunk.choices[0].delta.content or "" for chunk in parts if chunk.choices)
        else:
            answer = client.chat.completions.create(model=model, messages=messages, **options).choices[0].message.content
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers


def test_greedy_chat_is_stock_serves_text_and_each_turn_reuses(vkv_server, stock_server, model_dir):
    before = _store_after_first_request(vkv_server, model_dir)
    ours = _chat(vkv_server["base"], model_dir, QUESTIONS, temperature=0, max_tokens=12)
    stock = _chat(stock_server, model_dir, QUESTIONS, temperature=0, max_tokens=12)
    assert ours == stock
    after = _store(vkv_server)
    assert after.lookups - before.lookups == len(QUESTIONS)
    # from turn 2 on, the history up to the last answer is in the store
    assert after.hits - before.hits >= len(QUESTIONS) - 1
    assert after.prompt_tokens_computed - before.prompt_tokens_computed < (after.prompt_tokens - before.prompt_tokens) / 2


def _store_after_first_request(vkv_server: dict, model_dir: str) -> PrefixStats:
    _client(vkv_server["base"]).chat.completions.create(
        model=model_dir, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    return _store(vkv_server)


def test_streaming_seeded_sampling_stop_strings_and_max_tokens_match_stock(vkv_server, stock_server, model_dir):
    questions = QUESTIONS[:2]
    for options in ({"temperature": 0, "max_tokens": 10},
                    {"temperature": 0.8, "max_tokens": 10, "seed": 7},
                    {"temperature": 0, "max_tokens": 24, "stop": ["."]}):
        extra = {"extra_body": {"seed": options.pop("seed")}} if "seed" in options else {}
        ours = _chat(vkv_server["base"], model_dir, questions, stream=True, **options, **extra)
        stock = _chat(stock_server, model_dir, questions, stream=True, **options, **extra)
        assert ours == stock, options
        assert ours == _chat(vkv_server["base"], model_dir, questions, **options, **extra), "streamed != whole"
    assert _store(vkv_server).lookups > 0  # (its invariants checked as it counts)


def test_beam_search_through_a_generation_config_matches_stock(vkv_server, stock_server, model_dir):
    """Chat completions refuse ``n``; beams come through a request's generation_config (non-streaming:
    generate streams only one row), and prefill once computes the prompt once for them."""
    config = json.dumps({"num_beams": 3, "do_sample": False, "max_new_tokens": 8})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]

    def ask(base: str) -> str:
        return _client(base).chat.completions.create(
            model=model_dir, messages=messages, extra_body={"generation_config": config}).choices[0].message.content

    assert ask(vkv_server["base"]) == ask(stock_server)


def test_a_server_started_from_a_saved_system_prompt_reuses_it_from_its_first_request(
        stock_server, model_dir, tmp_path: Path, monkeypatch, capsys):
    """``hf-vkv serve --prefix-dir``: the system prompt saved once (``hf-vkv prefix save``) is
    mapped into a fresh server's store, so its very first request prefills only the user's turn;
    a folder saved for another model is not loaded (one warning), and that server answers alike."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import tiny

    import torch

    from hf_vkv.cli_prefix import save_system_prompt, system_ids

    model, tok = load_default_model()
    saved = save_system_prompt(model, tok, SYSTEM, tmp_path / "system")
    other, ids = tiny("llama"), torch.tensor([[5, 6, 7, 8, 9, 10]])
    kept = PrefixStore(other.config)  # a store of another model
    other.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                   cache_implementation="vkv", cache_config={"prefix_store": kept})
    kept.save(tmp_path / "other", model=other)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]

    def ask(base: str) -> str:
        return _client(base).chat.completions.create(model=model_dir, messages=messages, temperature=0,
                                                     max_tokens=12).choices[0].message.content

    stock = ask(stock_server)
    with _serving(model_dir, prefix_dir=tmp_path / "system") as server:
        assert _store(server).entries == 1  # mapped as the model's process started, before any request
        assert ask(server["base"]) == stock
        stats = _store(server)
        assert stats.lookups == stats.hits == 1
        assert stats.tokens_reused >= len(system_ids(tok, SYSTEM)) - 1 == saved["tokens"] - 1
        assert stats.prompt_tokens_computed < stats.prompt_tokens - saved["tokens"] + 2
    # a folder saved for another model: not loaded (one warning, in the server's log), answers alike
    log = tmp_path / "other.log"
    with _serving(model_dir, prefix_dir=tmp_path / "other", log=log) as server:
        assert ask(server["base"]) == stock
        assert _store(server).tokens_reused == 0
    assert re.search("was not loaded for .*PrefixMismatchError.*served without it", log.read_text())
    # a folder over the store's budget (hf-vkv serve's own check refuses it; transformers' server
    # started with the folder in its environment): its entry goes as it loads, and the server says so
    log = tmp_path / "budget.log"
    code = ("import sys; from hf_vkv.generate.registry import register_serving; register_serving(); "
            "from transformers.cli.transformers import app; app(sys.argv[1:])")
    with _server(code, ["serve", model_dir], log=log,
                 env={serving.PREFIX_DIR_ENV: str(tmp_path / "system"), serving.STORE_BYTES_ENV: str(1 << 20)}) as base:
        assert ask(base) == stock
    assert re.search("holds more than .*store budget of 1 MiB: 1 of its entries were evicted", log.read_text())
    # hf-vkv serve refuses both before it starts a server
    from hf_vkv.cli import main

    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "prefix_store.json").write_text("not an index")
    shutil.copytree(tmp_path / "system", tmp_path / "truncated")
    page_file = tmp_path / "truncated" / "prefix_store.kv"
    page_file.write_bytes(page_file.read_bytes()[:-4096])
    shutil.copytree(tmp_path / "system", tmp_path / "flipped")  # a page's bytes damaged, the size kept
    data = bytearray((tmp_path / "flipped" / "prefix_store.kv").read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 64])
    (tmp_path / "flipped" / "prefix_store.kv").write_bytes(bytes(data))
    for args in (["--prefix-dir", str(tmp_path)], ["--prefix-dir", str(tmp_path / "damaged")],
                 ["--prefix-dir", str(tmp_path / "nowhere")],
                 ["--prefix-dir", str(tmp_path / "truncated")], ["--prefix-dir", str(tmp_path / "flipped")],
                 ["--prefix-store-mib", "1", "--prefix-dir", str(tmp_path / "system")]):
        with pytest.raises(SystemExit) as refused:
            main(["serve", *args, model_dir])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert f"--prefix-dir {args[-1]}" in err
        assert "truncated" not in args[-1] or "PrefixFileCorruptError" in err and "not whole" in err
        assert "flipped" not in args[-1] or "PrefixFileCorruptError" in err and "differs from its checksum" in err
        assert "nowhere" not in args[-1] or "no such folder" in err and "hf-vkv prefix save" in err


def test_the_responses_and_completions_endpoints_match_stock_and_reuse_the_store(vkv_server, stock_server, model_dir):
    """``/v1/responses`` (which this server streams) and ``/v1/completions`` go through the same
    generate as chat completions: the stock server's text, and the second turn of each reuses what
    the first one stored."""
    _store_after_first_request(vkv_server, model_dir)

    def turns(base: str) -> list[str]:
        client = _client(base)

        def respond(items: list[dict]) -> str:
            events = client.responses.create(model=model_dir, input=items, stream=True, temperature=0, max_output_tokens=12)
            return "".join(e.delta for e in events if e.type == "response.output_text.delta")

        def complete(prompt: str) -> str:
            return client.completions.create(model=model_dir, prompt=prompt, temperature=0, max_tokens=10).choices[0].text

        items = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        first = respond(items)
        second = respond([*items, {"role": "assistant", "content": first}, {"role": "user", "content": QUESTIONS[1]}])
        prompt = f"{SYSTEM} Q: {QUESTIONS[0]} A:"
        third = complete(prompt)
        return [first, second, third, complete(f"{prompt}{third} Q: {QUESTIONS[2]} A:")]

    before = _store(vkv_server)
    ours = turns(vkv_server["base"])
    after = _store(vkv_server)
    assert ours == turns(stock_server)
    assert all(ours), ours
    assert after.lookups - before.lookups == 4
    assert after.hits - before.hits >= 2  # each second turn continues its first
    assert after.tokens_reused > before.tokens_reused


def test_a_requests_generation_config_json_with_vkv_options(vkv_server, model_dir):
    _store_after_first_request(vkv_server, model_dir)
    client = _client(vkv_server["base"])

    def ask(config: dict) -> str:
        return client.chat.completions.create(
            model=model_dir, messages=[{"role": "user", "content": QUESTIONS[0]}],
            extra_body={"generation_config": json.dumps(config)}).choices[0].message.content

    shared = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "vkv",
              "cache_config": {"prefill_once": True, "share_prompts": True, "max_tokens": 4096}}
    lookups = _store(vkv_server).lookups
    answer = ask(shared)
    assert answer and _store(vkv_server).lookups == lookups + 1  # the request's own config got the model's store
    # memory options other than the store's: a cache of the request's own (no lookup), same answer
    own = {**shared, "cache_config": {"page_bytes": 64 << 10}}
    assert ask(own) == answer and _store(vkv_server).lookups == lookups + 1
    # another cache named: transformers' own, same answer
    assert ask({**shared, "cache_implementation": "dynamic", "cache_config": None}) == answer
    assert _store(vkv_server).lookups == lookups + 1


def test_bad_requests_are_http_errors_and_the_server_keeps_serving(vkv_server, model_dir):
    client = _client(vkv_server["base"])
    _store_after_first_request(vkv_server, model_dir)
    expected = _chat(vkv_server["base"], model_dir, QUESTIONS[:1], temperature=0, max_tokens=8)
    bad_config = {"max_new_tokens": 4, "cache_config": {"pagebytes": 4096}}
    with pytest.raises(openai.BadRequestError, match="unknown cache_config key.*pagebytes"):
        client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"generation_config": json.dumps(bad_config)})
    with pytest.raises(openai.BadRequestError, match="CacheOptionError.*budget_bytes.*smaller than one page"):
        client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"generation_config": json.dumps(
                                           {"cache_config": {"budget_bytes": 100}})})
    # more KV than the request's budget: refused when its pages are asked for, nothing kept
    long_prompt = "Tell me about bread. " * 120
    tight = {"max_new_tokens": 4, "do_sample": False, "cache_config": {"budget_bytes": 1 << 20}}
    with pytest.raises(openai.BadRequestError, match="KVCacheOutOfMemory"):
        client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": long_prompt}],
                                       extra_body={"generation_config": json.dumps(tight)})
    with pytest.raises(openai.APIError) as streamed:  # streamed: the server's own error event, after the stream began
        list(client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": long_prompt}],
                                            stream=True, extra_body={"generation_config": json.dumps(tight)}))
    assert "budget" in str(streamed.value.body)
    # a context over the model's length (SmolLM2: 8192 positions): transformers' server refuses it itself
    # (vkv's ContextTooLongError, test_prepare_request_refuses_before_anything_runs, stands behind it)
    with pytest.raises(openai.BadRequestError, match="prompt has 9,?0[0-9]{2} tokens.*8,?192"):
        client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "bread " * 9000}],
                                       max_tokens=2)
    # a client that goes away mid-stream
    body = {"model": model_dir, "stream": True, "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to one hundred."}]}
    host, port = vkv_server["base"].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_S)
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(3):
        response.readline()
    connection.close()  # gone mid-stream: the server cancels the generation
    stats = _store(vkv_server)
    assert stats.bytes_held <= stats.budget_bytes
    assert _chat(vkv_server["base"], model_dir, QUESTIONS[:1], temperature=0, max_tokens=8) == expected


def test_four_concurrent_conversations_each_as_if_alone(vkv_server, model_dir):
    conversations = [[QUESTIONS[i], QUESTIONS[(i + 1) % 4]] for i in range(4)]
    alone = [_chat(vkv_server["base"], model_dir, c, temperature=0, max_tokens=8) for c in conversations]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda c: _chat(vkv_server["base"], model_dir, c, temperature=0, max_tokens=8),
                                 conversations))
    assert together == alone
    stats = _store(vkv_server)
    assert stats.bytes_held <= stats.budget_bytes == STORE_MIB << 20


def test_every_api_server_of_several_serves_the_store_route_and_openai_errors(stock_server, model_dir):
    """``--api-server-count 2``: two API server processes share one socket and the model's process;
    each request, on a new connection, is answered by either."""
    with _serving(model_dir, serve_options=("--api-server-count", "2")) as server:
        answers = _chat(server["base"], model_dir, QUESTIONS[:2], temperature=0, max_tokens=8)
        assert answers == _chat(stock_server, model_dir, QUESTIONS[:2], temperature=0, max_tokens=8)
        for stats in [_store(server) for _ in range(6)]:  # one store, whichever API server answers
            assert stats.hits >= 1 and stats.bytes_held <= stats.budget_bytes == STORE_MIB << 20
        client = _client(server["base"])
        for _ in range(4):
            with pytest.raises(openai.BadRequestError, match="PageSizeError: cache_config\\['page_bytes'\\]=3"):
                client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": "Hi"}],
                                               extra_body={"generation_config": json.dumps(
                                                   {"cache_config": {"page_bytes": 3}})})
        assert _chat(server["base"], model_dir, QUESTIONS[:2], temperature=0, max_tokens=8) == answers


def test_the_store_survives_the_deep_copy_of_the_generation_config(model_dir):
    """Every request's ``generate`` deep-copies the model's config: the copy holds the same store."""
    model, _ = load_default_model()
    try:
        store = serving.store_of(model)
        copied = copy.deepcopy(model.generation_config)
        assert copied.cache_implementation == "vkv"
        assert copied.cache_config["prefix_store"] is store
    finally:
        gc.unfreeze()


def _chat_env() -> dict[str, str]:
    """``transformers chat``'s client (huggingface_hub's) refuses every URL, 127.0.0.1 too, while
    HF_HUB_OFFLINE is set: it runs without it, with the hub's endpoint pointed at a closed local
    port, so that nothing can reach the hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_ENDPOINT": "http://127.0.0.1:9", "COLUMNS": "200"}


def test_transformers_chat_talks_to_it(vkv_server, model_dir, tmp_path: Path):
    lookups = _store_after_first_request(vkv_server, model_dir).lookups
    code = "import sys; from transformers.cli.transformers import app; app(sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, "chat", model_dir, f"{vkv_server['base']}/v1", "max_new_tokens=8",
         "--save-folder", str(tmp_path)],
        # "n": do not continue past max_new_tokens
        input="When do you open?\nn\nAnd close?\nn\n!exit\n", capture_output=True, text=True, timeout=240,
        env=_chat_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert _store(vkv_server).lookups >= lookups + 2, done.stdout[-3000:] + done.stderr[-3000:]


def test_prepare_request_refuses_before_anything_runs(model_dir):
    """The request hook alone: a malformed option is a typed error and the model's config keeps its store."""
    import torch

    from hf_vkv import CacheOptionError

    model, _ = load_default_model()
    inputs = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    gc.unfreeze()
    try:
        with pytest.raises(CacheOptionError, match="layout"):
            serving.prepare_request(model, inputs, {"max_new_tokens": 2, "cache_config": {"layout": "diagonal"}})
        # the model's first request gave it its store, and the model (alive for the server's
        # life) left the collector's full collections
        assert gc.get_freeze_count() > 0 and not any(o is model for o in gc.get_objects())
    finally:
        gc.unfreeze()
    store = serving.store_of(model)
    assert store is not None and serving.store_of(model) is store
    assert model.generation_config.cache_implementation == "vkv"
    assert model.generation_config.cache_config["prefix_store"] is store
    plain = {"max_new_tokens": 2}
    serving.prepare_request(model, inputs, plain)
    assert plain == {"max_new_tokens": 2}  # the model's config: vkv and its store
    own = {"max_new_tokens": 2, "cache_config": {"prefill_once": False}}
    serving.prepare_request(model, inputs, own)
    assert own["cache_implementation"] == "vkv" and own["cache_config"] == {"prefill_once": False, "prefix_store": store}
    for named in ({}, {"cache_implementation": "dynamic"}):  # a client cannot send a store (it was dropped)
        with pytest.raises(CacheOptionError, match="cannot name a prefix_store"):
            serving.prepare_request(model, inputs, {"max_new_tokens": 2, "cache_config": {"prefix_store": "x"}, **named})
    dynamic = {"max_new_tokens": 2, "cache_implementation": "dynamic"}
    serving.prepare_request(model, inputs, dynamic)
    assert dynamic["cache_implementation"] == "dynamic" and dynamic["cache_config"] == {}
    with pytest.raises(serving.ContextTooLongError):
        serving.prepare_request(model, {"input_ids": torch.ones(1, 9000, dtype=torch.long)}, plain)
    # as the server's client gets them: a ValueError naming the error
    refused = serving.served_error(CacheOptionError("bad\n  option"))
    assert isinstance(refused, ValueError) and str(refused) == "CacheOptionError: bad option"

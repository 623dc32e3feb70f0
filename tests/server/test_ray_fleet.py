"""`edgellama serve --ray-replicas N`: the server as replicas of a Ray Serve deployment
(edgellama/server/fleet.py), behind Ray's HTTP proxy.

The options' checks run the command without a cluster (and without Ray: it is the
optional extra edgellama[ray]). The fleet's tests (slow: a Ray cluster starts) need Ray
Serve and skip without it: the command itself on a cluster of its own; then a local
cluster of 2 CPUs in this process with 2 replicas of SmolLM2 (1 thread each), which
answer as one `edgellama serve` does (greedy replies equal to the app's in this
process), and which lose one replica while 12 clients (streamed and not, through the
official openai client) are being answered: each request completes, or fails with a 5xx
or a cut connection, and completes when retried; the deployment is back to 2 running
replicas, a new one in the killed one's place. Every wait is bounded.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from server_asgi import ServerUnderTest
from test_server import EXE

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "serve", "-m", str(model), *args], capture_output=True,
                          text=True, timeout=120, env=env)


# a valid --ray-replicas first checks that Ray imports: the checks after it need Ray
_WITH_RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason='Ray is the optional extra: pip install "edgellama[ray]"')


@pytest.mark.parametrize("args, message", [
    (["--ray-replicas", "0"], "'--ray-replicas': 0 is not in the range 1<=x<=64"),
    (["--ray-replicas", "65"], "'--ray-replicas': 65 is not in the range 1<=x<=64"),
    (["--ray-address", "10.0.0.1:6379"], "--ray-address needs --ray-replicas"),
    pytest.param(["--ray-replicas", "2", "--port", "0"], "--ray-replicas needs a --port",
                 marks=_WITH_RAY),
    pytest.param(["--ray-replicas", "2", "--slot-save-path", "."],
                 "--slot-save-path does not work with --ray-replicas", marks=_WITH_RAY),
])
def test_options_are_checked_before_anything_starts(smollm2_gguf, args, message):
    r = _serve(smollm2_gguf, *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_without_ray_one_line_says_what_to_install(smollm2_gguf, tmp_path):
    # `import ray` fails as where it is not installed (a None entry in sys.modules)
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = _serve(smollm2_gguf, "--ray-replicas", "2", env=env)
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].endswith('pip install "edgellama[ray]"'), r.stderr
    assert "Traceback" not in r.stderr


def _ray():
    pytest.importorskip("ray.serve", reason='Ray Serve is the optional extra: '
                                            'pip install "edgellama[ray]"')
    import ray
    from ray import serve
    return ray, serve


def _bounded(fn, seconds: float, what: str):
    """fn() in a thread, failing the test if it takes longer than `seconds`."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{what}: still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.slow
def test_the_command_runs_replicas_until_interrupted(smollm2_gguf, tmp_path):
    """The command on a Ray cluster it starts: one replica answers; SIGINT deletes the
    application and stops that cluster (run before this module's own cluster starts:
    without --ray-address the command would join that one)."""
    _ray()
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([EXE, "serve", "-m", str(smollm2_gguf), "-c", "512", "-t", "1",
                                 "--ray-replicas", "1", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"serving .* on http://127\.0\.0\.1:\d+/v1", log.read_text()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)
        reply = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                          prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
        assert reply.choices[0].text.strip()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert "stopping the replicas" in log.read_text()
        with pytest.raises(openai.APIConnectionError):   # the proxy went with the cluster
            client.models.list()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_replica_that_cannot_load_says_why_in_one_line(tmp_path):
    _ray()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    r = subprocess.run([EXE, "serve", "-m", str(bad), "--ray-replicas", "1", "--port",
                        str(_free_port())], capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the replicas did not start: {bad}: not a GGUF file (magic "
                      f"b'NOPE', expected b'GGUF')"], r.stderr[-3000:]


@pytest.fixture(scope="module")
def fleet(smollm2_gguf):
    """2 replicas of SmolLM2 (ctx 512, 2 slots and a queue of 4 each) on a local Ray
    cluster of 2 CPUs; the proxy's base URL."""
    ray, serve = _ray()
    from edgellama.server import fleet as fl
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = fl.application(str(smollm2_gguf), {"ctx": 512}, {}, replicas=2, threads=1,
                             parallel=2, queue_size=4)
        _bounded(lambda: serve.run(app, name=fl.APP, route_prefix="/"), 240,
                 "the replicas did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        _bounded(serve.shutdown, 60, "Serve did not shut down")
        ray.shutdown()


def _client(url: str) -> openai.OpenAI:
    # no retries of the client's own: every failure is seen (and retried) by the test
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def _ask(client: openai.OpenAI, stream: bool, **kw) -> str:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": MESSAGES, **kw}
    if not stream:
        reply = client.chat.completions.create(**body)
        assert reply.choices[0].finish_reason in ("stop", "length")
        return reply.choices[0].message.content
    parts, finish = [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish in ("stop", "length"), "the stream ended without a finish_reason"
    return "".join(parts)


@pytest.mark.slow
def test_replicas_answer_as_the_server_does(fleet, smollm2_gguf):
    client = _client(fleet)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    here = ServerUnderTest(smollm2_gguf, ctx=512)
    try:
        r = here.request("POST", "/v1/chat/completions",
                         {"messages": MESSAGES, "max_tokens": 24, "temperature": 0})
        assert r.status == 200, r.body
        expected = r.json()["choices"][0]["message"]["content"]
    finally:
        here.close()
    assert expected
    # one at a time (each decoded alone, as here), streamed and not: whichever replica
    for stream in (False, True, False, True):
        assert _ask(client, stream, max_tokens=24, temperature=0) == expected
    # the app's own checks answer through the proxy: JSON errors, the Host guard
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                       messages=MESSAGES, max_tokens=-1)
    guarded = openai.OpenAI(base_url=f"{fleet}/v1", api_key="none", max_retries=0,
                            timeout=60, default_headers={"Host": "attacker.example"})
    with pytest.raises(openai.PermissionDeniedError):
        guarded.models.list()


def _replica_names(ray) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::edgellama#edgellama#")}


@pytest.mark.slow
def test_a_killed_replica_is_replaced_and_its_requests_retry(fleet):
    ray, serve = _ray()
    client = _client(fleet)
    names = _replica_names(ray)
    assert len(names) == 2, names
    failures: list[BaseException] = []
    lock = threading.Lock()

    def request(i: int) -> str:
        for attempt in range(6):
            try:
                return _ask(client, stream=i % 2 == 1, max_tokens=48, temperature=0.7,
                            seed=i)
            except (openai.APIConnectionError, openai.InternalServerError) as e:
                with lock:   # a cut connection, or 5xx: what a client retries
                    failures.append(e)
            time.sleep(0.5 * 2 ** attempt)   # backing off as the openai client does
        raise AssertionError(f"request {i} failed 6 times: {failures[-6:]}")

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(request, i) for i in range(12)]
        time.sleep(1.0)    # the requests are running: 2 slots and 4 queued a replica
        killed = sorted(names)[0]
        ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
        replies = [f.result(timeout=240) for f in futures]
    assert all(replies), replies
    # the killed replica was answering: some requests saw it die, each as a clean error
    assert failures, "no request failed: the replica was killed after the requests ended"
    for e in failures:
        assert isinstance(e, openai.APIConnectionError) or e.status_code in (500, 502, 503), e

    deadline = time.monotonic() + 120
    while True:
        state = serve.status().applications["edgellama"].deployments["edgellama"]
        names_now = _replica_names(ray)
        if state.replica_states == {"RUNNING": 2} and str(state.status).endswith("HEALTHY") \
                and len(names_now) == 2 and killed not in names_now:
            break
        assert time.monotonic() < deadline, (state, names_now)
        time.sleep(1)
    # the fleet answers again, each request the first time
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(lambda i: _ask(client, i % 2 == 1, max_tokens=8), range(8),
                              timeout=120))
    assert all(again), again

"""End-to-end test of `strata serve`: a real coordinator and two real CPU workers (one 2-stage
replica of the default model) on loopback, driven by a real gRPC client (Python grpcio).

Run by test_serve.sh as:  /usr/bin/python3 test_serve.py BUILD_DIR STUBS_DIR WORK_DIR
BUILD_DIR holds strata and strata-worker; STUBS_DIR holds strata_pb2.py (protoc --python_out);
WORK_DIR is a scratch folder (TLS files, logs).

Checks: greedy output equals single-process `strata generate` token for token (text compared,
and the ids of a concurrent run compared with the ids of the same prompt alone); 32 concurrent
streams; Abort; every bad input; a client that disconnects; a killed worker (the server restarts
it, and the request goes on on the rebuilt replica; with two replicas, on the other one);
GetModelInfo / GetStats / Prometheus metrics; TLS with a
bearer token; SIGTERM drains a running stream, a second signal ends the drain; uneven pipeline splits (--stage-layers); KV tiers
under concurrent load with aborts, cancels and a drain; prefix caching. Every wait is bounded: a hang is a failure.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

import grpc

BUILD, STUBS, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, STUBS)
import strata_pb2 as pb  # noqa: E402

STRATA = os.path.join(BUILD, "strata")
T = 120  # client timeout for calls that should finish
ADDR = [None]  # the main server's address, for tests that run the command-line client
# Servers whose log holds a sanitizer report: a worker's report is only there (its restart, or
# the request's own error status, would hide it from the test that caused it).
SANITIZER_REPORTS = []
# Every server started, so that a failing test shows the log of the servers it started.
SERVERS = []


class Serve:
    """One `strata serve` process; ready when it prints 'ready: serving ... on port N'."""

    def __init__(self, name, *args, env=None):
        self.name = name
        self.log_path = os.path.join(WORK, name + ".log")
        self.log = open(self.log_path, "w+b")
        self.proc = subprocess.Popen([STRATA, "serve", "--listen", "127.0.0.1:0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env} if env else None)
        self.port = None
        SERVERS.append(self)
        deadline = time.time() + 240
        while time.time() < deadline:
            m = re.search(rb"ready: serving .* on port (\d+)", self.text())
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        if self.port is None:
            self.stop()
            raise AssertionError(f"{name}: server did not become ready:\n{self.text().decode(errors='replace')}")

    def text(self):
        with open(self.log_path, "rb") as f:
            return f.read()

    def addr(self):
        return f"127.0.0.1:{self.port}"

    def workers(self):
        """PIDs of the worker processes this server started (its children)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def worker_at(self, replica, stage):
        """PID of the worker that joined last as (replica, stage), from the coordinator's log."""
        joins = re.findall(rb"worker (\S+) joined as replica (\d+) stage (\d+)", self.text())
        name = [n for n, r, st in joins if (int(r), int(st)) == (replica, stage)][-1]
        for pid in self.workers():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"\0--name\0" + name + b"\0" in f.read():
                    return pid
        raise AssertionError(f"no worker process named {name}")

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.name}: did not stop within {timeout} s")
        report = re.search(rb".*(Sanitizer|runtime error).*", self.text())
        if report and self.name not in SANITIZER_REPORTS:
            SANITIZER_REPORTS.append(self.name)
            print(f"FAIL {self.name}: sanitizer report in the server log: {report.group(0).decode(errors='replace')}")
        return self.proc.returncode


class Client:
    def __init__(self, addr, creds=None, token=None):
        self.ch = grpc.secure_channel(addr, creds) if creds else grpc.insecure_channel(addr)
        self.md = [("authorization", f"Bearer {token}")] if token else None
        u = lambda m, req, resp: self.ch.unary_unary(m, request_serializer=req.SerializeToString,
                                                     response_deserializer=resp.FromString)
        self._gen = self.ch.unary_stream("/strata.v1.Strata/Generate",
                                         request_serializer=lambda r: r if isinstance(r, bytes) else r.SerializeToString(),
                                         response_deserializer=pb.GenerateResponse.FromString)
        self.abort = u("/strata.v1.Strata/Abort", pb.AbortRequest, pb.AbortResponse)
        self.health = u("/strata.v1.Strata/Health", pb.HealthRequest, pb.HealthResponse)
        self.info = u("/strata.v1.Strata/GetModelInfo", pb.ModelInfoRequest, pb.ModelInfo)
        self.stats = u("/strata.v1.Strata/GetStats", pb.StatsRequest, pb.Stats)

    def stream(self, req, timeout=T):
        return self._gen(req, timeout=timeout, metadata=self.md)

    def generate(self, req, timeout=T):
        """(ids, text, final message) of a whole stream."""
        ids, text, last = [], "", None
        for r in self.stream(req, timeout):
            if r.HasField("chunk"):
                ids += list(r.chunk.token_ids)
                text += r.chunk.text
            else:
                last = r
        return ids, text, last


def req(text=None, ids=None, max_tokens=16, rid="", **sampling):
    r = pb.GenerateRequest(request_id=rid, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))
    if text is not None:
        r.text = text
    if ids is not None:
        r.token_ids.ids.extend(ids)
    return r


def expect_status(fn, code, what, contains=None):
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() == code, f"{what}: got {e.code()} ({e.details()}), want {code}"
        if contains:
            assert contains in e.details(), f"{what}: message {e.details()!r} lacks {contains!r}"
        return e
    raise AssertionError(f"{what}: succeeded, want {code}")


def reference(prompt, n, kv="kivi4"):
    """Single-process `strata generate` output text (greedy, one thread like each worker)."""
    out = subprocess.run([STRATA, "generate", "-p", prompt, "-n", str(n), "--ignore-eos", "-q", "--no-echo",
                          "--threads", "1", "--ctx", "512", "--kv", kv], capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    text = out.stdout.decode()
    assert text.endswith("\n")   # generate ends its output with a newline of its own
    return text[:-1]


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
# About 370 tokens: past the 128-token fp16 window, so the KV codec shapes the output (greedy
# kivi2 and kivi4 differ within 24 tokens; the short prompts above stay in the window).
LONG = " ".join(f"Alice has {i} apples and Bob has {3 * i + 1} pears." for i in range(1, 26)) + \
    " In total, Alice and Bob have"


# ------------------------------------------------------------------------------------------
# Tests against one server (ctx 512 so that "longer than the context" is cheap to send)

def test_equals_generate(c):
    for p in PROMPTS[:2]:
        ids, text, last = c.generate(req(p, max_tokens=24, ignore_eos=True))
        want = reference(p, 24)
        assert text == want, f"served {text!r} != generate {want!r}"
        assert last.complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.complete.completion_tokens == 24 == len(ids)
    # the command-line client: strata generate --server
    out = subprocess.run([STRATA, "generate", "--server", ADDR[0], "-p", PROMPTS[0], "-n", "24", "--ignore-eos",
                          "--no-echo", "-q"], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == reference(PROMPTS[0], 24) + "\n"
    # a request's own KV codec (the server offers kivi2 besides kivi4; fp16 in the two-replica
    # test): the single-process output on that codec, from the API and from the command-line client
    assert reference(LONG, 24, "kivi2") != reference(LONG, 24), "the long prompt no longer tells kivi2 from kivi4"
    for p, kv in ((PROMPTS[1], "kivi2"), (LONG, "kivi2")):
        r = req(p, max_tokens=24, ignore_eos=True)
        r.kv_codec = kv
        text = c.generate(r)[1]
        want = reference(p, 24, kv)
        assert text == want, f"served on {kv}: {text!r} != generate {want!r}"
    out = subprocess.run([STRATA, "generate", "--server", ADDR[0], "-p", LONG, "-n", "24", "--ignore-eos",
                          "--no-echo", "-q", "--kv", "kivi2-g32"], capture_output=True, timeout=120)   # = kivi2
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == reference(LONG, 24, "kivi2") + "\n"
    out = subprocess.run([STRATA, "generate", "--server", ADDR[0], "-p", "hi", "--kv", "gear2"], capture_output=True,
                         timeout=120)
    assert out.returncode == 1 and b"UNIMPLEMENTED" in out.stderr and out.stdout == b"", out


def test_concurrent(c):
    alone = {p: c.generate(req(p, max_tokens=12, ignore_eos=True))[0] for p in PROMPTS}
    results, errors = {}, []

    def one(i):
        try:
            p = PROMPTS[i % len(PROMPTS)]
            results[i] = (p, c.generate(req(p, max_tokens=12, ignore_eos=True, rid=f"conc-{i}")))
        except Exception as e:  # noqa: BLE001
            errors.append(f"stream {i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert not errors, errors
    assert len(results) == 32
    for i, (p, (ids, _, last)) in results.items():
        assert ids == alone[p], f"stream {i}: {ids} != alone {alone[p]}"
        assert last.request_id == f"conc-{i}"
    st = c.stats(pb.StatsRequest(), timeout=T)
    assert st.requests_total >= 32 + 4 and st.running == 0 and st.queue_depth == 0, st
    assert st.spill_failures == 0 and st.restore_failures == 0, st


def test_abort(c):
    it = c.stream(req(PROMPTS[2], max_tokens=400, ignore_eos=True, rid="to-abort"))
    first = next(it)
    assert first.HasField("chunk")
    assert c.abort(pb.AbortRequest(request_id="to-abort"), timeout=T).found
    rest = list(it)
    assert rest[-1].complete.finish_reason == pb.FINISH_REASON_ABORT, rest[-1]
    assert rest[-1].complete.completion_tokens < 400
    assert not c.abort(pb.AbortRequest(request_id="to-abort"), timeout=T).found
    assert not c.abort(pb.AbortRequest(request_id="never-was"), timeout=T).found
    expect_status(lambda: c.abort(pb.AbortRequest(request_id=""), timeout=T), grpc.StatusCode.INVALID_ARGUMENT,
                  "abort with an empty id")


def test_bad_inputs(c):
    I, R, U = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED
    run = lambda r: (lambda: c.generate(r))
    expect_status(run(req("")), I, "empty prompt")
    expect_status(run(pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4))), I, "no input")
    expect_status(run(req(ids=[1] * 600)), R, "prompt longer than the context")
    expect_status(run(req(ids=[1] * 500, max_tokens=100)), R, "prompt + max_tokens beyond the context", "context")
    expect_status(run(req("hi", max_tokens=0)), I, "max_tokens 0")
    expect_status(run(req("hi", max_tokens=1_000_000_000)), I, "absurd max_tokens")
    expect_status(run(req("hi", temperature=-1.0)), I, "negative temperature")
    expect_status(run(req("hi", top_p=1.5)), I, "top_p above 1")
    # top_k at or beyond the vocabulary (up to 2^32 - 1 on the wire) keeps every token, as 0 does
    sampled = [c.generate(req(PROMPTS[2], max_tokens=12, ignore_eos=True, temperature=0.9, seed=7, top_k=k))[:2]
               for k in (0, 2 ** 32 - 1, 2 ** 31)]
    assert sampled[1] == sampled[0] and sampled[2] == sampled[0], f"huge top_k sampled differently: {sampled}"
    expect_status(run(req(ids=[10 ** 8])), I, "token id beyond the vocabulary")
    r = req("hi")
    r.kv_codec = "nosuchcodec"
    expect_status(run(r), I, "unknown codec")
    r.kv_codec = "kivi2-r64"
    expect_status(run(r), U, "a codec the server does not offer", "one, 'kivi2' (ModelInfo.kv_codecs)")
    r.kv_codec = "kivi4"
    assert c.generate(r)[2].complete.completion_tokens >= 1   # the server's own codec is fine
    # invalid UTF-8: field 2 (text) with bytes ff fe, then sampling {max_tokens: 4}
    expect_status(run(b"\x12\x02\xff\xfe" + b"\x22\x02\x28\x04"), I, "invalid UTF-8")
    expect_status(run(req("x" * (5 << 20))), R, "oversized message")
    expect_status(lambda: c.generate(req("hi", rid="bad id")), I, "request id with a space")
    # a client that goes away mid-stream: the server frees the request and goes on
    it = c.stream(req(PROMPTS[1], max_tokens=400, ignore_eos=True))
    next(it)
    it.cancel()
    deadline = time.time() + 30
    while c.stats(pb.StatsRequest(), timeout=T).running and time.time() < deadline:
        time.sleep(0.1)
    assert c.stats(pb.StatsRequest(), timeout=T).running == 0
    assert c.generate(req("still serving?", max_tokens=2, ignore_eos=True))[2].complete.completion_tokens == 2


def test_info_stats_metrics(c, metrics_port):
    info = c.info(pb.ModelInfoRequest(), timeout=T)
    assert (info.n_layers, info.replicas, info.stages_per_replica, info.n_ctx, info.default_kv_codec) == \
        (30, 1, 2, 512, "kivi4"), info
    assert info.n_vocab == 49152 and info.block_tokens == 64 and info.arch == "llama"
    assert list(info.kv_codecs) == ["kivi2"], info   # kivi4 listed again is the default
    assert list(info.stage_layers) == [15, 15], info
    h = c.health(pb.HealthRequest(), timeout=T)
    assert h.status == pb.SERVING_STATUS_SERVING and h.workers_ready == 2 == h.workers_total, h
    # KV blocks exist while a request runs
    it = c.stream(req(PROMPTS[0] * 60, max_tokens=150, ignore_eos=True, rid="for-stats"))
    for _ in range(3):
        next(it)
    time.sleep(1.5)   # workers report their KV about every second
    st = c.stats(pb.StatsRequest(), timeout=T)
    assert st.running == 1 and [t.name for t in st.tiers] == ["device"], st
    assert st.tiers[0].blocks > 0 and st.tiers[0].bytes > 0, st
    assert 0.99 * 2 * (256 << 20) < st.tiers[0].capacity_bytes <= 2 * (256 << 20), st
    # below fp16's bytes per token: the slots are kivi4's, the largest of the offered plans (with
    # fp16 offered, every block would take an fp16 slot: the two-replica server below)
    assert 0 < st.kv_bytes_per_token < 30 * 2 * 3 * 64 * 2, st
    c.abort(pb.AbortRequest(request_id="for-stats"), timeout=T)
    list(it)
    # A short sequence has formed no block yet: its tokens are all in the fp16 window (kivi4's
    # 128 tokens), 30 layers x K and V x 3 heads x 64 dims x 2 bytes each
    it = c.stream(req("Hello", max_tokens=400, ignore_eos=True, rid="short-stats"))
    for _ in range(5):
        next(it)
    st = c.stats(pb.StatsRequest(), timeout=T)
    assert st.running == 1 and st.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2, st
    # Past the window plus a block, the sequence holds a compressed block; a worker stepping
    # without pause still reports it (twice a second), though no sequence left or moved
    got = 5
    while got < 128 + 64 + 16:
        got += len(next(it).chunk.token_ids)
    deadline = time.time() + 3
    while time.time() < deadline:
        st = c.stats(pb.StatsRequest(), timeout=T)
        if st.tiers[0].blocks:
            break
        time.sleep(0.1)
    assert st.running == 1 and st.tiers[0].blocks > 0, f"no block reported after {got} tokens: {st}"
    c.abort(pb.AbortRequest(request_id="short-stats"), timeout=T)
    list(it)
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for name in ("strata_requests_total", "strata_tokens_generated_total", "strata_time_to_first_token_seconds_bucket",
                 "strata_inter_token_seconds_bucket", "strata_queue_depth", 'strata_kv_blocks{tier="device"}',
                 "strata_workers_ready 2", "strata_kv_spill_failures_total 0",
                 "strata_kv_restore_failures_total 0"):
        assert name in body, f"metrics lack {name}"
    assert re.search(r"^strata_tokens_generated_total [1-9]", body, re.M), "no tokens counted"


def gone(pid):
    """True once pid has exited (a zombie counts: the server reaps it on its next round)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_killed_worker(s, c):
    # SIGTERM to a worker busy with a stream (it must stop between messages, not wait for an idle
    # moment), then SIGKILL: each time the server restarts the worker, the lone replica is
    # rebuilt, and the stream goes on there (--recovery-wait, --max-recoveries) to its last token,
    # with no error; the rebuilt replica then serves as before.
    for n, (sig, victim) in enumerate(((signal.SIGTERM, 0), (signal.SIGKILL, 1)), 1):
        it = c.stream(req(PROMPTS[3], max_tokens=150, ignore_eos=True))
        got = len(next(it).chunk.token_ids)
        pids = s.workers()
        assert len(pids) == 2, pids
        os.kill(pids[victim], sig)
        deadline = time.time() + 10
        while not gone(pids[victim]) and time.time() < deadline:
            time.sleep(0.1)
        assert gone(pids[victim]), f"worker {pids[victim]} still runs 10 s after {sig.name}"
        last = None
        for r in it:
            if r.HasField("chunk"):
                got += len(r.chunk.token_ids)
            else:
                last = r
        assert last is not None and last.HasField("complete"), f"{sig.name}: stream ended with {last}"
        assert last.complete.completion_tokens == 150 == got, f"{sig.name}: {last} ({got} tokens streamed)"
        assert len(re.findall(rb"it goes on from its \d+ tokens", s.text())) == n, s.text()[-1500:]
        assert c.health(pb.HealthRequest(), timeout=T).status == pb.SERVING_STATUS_SERVING
        ids, text, _ = c.generate(req(PROMPTS[0], max_tokens=24, ignore_eos=True))
        assert text == reference(PROMPTS[0], 24), f"different output after the restart ({sig.name})"


def test_tls_token():
    key, crt = os.path.join(WORK, "key.pem"), os.path.join(WORK, "crt.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    tok = os.path.join(WORK, "token")
    with open(tok, "w") as f:
        f.write("s3cret-token\n")
    s = Serve("tls", "--tls-cert", crt, "--tls-key", key, "--token-file", tok, "--ctx", "512", "-q")
    try:
        creds = grpc.ssl_channel_credentials(open(crt, "rb").read())
        good = Client(s.addr(), creds, "s3cret-token")
        assert good.generate(req("hello", max_tokens=3))[2].complete.completion_tokens == 3
        expect_status(lambda: Client(s.addr(), creds, "wrong").generate(req("hello", max_tokens=3)),
                      grpc.StatusCode.UNAUTHENTICATED, "wrong token")
        expect_status(lambda: Client(s.addr(), creds).generate(req("hello", max_tokens=3)),
                      grpc.StatusCode.UNAUTHENTICATED, "no token")
    finally:
        assert s.stop() == 0


def test_sigterm_drains():
    """SIGTERM drains: the running stream finishes. The workers start with no signal blocked and
    their share of the cores in OPENBLAS_NUM_THREADS."""
    s = Serve("drain", "--ctx", "512", "--drain-seconds", "60")
    for w in s.workers():
        with open(f"/proc/{w}/status") as f:
            blocked = re.search(r"^SigBlk:\s*([0-9a-f]+)", f.read(), re.M).group(1)
        assert int(blocked, 16) == 0, f"worker {w} starts with signals blocked: SigBlk {blocked}"
        with open(f"/proc/{w}/environ", "rb") as f:
            env = f.read().split(b"\0")
        assert any(re.fullmatch(rb"OPENBLAS_NUM_THREADS=[1-9][0-9]*", e) for e in env), env
    c = Client(s.addr())
    it = c.stream(req(PROMPTS[1], max_tokens=40, ignore_eos=True))
    next(it)
    s.proc.send_signal(signal.SIGTERM)
    msgs = list(it)
    assert msgs[-1].complete.completion_tokens == 40, msgs[-1]   # the running stream finished
    assert s.stop() == 0
    assert b"draining" in s.text()


def test_sigterm_drain_cut():
    """SIGTERM with a drain too short for a long stream: the stream had output, so it ends with an
    Error message (UNAVAILABLE) and then status OK, as proto/strata.proto's Generate says."""
    s = Serve("drain_cut", "--ctx", "2048", "--drain-seconds", "1")
    c = Client(s.addr())
    it = c.stream(req(PROMPTS[1], max_tokens=1800, ignore_eos=True))
    next(it)
    s.proc.send_signal(signal.SIGTERM)
    msgs = list(it)   # raises on a non-OK status
    assert msgs and msgs[-1].WhichOneof("kind") == "error", msgs[-1:]
    assert msgs[-1].error.code == grpc.StatusCode.UNAVAILABLE.value[0], msgs[-1]
    assert all(m.WhichOneof("kind") == "chunk" for m in msgs[:-1])
    assert s.stop() == 0


def test_second_signal_cuts_drain(one_blas_thread):
    """A second signal during the drain (Ctrl-C again) ends it at once: the long stream ends with
    UNAVAILABLE long before --drain-seconds, and serve still shuts down cleanly (exit 0). By
    default OpenBLAS starts a thread pool before main that blocks no signal: the kernel may hand
    the signal to it, which must not kill the process. With OPENBLAS_NUM_THREADS=1 there is no
    such thread: every thread blocks the signal and the main thread must take it."""
    s = Serve("drain_twice", "--ctx", "2048", "--drain-seconds", "60",
              env={"OPENBLAS_NUM_THREADS": "1"} if one_blas_thread else None)
    c = Client(s.addr())
    it = c.stream(req(PROMPTS[1], max_tokens=1800, ignore_eos=True))
    next(it)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    s.proc.send_signal(signal.SIGINT)
    msgs = list(it)
    assert msgs and msgs[-1].WhichOneof("kind") == "error", msgs[-1:]
    assert msgs[-1].error.code == grpc.StatusCode.UNAVAILABLE.value[0], msgs[-1]
    assert s.proc.wait(30) == 0
    assert time.time() - t0 < 30, time.time() - t0
    assert b"1 request still running at a second signal: it ends with UNAVAILABLE" in s.text(), s.text()[-400:]


def test_stage_layers():
    """Uneven pipeline splits (--stage-layers): balanced gives SmolLM2's 30 layers as 19 + 11 (the
    last stage also multiplies the 49152 x 576 output head, as much as 8 layers), and a list from
    the config file makes 3 stages of 1, 28 and 1 layers without --stages; each worker gets its
    range and greedy output stays that of single-process `strata generate`, past the fp16 window."""
    want = {p: reference(p, 24) for p in (PROMPTS[0], LONG)}
    cfg = os.path.join(WORK, "stage_layers.json")
    with open(cfg, "w") as f:
        f.write('{"stage_layers": "1,28,1", "ctx": 512}')
    for name, args, counts, ranges in (
            ("balanced", ("--ctx", "512", "--stage-layers", "balanced"), [19, 11], ("0-18", "19-29")),
            ("listed", ("--config", cfg), [1, 28, 1], ("0-0", "1-28", "29-29"))):
        s = Serve("layers_" + name, *args)
        try:
            log = s.text().decode(errors="replace")
            split = ",".join(map(str, counts)) + (" (balanced)" if name == "balanced" else " (as listed)")
            assert f"layers per stage: {split}" in log, log
            for st, r in enumerate(ranges):
                assert re.search(rf"stage {st} \(layers {r}\)", log), f"{name}: stage {st} not on layers {r}:\n{log}"
            c = Client(s.addr())
            info = c.info(pb.ModelInfoRequest(), timeout=T)
            assert (info.stages_per_replica, list(info.stage_layers)) == (len(counts), counts), info
            for p, text in want.items():
                got = c.generate(req(p, max_tokens=24, ignore_eos=True))[1]
                assert got == text, f"{name}: served {got!r} != generate {text!r}"
        finally:
            assert s.stop() == 0


def test_two_replicas_migration():
    """Two replicas of two stages: two requests are routed one per replica; draining a worker moves
    the request of its replica to the other one mid-generation (its KV blocks travel worker to
    worker) and both still give exactly the single-process tokens. Each request names its own KV
    codec, which travels with the moved one. A worker killed mid-stream: its request goes on on
    the other replica (recovery) from that replica's cached prefix of its tokens, with the same
    sampled tokens. A step budget of 64 tokens makes a long prompt run as chunks."""
    s = Serve("two", "--replicas", "2", "--stages", "2", "--ctx", "512", "--max-batch-tokens", "64",
              "--kv-codecs", "fp16,kivi2", "--prefix-cache-mib", "16")
    try:
        c = Client(s.addr())
        h = c.health(pb.HealthRequest(), timeout=T)
        assert h.workers_ready == 4 == h.workers_total, h
        codec = {PROMPTS[2]: "fp16", LONG: "kivi2"}
        # The short prompt's first token comes a second before the long one's (prefilled in
        # chunks): it asks for more tokens, so that it is still running when the drain comes.
        n = {PROMPTS[2]: 200, LONG: 48}
        want = {p: reference(p, n[p], codec[p]) for p in codec}
        streams = {}
        for p in codec:
            r = req(p, max_tokens=n[p], ignore_eos=True)
            r.kv_codec = codec[p]
            streams[p] = c.stream(r)
        texts = {}
        for p, it in streams.items():
            first = next(it)
            texts[p] = first.chunk.text
        out = subprocess.run([STRATA, "drain", "--server", s.addr(), "local-0", "--timeout", "120"],
                             capture_output=True, timeout=180)
        assert out.returncode == 0, out.stderr.decode(errors="replace")
        assert b"1 moved, 0 failed" in out.stdout, out.stdout   # one request per replica: routing
        for p, it in streams.items():
            for r in it:
                if r.HasField("chunk"):
                    texts[p] += r.chunk.text
                else:
                    assert r.complete.completion_tokens == n[p], r
        for p in streams:
            assert texts[p] == want[p], f"{p!r}: {texts[p]!r} != {want[p]!r}"
        assert b"moved from replica" in s.text()
        # the drained replica's workers were stopped, restarted and joined again
        deadline = time.time() + 120
        while time.time() < deadline and c.health(pb.HealthRequest(), timeout=T).status != pb.SERVING_STATUS_SERVING:
            time.sleep(0.5)
        assert c.health(pb.HealthRequest(), timeout=T).status == pb.SERVING_STATUS_SERVING
        # A worker lost mid-stream: the request goes on on the other replica from its prompt and
        # the tokens it streamed, and its seeded sampling gives the tokens an uninterrupted run
        # gives (fp16: recomputed KV is the same up to rounding). Two uninterrupted runs at once
        # (one per replica) leave a cached prefix of their first 64 tokens on each; the request
        # streams past 64 tokens on replica 0, which is then lost, and on replica 1 it starts
        # from that replica's entry (prompt and sampled tokens) and recomputes only the rest.
        r = req(PROMPTS[1], max_tokens=120, ignore_eos=True, temperature=0.8, seed=11)
        r.kv_codec = "fp16"
        hits = c.stats(pb.StatsRequest(), timeout=T).prefix_cache_hits
        pair = [c.stream(r), c.stream(r)]
        whole, again = ([t for m in p if m.HasField("chunk") for t in m.chunk.token_ids] for p in pair)
        assert whole == again, f"the same seed on the two replicas: {whole} != {again}"
        it = c.stream(r)
        ids = []
        while len(ids) < 70:
            ids += list(next(it).chunk.token_ids)
        victim = s.worker_at(0, 1)   # an idle server routes to replica 0 (ties: the lowest index)
        os.kill(victim, signal.SIGKILL)
        for m in it:
            if m.HasField("chunk"):
                ids += list(m.chunk.token_ids)
            else:
                assert m.complete.completion_tokens == 120, m
        assert ids == whole, f"after the recovery: {ids} != uninterrupted {whole}"
        assert re.search(rb"lost: .*; it goes on from its \d+ tokens", s.text()), s.text()[-2000:]
        st = c.stats(pb.StatsRequest(), timeout=T)
        assert st.requests_recovered == 1, st
        assert st.prefix_cache_hits == hits + 1, st   # the recovered sequence's copy of the entry
        deadline = time.time() + 120   # the killed worker is restarted and its replica rebuilt
        while time.time() < deadline and c.health(pb.HealthRequest(), timeout=T).status != pb.SERVING_STATUS_SERVING:
            time.sleep(0.5)
        assert c.health(pb.HealthRequest(), timeout=T).status == pb.SERVING_STATUS_SERVING
        # a request on fp16 past the window, prefilled in chunks, as strata generate on fp16
        r = req(LONG, max_tokens=24, ignore_eos=True)
        r.kv_codec = "fp16"
        text = c.generate(r)[1]
        assert text == reference(LONG, 24, "fp16"), f"served on fp16: {text!r}"
        # a prompt over the step budget (64 tokens) runs as chunks (chunked prefill) and completes
        ids, text, last = c.generate(req(PROMPTS[0] * 30, max_tokens=8, ignore_eos=True))
        assert last.complete.prompt_tokens > 128 and last.complete.completion_tokens == 8 == len(ids), last
        assert text.strip(), text
        out = subprocess.run([STRATA, "drain", "--server", s.addr(), "nosuch"], capture_output=True, timeout=60)
        assert out.returncode == 1 and b"INVALID_ARGUMENT" in out.stderr, out
    finally:
        assert s.stop() == 0


def test_tiers_under_load():
    """Two replicas whose workers hold 1 MiB of KV on the device over 2 MiB of host memory and
    32 MiB on NVMe, 12 concurrent requests of random token ids (up to 300 prompt and 80 output
    tokens, 16-token fp16 blocks): every sequence spills and comes back each step, a few
    requests are aborted or cancelled part way, and a drain moves the running requests of one
    replica (their blocks read back from the tiers) mid-run. Every request gives exactly the
    tokens of a server without tiers (an aborted or cancelled one, the first of them), nothing
    fails, and at the end no block is left in any tier."""
    import random
    from concurrent.futures import ThreadPoolExecutor
    rng = random.Random(9)
    jobs = []
    for i in range(12):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 300))]
        n = rng.randrange(8, 80)
        jobs.append((prompt, n, "abort" if i % 5 == 3 else "cancel" if i % 5 == 4 else "full", rng.randrange(1, 8)))
    base = ["--ctx", "1024", "--kv", "fp16", "--block-tokens", "16"]
    started = threading.Event()

    def run_all(server, faults):
        c = Client(server.addr())

        def one(i):
            prompt, n, mode, k = jobs[i]
            rid = f"load-{i}"
            ids = []
            it = c.stream(req(ids=prompt, max_tokens=n, ignore_eos=True, rid=rid))
            try:
                for m in it:
                    if m.HasField("chunk"):
                        ids += list(m.chunk.token_ids)
                        started.set()
                        if faults and mode == "abort" and len(ids) == k:   # found, or just finished
                            c.abort(pb.AbortRequest(request_id=rid), timeout=T)
                        if faults and mode == "cancel" and len(ids) >= k:
                            it.cancel()
                            return ids, "cancelled"
                    else:
                        assert m.complete.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORT), m
                        return ids, pb.FinishReason.Name(m.complete.finish_reason)
            except grpc.RpcError as e:
                if faults and mode == "cancel" and e.code() == grpc.StatusCode.CANCELLED:
                    return ids, "cancelled"
                raise AssertionError(f"request {i} ({mode}, {len(prompt)} prompt tokens): {e.code()}: {e.details()}")
            raise AssertionError(f"request {i}: the stream ended without Complete")

        with ThreadPoolExecutor(6) as ex:
            return list(ex.map(one, range(len(jobs))))

    plain = Serve("untiered", *base)
    try:
        want = run_all(plain, False)
    finally:
        assert plain.stop() == 0
    spill = os.path.join(WORK, "load-spill")
    s = Serve("tiered", *base, "--replicas", "2", "--device-kv-mib", "1", "--host-kv-mib", "2", "--nvme-kv-mib", "32",
              "--nvme-dir", spill, "--max-seqs", "4", "--max-batch-tokens", "100", "--threads", "1")
    drained = []
    try:
        def drain():
            started.wait(60)
            drained.append(subprocess.run([STRATA, "drain", "--server", s.addr(), "local-1", "--timeout", "120"],
                                          capture_output=True, timeout=180))
        started.clear()
        th = threading.Thread(target=drain)
        th.start()
        got = run_all(s, True)
        th.join(200)
        assert drained and drained[0].returncode == 0 and b"drained:" in drained[0].stdout, drained
        print("      " + drained[0].stdout.decode(errors="replace").strip().splitlines()[-1], flush=True)
        c = Client(s.addr())
        deadline = time.time() + 60
        st = c.stats(pb.StatsRequest(), timeout=T)
        while time.time() < deadline and (st.running or any(t.blocks for t in st.tiers)):
            time.sleep(0.5)
            st = c.stats(pb.StatsRequest(), timeout=T)
    finally:
        assert s.stop() == 0
    for i, ((w, _), (g, how)) in enumerate(zip(want, got)):
        mode = jobs[i][2]
        if mode == "full":
            assert g == w and how == "FINISH_REASON_LENGTH", f"request {i}: {len(g)} tokens ({how}) vs {len(w)}"
        else:
            assert g == w[:len(g)], f"request {i} ({mode}): its {len(g)} tokens are not the untiered run's first"
    assert st.running == 0 and st.queue_depth == 0, st
    assert [t.name for t in st.tiers] == ["device", "host", "nvme"] and not any(t.blocks for t in st.tiers), st
    assert st.spills > 0 and st.restores > 0 and not st.spill_failures and not st.restore_failures, st


def test_prefix_cache():
    """Prefix caching (--prefix-cache-mib): a finished request's first tokens stay on the workers
    as compressed blocks; a request whose prompt starts with them copies them and prefills only
    the rest. On fp16 (the cache holds what a whole prefill attends) the outputs equal those of a
    server without the cache, token for token; a follow-up turn reuses the first turn's generated
    tokens too; a prompt sharing only an entry's first blocks takes those; OTT plans are never cached; a restarted worker's entries are forgotten (the next
    request prefills whole and succeeds); GetStats and the metrics count it all, within the
    budget."""
    args = ["--ctx", "1024", "--kv-codecs", "fp16,ott2", "--metrics", "127.0.0.1:0"]
    plain = Serve("prefix-off", *args)
    turn1 = list(range(1000, 1300))                     # 300 prompt ids (ids: no tokenizer merges)
    try:
        c0 = Client(plain.addr())
        r = req(ids=turn1, max_tokens=24, ignore_eos=True)
        r.kv_codec = "fp16"
        gen1, _, last = c0.generate(r)
        assert last.complete.cached_tokens == 0, last
        turn2 = turn1 + gen1 + list(range(2000, 2010))  # the first turn, its answer, a new question
        r = req(ids=turn2, max_tokens=16, ignore_eos=True)
        r.kv_codec = "fp16"
        want2 = c0.generate(r)[0]
        r = req(LONG, max_tokens=16, ignore_eos=True)
        r.kv_codec = "fp16"
        want_long = c0.generate(r)[0]
        part = turn1[:130] + list(range(3000, 3020))    # shares only the first 2 blocks of an entry
        r = req(ids=part, max_tokens=16, ignore_eos=True)
        r.kv_codec = "fp16"
        want_part = c0.generate(r)[0]
        assert c0.stats(pb.StatsRequest(), timeout=T).prefix_cache_entries == 0
    finally:
        assert plain.stop() == 0
    s = Serve("prefix", "--prefix-cache-mib", "32", *args)
    try:
        c = Client(s.addr())
        pm = re.search(rb"metrics port (\d+)", s.text())
        seen = 0

        def run(prompt_ids=None, text=None, kv="fp16", n=16):
            nonlocal seen
            r = req(text, ids=prompt_ids, max_tokens=n, ignore_eos=True)
            r.kv_codec = kv
            ids, _, last = c.generate(r)
            assert last.HasField("complete") and len(ids) == n, last
            seen += last.complete.cached_tokens
            return ids, last.complete.cached_tokens

        ids, cached = run(turn1, n=24)
        assert (ids, cached) == (gen1, 0), (cached, ids, gen1)
        # 300 + 24 - 1 tokens entered the KV: 5 whole blocks of 64 (fp16 keeps no tail)
        ids, cached = run(turn2)
        assert cached == 320, cached             # past the 300 prompt ids: into the first answer
        assert ids == want2, f"from the cache {ids} != without {want2}"
        ids, cached = run(part)                  # the first 2 of the 5 blocks of the entry
        assert cached == 128, cached
        assert ids == want_part, f"from part of an entry {ids} != without {want_part}"
        ids, cached = run(text=LONG)
        assert cached == 0 and ids == want_long
        ids, cached = run(text=LONG)
        assert cached > 0 and cached % 64 == 0 and ids == want_long, (cached, ids, want_long)
        # the server's own plan (kivi4, lossy): cached, completes
        _, cached = run(text=LONG, kv="")
        assert cached == 0
        _, cached = run(text=LONG, kv="")
        assert cached > 0
        # OTT's pool state cannot be cut to a prefix: never cached
        for _ in range(2):
            assert run(text=LONG, kv="ott2")[1] == 0
        st = c.stats(pb.StatsRequest(), timeout=T)
        assert st.prefix_cache_hits == 4 and st.prefix_cache_hit_tokens == seen, st
        assert st.prefix_cache_entries >= 1 and 0 < st.prefix_cache_bytes <= 32 << 20, st
        body = urllib.request.urlopen(f"http://127.0.0.1:{int(pm.group(1))}/metrics", timeout=10).read().decode()
        assert "strata_prefix_cache_hits_total 4" in body and f"strata_prefix_cache_hit_tokens_total {seen}" in body, \
            [ln for ln in body.splitlines() if "prefix" in ln]
        # a restarted worker holds nothing: the next request prefills whole, and is right
        pids = s.workers()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.time() + 10
        while not gone(pids[1]) and time.time() < deadline:
            time.sleep(0.1)
        serving = lambda: c.health(pb.HealthRequest(), timeout=T).status == pb.SERVING_STATUS_SERVING
        deadline = time.time() + 30   # the coordinator notices the lost worker
        while time.time() < deadline and serving():
            time.sleep(0.1)
        deadline = time.time() + 120  # and the restarted one rebuilds the replica
        while time.time() < deadline and not serving():
            time.sleep(0.5)
        assert serving(), "never served again"
        assert c.stats(pb.StatsRequest(), timeout=T).prefix_cache_entries == 0
        ids, cached = run(text=LONG)
        assert cached == 0 and ids == want_long
        ids, cached = run(text=LONG)
        assert cached > 0 and ids == want_long
    finally:
        assert s.stop() == 0


def main():
    failures = []

    def run(name, fn, *args):
        t = time.time()
        started = len(SERVERS)
        try:
            fn(*args)
            print(f"ok   {name} ({time.time() - t:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001
            failures.append(name)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
            for srv in SERVERS[started:]:   # its own servers' logs (the main server's comes at the end)
                print(f"{srv.name} server log:\n" + srv.text().decode(errors="replace")[-6000:], flush=True)

    s = Serve("main", "--ctx", "512", "--metrics", "127.0.0.1:0", "--kv-codecs", "kivi2, kivi4;kivi4")
    pm = re.search(rb"metrics port (\d+)", s.text())
    metrics_port = int(pm.group(1)) if pm else None
    ADDR[0] = s.addr()
    try:
        c = Client(s.addr())
        run("greedy output equals strata generate", test_equals_generate, c)
        run("32 concurrent streams", test_concurrent, c)
        run("abort", test_abort, c)
        run("bad inputs and a vanishing client", test_bad_inputs, c)
        if metrics_port:
            run("model info, stats and metrics", test_info_stats_metrics, c, metrics_port)
        else:
            failures.append("metrics port")
            print("FAIL the server did not say its metrics port:\n" + s.text().decode(errors="replace"))
        run("worker stopped by SIGTERM while busy, then killed", test_killed_worker, s, c)
    finally:
        code = s.stop()
        if code != 0:
            failures.append(f"main server exit status {code}")
    run("TLS and bearer token", test_tls_token)
    run("SIGTERM drains", test_sigterm_drains)
    run("SIGTERM with a short drain cuts a long stream", test_sigterm_drain_cut)
    run("a second signal ends the drain", test_second_signal_cuts_drain, False)
    run("a second signal ends the drain, no OpenBLAS pool", test_second_signal_cuts_drain, True)
    run("uneven pipeline splits (--stage-layers)", test_stage_layers)
    run("two replicas: routing and migration by strata drain", test_two_replicas_migration)
    run("tiers under load: spills, aborts, cancels and a drain", test_tiers_under_load)
    run("prefix caching", test_prefix_cache)
    failures += [f"sanitizer report in {name}'s log" for name in SANITIZER_REPORTS]
    if failures:
        print("main server log:\n" + s.text().decode(errors="replace")[-6000:])
        print(f"{len(failures)} failed: {failures}")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()

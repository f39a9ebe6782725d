"""End-to-end test of the public gRPC API server (coordinator/server) with a real gRPC client.

Run by test_api.sh as:  /usr/bin/python3 test_api.py API_TESTSERVER STUBS_DIR WORK_DIR
STUBS_DIR holds strata_pb2.py (protoc --python_out); WORK_DIR is a scratch folder (TLS files,
server logs). The server is tests/server/api_testserver: the real server layer over a
deterministic test backend (token i = (fnv1a32(prompt) + i) % 1000, text "t<token> "; see the
comment at the top of api_testserver.c, including its GetStats mapping spills = cancels seen,
restores = aborts found). Calls use generic stubs (channel.unary_stream / unary_unary with the
message classes' serializers), so no grpc_tools plugin is needed.

Every call has a client-side timeout, every server wait is bounded: a hang is a failure, never
a stuck test.
"""
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback

import grpc

SERVER, STUBS, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, STUBS)
import strata_pb2 as pb  # noqa: E402

T = 20  # default client timeout (seconds) for calls that should finish quickly


# ------------------------------------------------------------------------------------------
# Helpers

class Server:
    """One api_testserver process; prints 'port N' when serving."""

    def __init__(self, name, *args):
        self.name = name
        self.log = open(os.path.join(WORK, name + ".log"), "w+b")
        self.proc = subprocess.Popen([SERVER, "--listen", "127.0.0.1:0", *args],
                                     stdout=subprocess.PIPE, stderr=self.log)
        line = self._readline(10)
        if not line.startswith(b"port "):
            self.proc.kill()
            raise RuntimeError("%s: no port line (got %r); log:\n%s" % (name, line, self.log_text()))
        self.port = int(line.split()[1])

    def _readline(self, timeout):
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return out[0] if out else b""

    def log_text(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self, timeout=10):
        """SIGTERM; returns (exit code, seconds taken). Kills it after timeout."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = "hung (killed after %ds)" % timeout
        return rc, time.monotonic() - t0


class Client:
    def __init__(self, target, creds=None, options=None):
        self.target = target
        if creds is None:
            self.ch = grpc.insecure_channel(target, options=options or [])
        else:
            self.ch = grpc.secure_channel(target, creds, options=options or [])

        def uu(name, req, resp):
            return self.ch.unary_unary("/strata.v1.Strata/" + name, request_serializer=req.SerializeToString,
                                       response_deserializer=resp.FromString)

        self.generate = self.ch.unary_stream("/strata.v1.Strata/Generate",
                                             request_serializer=pb.GenerateRequest.SerializeToString,
                                             response_deserializer=pb.GenerateResponse.FromString)
        self.generate_raw = self.ch.unary_stream("/strata.v1.Strata/Generate", request_serializer=lambda b: b,
                                                 response_deserializer=pb.GenerateResponse.FromString)
        self.abort = uu("Abort", pb.AbortRequest, pb.AbortResponse)
        self.health = uu("Health", pb.HealthRequest, pb.HealthResponse)
        self.model_info = uu("GetModelInfo", pb.ModelInfoRequest, pb.ModelInfo)
        self.stats_call = uu("GetStats", pb.StatsRequest, pb.Stats)
        self.drain = uu("DrainWorker", pb.DrainWorkerRequest, pb.DrainWorkerResponse)

    def stats(self, **kw):
        return self.stats_call(pb.StatsRequest(), timeout=T, **kw)

    def close(self):
        self.ch.close()


def fnv1a32(data):
    h = 2166136261
    for b in data:
        h ^= b
        h = (h * 16777619) & 0xFFFFFFFF
    return h


def expected_tokens(prompt, n):
    if isinstance(prompt, str):
        h = fnv1a32(prompt.encode())
    else:
        h = fnv1a32(b"".join(int(v).to_bytes(4, "little") for v in prompt))
    return [(h + i) % 1000 for i in range(n)]


def req(text=None, ids=None, max_tokens=10, rid="", **sampling):
    r = pb.GenerateRequest(request_id=rid, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))
    if text is not None:
        r.text = text
    if ids is not None:
        r.token_ids.ids.extend(ids)
    return r


def collect(stream):
    """(chunks' ids, text, list of non-chunk responses, request ids seen)."""
    ids, text, tail, rids = [], "", [], set()
    for r in stream:
        rids.add(r.request_id)
        kind = r.WhichOneof("kind")
        if kind == "chunk":
            if tail:
                raise AssertionError("chunk after a final message")
            ids.extend(r.chunk.token_ids)
            text += r.chunk.text
        else:
            tail.append(r)
    return ids, text, tail, rids


def expect_status(fn, code, contains=None):
    try:
        res = fn()
        if hasattr(res, "__iter__") and not isinstance(res, (bytes, str)):
            for _ in res:
                pass
    except grpc.RpcError as e:
        if e.code() != code:
            raise AssertionError("expected %s, got %s: %s" % (code, e.code(), e.details()))
        if contains is not None and contains not in (e.details() or ""):
            raise AssertionError("expected %r in the status message, got %r" % (contains, e.details()))
        if code != grpc.StatusCode.OK and not e.details():
            raise AssertionError("%s without a message" % code)
        return e
    raise AssertionError("expected %s, the call succeeded" % code)


def wait_for(pred, timeout=5.0, what="condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out waiting for " + what)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


# ------------------------------------------------------------------------------------------
# Tests on the plain server

def test_basic_stream(c):
    ids, text, tail, rids = collect(c.generate(req("hello world", max_tokens=20, rid="basic-1"), timeout=T))
    exp = expected_tokens("hello world", 20)
    check(ids == exp, "tokens %s != %s" % (ids, exp))
    check(text == "".join("t%d " % t for t in exp), "text mismatch: %r" % text)
    check(len(tail) == 1 and tail[0].WhichOneof("kind") == "complete", "want exactly one Complete: %s" % tail)
    cm = tail[0].complete
    check(cm.finish_reason == pb.FINISH_REASON_LENGTH, "finish_reason %s" % cm.finish_reason)
    check(cm.prompt_tokens == 11 and cm.completion_tokens == 20 and cm.cached_tokens == 0, "counts %s" % cm)
    check(rids == {"basic-1"}, "request ids %s" % rids)


def test_token_ids_and_stop(c):
    prompt = [1, 2, 3]
    exp = expected_tokens(prompt, 5)
    ids, _, tail, _ = collect(c.generate(req(ids=prompt, max_tokens=50, stop_token_ids=[exp[4]]), timeout=T))
    check(ids == exp, "tokens %s != %s" % (ids, exp))
    cm = tail[0].complete
    check(cm.finish_reason == pb.FINISH_REASON_STOP and cm.completion_tokens == 5 and cm.prompt_tokens == 3,
          "complete %s" % cm)


def test_assigned_id(c):
    _, _, tail, rids = collect(c.generate(req("assign me", max_tokens=3), timeout=T))
    check(len(rids) == 1, "one id for the whole stream: %s" % rids)
    rid = rids.pop()
    check(rid.startswith("srv-") and len(rid) <= 128, "assigned id %r" % rid)
    _, _, _, rids2 = collect(c.generate(req("assign me", max_tokens=3), timeout=T))
    check(rids2.pop() != rid, "assigned ids must differ")
    # An empty request_id sent explicitly (field 1, length 0: Python's protobuf never writes it)
    # gets an id too; the server's copy of the empty string is freed (ASan's leak check).
    raw = b"\x0a\x00" + req("assign me", max_tokens=3).SerializeToString()
    _, _, _, rids3 = collect(c.generate_raw(raw, timeout=T))
    check(len(rids3) == 1 and rids3.pop().startswith("srv-"), "explicit empty id: %s" % rids3)


def test_concurrent_32(c):
    """32 streams at once: 8 on the shared channel, 24 over 3 more connections."""
    results, errors = {}, []
    extra = [Client(c.target) for _ in range(3)]
    clients = [c] + extra

    def one(i):
        try:
            prompt = "concurrent prompt %d" % i
            cl = clients[i % 4]
            ids, text, tail, rids = collect(cl.generate(req(prompt, max_tokens=30, rid="cc-%d" % i), timeout=T))
            results[i] = (ids == expected_tokens(prompt, 30) and len(tail) == 1
                          and tail[0].complete.completion_tokens == 30 and rids == {"cc-%d" % i})
        except Exception as e:  # noqa: BLE001
            errors.append("stream %d: %r" % (i, e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T + 5)
    for x in extra:
        x.close()
    check(not errors, "; ".join(errors))
    check(len(results) == 32 and all(results.values()), "bad streams: %s" %
          [i for i in range(32) if not results.get(i)])


def test_abort(c):
    before = c.stats()
    stream = c.generate(req("abort me", max_tokens=100000, rid="abort-1"), timeout=T)
    got = []
    for r in stream:
        got.extend(r.chunk.token_ids)
        if len(got) >= 5:
            break
    res = c.abort(pb.AbortRequest(request_id="abort-1"), timeout=T)
    check(res.found, "Abort of a running request must find it")
    ids, _, tail, _ = collect(stream)
    got += ids
    check(len(tail) == 1 and tail[0].complete.finish_reason == pb.FINISH_REASON_ABORT, "tail %s" % tail)
    check(tail[0].complete.completion_tokens == len(got), "completion_tokens %d, received %d"
          % (tail[0].complete.completion_tokens, len(got)))
    check(got == expected_tokens("abort me", len(got)), "token sequence")
    check(c.stats().restores == before.restores + 1, "backend counted the abort")
    res = c.abort(pb.AbortRequest(request_id="no-such-request"), timeout=T)
    check(not res.found, "Abort of an unknown id: found=false")
    res = c.abort(pb.AbortRequest(request_id="abort-1"), timeout=T)
    check(not res.found, "Abort after the request ended: found=false")
    expect_status(lambda: c.abort(pb.AbortRequest(request_id=""), timeout=T), grpc.StatusCode.INVALID_ARGUMENT,
                  "request_id")


def test_bad_inputs(c):
    bad = [
        (req("x", temperature=-1.0), "temperature"),
        (req("x", top_p=1.5), "top_p"),
        (req("x", max_tokens=0), "max_tokens"),
        (req("x", max_tokens=100001), "max_tokens"),
        (req("x", rid="r" * 200), "request_id"),
        (req("x", rid="has space"), "request_id"),
        (req(max_tokens=5), "input"),
        (req(ids=[5000]), "token_ids"),
        (req("x", stop_token_ids=[1000]), "stop_token_ids"),
        (req("x", stop=[""]), "stop"),
        (pb.GenerateRequest(text="no sampling"), "max_tokens"),
        (pb.GenerateRequest(text="x", kv_codec="/etc/passwd", sampling=pb.SamplingParams(max_tokens=1)),
         "kv_codec"),
    ]
    for r, field in bad:
        expect_status(lambda r=r: c.generate(r, timeout=T), grpc.StatusCode.INVALID_ARGUMENT, field)
    # Invalid UTF-8 in text: protobuf's Python API will not encode it, so send raw bytes:
    # field 2 (text) = C3 28, field 4 (sampling) = {max_tokens: 5}.
    raw = b"\x12\x02\xc3\x28" + b"\x22\x02\x28\x05"
    expect_status(lambda: c.generate_raw(raw, timeout=T), grpc.StatusCode.INVALID_ARGUMENT, "UTF-8")
    # U+0000 inside the prompt or a stop string: refused, not cut short at the NUL.
    expect_status(lambda: c.generate(req("before\x00after", max_tokens=2), timeout=T),
                  grpc.StatusCode.INVALID_ARGUMENT, "text contains a NUL byte")
    expect_status(lambda: c.generate(req("x", stop=["a\x00b"], max_tokens=2), timeout=T),
                  grpc.StatusCode.INVALID_ARGUMENT, "stop contains a NUL byte")
    # Bytes that are not a GenerateRequest at all: INTERNAL, as gRPC reports unparsable messages.
    expect_status(lambda: c.generate_raw(b"\x12\x7f", timeout=T), grpc.StatusCode.INTERNAL)
    # The server keeps serving.
    ids, _, tail, _ = collect(c.generate(req("still alive", max_tokens=4), timeout=T))
    check(ids == expected_tokens("still alive", 4) and len(tail) == 1, "serving after bad inputs")


def test_duplicate_id(c):
    stream = c.generate(req("dup", max_tokens=100000, rid="dup-1"), timeout=T)
    next(iter(stream))
    expect_status(lambda: c.generate(req("dup again", max_tokens=3, rid="dup-1"), timeout=T),
                  grpc.StatusCode.ALREADY_EXISTS, "dup-1")
    check(c.abort(pb.AbortRequest(request_id="dup-1"), timeout=T).found, "abort dup-1")
    _, _, tail, _ = collect(stream)
    check(tail[0].complete.finish_reason == pb.FINISH_REASON_ABORT, "dup-1 aborted")
    # The id is free again once the first request ended.
    _, _, tail, _ = collect(c.generate(req("dup reuse", max_tokens=2, rid="dup-1"), timeout=T))
    check(tail[0].complete.completion_tokens == 2, "id reusable after the request ended")


def test_oversized(c):
    big = req("a" * (5 << 20), max_tokens=1)
    expect_status(lambda: c.generate(big, timeout=T), grpc.StatusCode.RESOURCE_EXHAUSTED)
    # Within gRPC's limit (2 MiB) but above validation's 1 MiB text limit: INVALID_ARGUMENT.
    expect_status(lambda: c.generate(req("a" * (3 << 19), max_tokens=1), timeout=T),
                  grpc.StatusCode.INVALID_ARGUMENT, "text")
    ids, _, _, _ = collect(c.generate(req("after big", max_tokens=2), timeout=T))
    check(len(ids) == 2, "serving after an oversized message")


def test_compressed_refused(c):
    """gRPC inflates a compressed message whole before its size limit applies (a 3.5 MB request
    took 3.8 GB of memory): the server takes identity encoding only, for every method."""
    expect_status(lambda: c.generate(req("zipped", max_tokens=1), timeout=T, compression=grpc.Compression.Gzip),
                  grpc.StatusCode.UNIMPLEMENTED, "gzip")
    expect_status(lambda: c.health(pb.HealthRequest(), timeout=T, compression=grpc.Compression.Gzip),
                  grpc.StatusCode.UNIMPLEMENTED, "gzip")
    ids, _, _, _ = collect(c.generate(req("plain", max_tokens=2), timeout=T))
    check(len(ids) == 2, "serving uncompressed requests")


class RawH2:
    """A bare HTTP/2 client whose receive window is 0: the server can never send it DATA, so a
    stream's messages and status stay queued (a client that stopped reading, or vanished while
    its TCP connection lives). It answers SETTINGS and PING so the connection stays healthy."""

    def __init__(self, port):
        import socket
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.lock = threading.Lock()
        self.sid = 1
        self.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + self.frame(4, 0, 0, struct.pack(">HI", 4, 0)))
        threading.Thread(target=self.read, daemon=True).start()

    @staticmethod
    def frame(kind, flags, sid, payload=b""):
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + payload

    def send(self, data):
        with self.lock:
            self.sock.sendall(data)

    def read(self):
        buf = b""
        while True:
            try:
                got = self.sock.recv(65536)
            except OSError:
                return
            if not got:
                return
            buf += got
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                payload, buf = buf[9:9 + n], buf[9 + n:]
                if kind == 4 and not flags & 1:
                    self.send(self.frame(4, 1, 0))
                elif kind == 6 and not flags & 1:
                    self.send(self.frame(6, 1, 0, payload))

    def generate(self, message):
        def literal(name, value):   # HPACK literal header field without indexing, new name
            return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
        head = b"".join(literal(k, v) for k, v in [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/strata.v1.Strata/Generate"),
            (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
        body = message.SerializeToString()
        sid, self.sid = self.sid, self.sid + 2
        self.send(self.frame(1, 4, sid, head) + self.frame(0, 1, sid, b"\x00" + struct.pack(">I", len(body)) + body))

    def close(self):
        self.sock.close()


def test_lingering_streams_freed():
    """A client that opens streams and never reads them held their slots after they finished,
    for as long as its connection lived: every other client got RESOURCE_EXHAUSTED. A finished
    stream whose end is not taken within 10 s is now cancelled and its slot freed."""
    s = Server("linger", "--max-streams", "4")
    try:
        c = Client("127.0.0.1:%d" % s.port)
        raw = RawH2(s.port)
        for i in range(4):
            raw.generate(req("unread %d" % i, max_tokens=1))
        wait_for(lambda: c.stats().requests_total == 4 and c.stats().running == 0, 10, "the 4 streams finished")
        expect_status(lambda: c.generate(req("held", max_tokens=1), timeout=T),
                      grpc.StatusCode.RESOURCE_EXHAUSTED, "concurrent")
        t0 = time.monotonic()
        ids = wait_for(lambda: _try_generate(c, "after the linger", 2), 20, "a slot freed from the unread streams")
        check(len(ids) == 2 and time.monotonic() - t0 > 5, "served once the unread streams were cancelled")
        raw.close()
        c.close()
    finally:
        rc, _ = s.stop()
        check(rc == 0, "linger server exit %s; log:\n%s" % (rc, s.log_text()))


def test_cancel(c):
    before = c.stats()
    stream = c.generate(req("cancel me", max_tokens=100000, rid="cancel-1"), timeout=T)
    n = 0
    for _ in stream:
        n += 1
        if n == 3:
            break
    stream.cancel()
    wait_for(lambda: c.stats().spills >= before.spills + 1, what="the backend's cancel callback")
    wait_for(lambda: c.stats().running == before.running, what="the backend to drop the request")
    check(not c.abort(pb.AbortRequest(request_id="cancel-1"), timeout=T).found, "cancelled request is gone")


def test_deadline(c):
    before = c.stats()
    t0 = time.monotonic()
    expect_status(lambda: c.generate(req("slow", max_tokens=100000), timeout=0.4),
                  grpc.StatusCode.DEADLINE_EXCEEDED)
    check(time.monotonic() - t0 < 5, "deadline honoured promptly")
    wait_for(lambda: c.stats().spills >= before.spills + 1, what="cancel after the deadline")
    wait_for(lambda: c.stats().running == before.running, what="the backend to drop the request")


def test_info(c):
    h = c.health(pb.HealthRequest(), timeout=T)
    check(h.status == pb.SERVING_STATUS_SERVING and h.workers_ready == 1 and h.workers_total == 1, "health %s" % h)
    mi = c.model_info(pb.ModelInfoRequest(), timeout=T)
    check(mi.name == "api-testserver" and mi.n_vocab == 1000 and mi.default_kv_codec == "fp16", "model %s" % mi)
    st = c.stats()
    check(len(st.tiers) == 1 and st.tiers[0].name == "device" and st.requests_total > 0, "stats %s" % st)
    # The test backend has no drain_worker callback: a valid name is UNIMPLEMENTED, a bad one refused first.
    expect_status(lambda: c.drain(pb.DrainWorkerRequest(worker_name="w0"), timeout=T), grpc.StatusCode.UNIMPLEMENTED)
    expect_status(lambda: c.drain(pb.DrainWorkerRequest(worker_name=""), timeout=T), grpc.StatusCode.INVALID_ARGUMENT)
    expect_status(lambda: c.drain(pb.DrainWorkerRequest(worker_name="a\nb"), timeout=T),
                  grpc.StatusCode.INVALID_ARGUMENT)
    # Not UTF-8 (written by hand: protobuf refuses to encode it): refused as a worker's own name is.
    drain_raw = c.ch.unary_unary("/strata.v1.Strata/DrainWorker", request_serializer=lambda b: b,
                                 response_deserializer=pb.DrainWorkerResponse.FromString)
    expect_status(lambda: drain_raw(b"\x0a\x02w\xff", timeout=T), grpc.StatusCode.INVALID_ARGUMENT, "UTF-8")


def test_backend_errors(c):
    expect_status(lambda: c.generate(req("reject please", max_tokens=3), timeout=T),
                  grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    expect_status(lambda: c.generate(req("earlyfail", max_tokens=3), timeout=T), grpc.StatusCode.UNAVAILABLE,
                  "worker lost")
    ids, _, tail, _ = collect(c.generate(req("midfail", max_tokens=10), timeout=T))
    check(ids == expected_tokens("midfail", 3), "3 chunks before the failure")
    check(len(tail) == 1 and tail[0].WhichOneof("kind") == "error", "Error message: %s" % tail)
    check(tail[0].error.code == grpc.StatusCode.UNAVAILABLE.value[0] and "worker lost" in tail[0].error.message,
          "error %s" % tail[0].error)


def test_unknown_method(c):
    m = c.ch.unary_unary("/strata.v1.Strata/NoSuchMethod", request_serializer=lambda b: b,
                         response_deserializer=lambda b: b)
    expect_status(lambda: m(b"", timeout=T), grpc.StatusCode.UNIMPLEMENTED)
    m = c.ch.unary_unary("/other.Service/Call", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    expect_status(lambda: m(b"", timeout=T), grpc.StatusCode.UNIMPLEMENTED)


def test_backpressure(c):
    before = c.stats()
    stream = c.generate(req("flood", max_tokens=100000), timeout=60)
    next(iter(stream))
    # Stop reading: flow control fills, the server's per-stream queue (1024 messages) overflows
    # and the stream fails instead of buffering without bound.
    wait_for(lambda: c.stats().spills >= before.spills + 1, timeout=30, what="the overflow's cancel")
    expect_status(lambda: stream, grpc.StatusCode.RESOURCE_EXHAUSTED, "client not reading")
    wait_for(lambda: c.stats().running == before.running, what="the backend to drop the request")


# ------------------------------------------------------------------------------------------
# Other server configurations

def test_max_streams():
    s = Server("max_streams", "--max-streams", "2")
    try:
        c = Client("127.0.0.1:%d" % s.port)
        a = c.generate(req("long a", max_tokens=100000, rid="ms-a"), timeout=T)
        b = c.generate(req("long b", max_tokens=100000, rid="ms-b"), timeout=T)
        next(iter(a))
        next(iter(b))
        expect_status(lambda: c.generate(req("third", max_tokens=2), timeout=T),
                      grpc.StatusCode.RESOURCE_EXHAUSTED, "concurrent")
        c.abort(pb.AbortRequest(request_id="ms-a"), timeout=T)
        collect(a)
        # A slot is free once the aborted stream closed.
        ids = wait_for(lambda: _try_generate(c, "third again", 2), what="a free stream slot")
        check(len(ids) == 2, "third stream after a slot freed")
        b.cancel()
        c.close()
    finally:
        rc, _ = s.stop()
        check(rc == 0, "max_streams server exit %s; log:\n%s" % (rc, s.log_text()))


def _try_generate(c, text, n):
    try:
        ids, _, _, _ = collect(c.generate(req(text, max_tokens=n), timeout=T))
        return ids
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None
        raise


def make_cert(name="cert"):
    cert, key = os.path.join(WORK, name + ".pem"), os.path.join(WORK, name + "-key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-days", "1", "-keyout", key, "-out", cert],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return cert, key


def test_tls_token():
    cert, key = make_cert()
    s = Server("tls", "--tls-cert", cert, "--tls-key", key, "--token", "s3cret-token")
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        c = Client("localhost:%d" % s.port, creds)
        good = (("authorization", "Bearer s3cret-token"),)
        ids, _, tail, _ = collect(c.generate(req("over tls", max_tokens=5), timeout=T, metadata=good))
        check(ids == expected_tokens("over tls", 5) and len(tail) == 1, "TLS stream with the right token")
        check(c.stats(metadata=good).requests_total == 1, "GetStats with the token")
        for md, why in [((), "missing"), ((("authorization", "Bearer wrong"),), "wrong"),
                        ((("authorization", "s3cret-token"),), "no scheme")]:
            expect_status(lambda md=md: c.generate(req("x", max_tokens=2), timeout=T, metadata=md),
                          grpc.StatusCode.UNAUTHENTICATED)
            expect_status(lambda md=md: c.stats(metadata=md), grpc.StatusCode.UNAUTHENTICATED)
            expect_status(lambda md=md: c.abort(pb.AbortRequest(request_id="a"), timeout=T, metadata=md),
                          grpc.StatusCode.UNAUTHENTICATED)
            expect_status(lambda md=md: c.model_info(pb.ModelInfoRequest(), timeout=T, metadata=md),
                          grpc.StatusCode.UNAUTHENTICATED)
            expect_status(lambda md=md: c.drain(pb.DrainWorkerRequest(worker_name="w0"), timeout=T, metadata=md),
                          grpc.StatusCode.UNAUTHENTICATED)
        e = expect_status(lambda: c.generate(req("x", max_tokens=2), timeout=T, metadata=(("authorization",
                                                                                          "Bearer wrong"),)),
                          grpc.StatusCode.UNAUTHENTICATED)
        check("s3cret" not in e.details() and "Bearer wrong" not in e.details(), "no token in the message")
        # Health is exempt (probes need no secret).
        h = c.health(pb.HealthRequest(), timeout=T)
        check(h.status == pb.SERVING_STATUS_SERVING, "health without a token")
        check(c.stats(metadata=good).requests_total == 1, "refused calls never reached the backend")
        c.close()
        # A plaintext client cannot talk to the TLS port.
        p = Client("127.0.0.1:%d" % s.port)
        expect_status(lambda: p.health(pb.HealthRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
        p.close()
    finally:
        rc, _ = s.stop()
        check(rc == 0, "tls server exit %s; log:\n%s" % (rc, s.log_text()))
    # --auth-health: Health needs the token too.
    s = Server("tls_auth_health", "--tls-cert", cert, "--tls-key", key, "--token", "t", "--auth-health")
    try:
        c = Client("localhost:%d" % s.port, grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read()))
        expect_status(lambda: c.health(pb.HealthRequest(), timeout=T), grpc.StatusCode.UNAUTHENTICATED)
        c.health(pb.HealthRequest(), timeout=T, metadata=(("authorization", "Bearer t"),))
        c.close()
    finally:
        rc, _ = s.stop()
        check(rc == 0, "tls_auth_health server exit %s" % rc)


def test_start_errors():
    # Missing TLS file, and a port that is taken: the server reports and exits 1.
    r = subprocess.run([SERVER, "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.pem"],
                       capture_output=True, timeout=20)
    check(r.returncode == 1 and b"cannot read the TLS certificate" in r.stderr, "missing cert: %r" % r.stderr)
    # PEM files that are not what they say, a key of another certificate, an encrypted key (no
    # passphrase can be given: refused, not asked for on the terminal): named at start.
    cert, key = make_cert()
    _, other_key = make_cert("other")
    junk = os.path.join(WORK, "junk.pem")
    with open(junk, "w") as f:
        f.write("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")
    locked = os.path.join(WORK, "locked-key.pem")
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:secret", "-out", locked],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for c, k, want in [(junk, key, b"holds no certificate OpenSSL can read"),
                       (cert, junk, b"holds no private key OpenSSL can read"),
                       (cert, locked, b"an encrypted key is not taken"),
                       (cert, other_key, b"does not belong to the certificate")]:
        r = subprocess.run([SERVER, "--tls-cert", c, "--tls-key", k], capture_output=True, timeout=20,
                           stdin=subprocess.DEVNULL)
        check(r.returncode == 1 and want in r.stderr, "TLS pair %s + %s: %r" % (c, k, r.stderr))
    s = Server("port_taken")
    try:
        r = subprocess.run([SERVER, "--listen", "127.0.0.1:%d" % s.port], capture_output=True, timeout=20)
        # said once, in strata's words with gRPC's reason (gRPC's own error line is not printed)
        check(r.returncode == 1 and b"cannot listen on 127.0.0.1:%d: bind: Address already in use\n" % s.port
              in r.stderr and b"chttp2" not in r.stderr, "port in use: %r" % r.stderr)
    finally:
        s.stop()


def test_shutdown_drain_completes():
    """SIGTERM while a short stream runs: it finishes during the drain; exit 0."""
    s = Server("drain", "--drain-ms", "5000")
    c = Client("127.0.0.1:%d" % s.port)
    stream = c.generate(req("drain me", max_tokens=60), timeout=T)
    first = next(iter(stream))
    s.proc.send_signal(signal.SIGTERM)
    ids, _, tail, _ = collect(stream)
    ids = list(first.chunk.token_ids) + ids
    check(ids == expected_tokens("drain me", 60) and len(tail) == 1
          and tail[0].complete.finish_reason == pb.FINISH_REASON_LENGTH, "stream finished during the drain")
    rc, took = s.stop()
    check(rc == 0 and took < 5, "drain server exit %s after %.1fs; log:\n%s" % (rc, took, s.log_text()))
    c.close()


def test_shutdown_cancels():
    """SIGTERM while a long stream runs: after the drain it ends with an Error message
    (UNAVAILABLE) then status OK, as a failure after output does; exit 0 quickly."""
    s = Server("shutdown", "--drain-ms", "300")
    c = Client("127.0.0.1:%d" % s.port)
    stream = c.generate(req("endless", max_tokens=100000), timeout=30)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    _, _, tail, _ = collect(stream)  # raises on a non-OK status
    check(len(tail) == 1 and tail[0].WhichOneof("kind") == "error"
          and tail[0].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
          and tail[0].error.message == "server shutting down", "Error message: %s" % tail)
    check(time.monotonic() - t0 < 5, "stream ended promptly")
    rc, took = s.stop()
    check(rc == 0 and took < 5, "shutdown server exit %s after %.1fs; log:\n%s" % (rc, took, s.log_text()))
    c.close()


def test_shutdown_stuck_client():
    """SIGTERM while a client does not read a flooding stream: the status cannot pass the
    blocked message, so the server cancels the call after its grace period; exit 0 anyway."""
    s = Server("shutdown_stuck", "--drain-ms", "200", "--max-queue", "1000000")
    c = Client("127.0.0.1:%d" % s.port)
    stream = c.generate(req("flood", max_tokens=100000), timeout=30)
    next(iter(stream))
    time.sleep(1.0)  # let flow control close the window
    s.proc.send_signal(signal.SIGTERM)
    rc, took = s.stop()
    check(rc == 0 and took < 5, "stuck-client server exit %s after %.1fs; log:\n%s" % (rc, took, s.log_text()))
    t0 = time.monotonic()
    try:
        for _ in stream:
            pass
        raise AssertionError("a flood stream cannot end with OK here")
    except grpc.RpcError as e:
        # UNAVAILABLE: "server shutting down" if the trailers made it, else "Socket closed".
        check(e.code() == grpc.StatusCode.UNAVAILABLE, "status %s %s" % (e.code(), e.details()))
        print("     stuck client got %s %r after the server exited (%.1fs)" % (e.code(), e.details(), took))
    check(time.monotonic() - t0 < 10, "the client learns promptly")
    c.close()


def test_shutdown_completed_unread():
    """SIGTERM after the backend has finished a long stream the client is still reading slowly:
    the client gets every chunk and the Complete message, or a non-OK status; never status OK
    after a truncated stream without its final message."""
    s = Server("completed_unread", "--drain-ms", "200", "--max-queue", "1000000", "--tick-ms", "1")
    c = Client("127.0.0.1:%d" % s.port)
    n = 20000
    stream = c.generate(req("flood", max_tokens=n), timeout=60)
    next(iter(stream))
    time.sleep(2.0)  # the backend has produced every token and ended the stream by now
    s.proc.send_signal(signal.SIGTERM)
    chunks, final = 1, []
    try:
        for m in stream:
            if m.WhichOneof("kind") == "chunk":
                chunks += 1
                time.sleep(0.0005)
            else:
                final.append(m)
        check(chunks == n and len(final) == 1 and final[0].WhichOneof("kind") == "complete",
              "status OK after %d of %d chunks, final messages %s" % (chunks, n, final))
        print("     the client read the whole stream (%d chunks) and its Complete" % chunks)
    except grpc.RpcError as e:
        check(e.code() != grpc.StatusCode.OK, "a non-OK status")
        print("     the client got %s after %d of %d chunks" % (e.code(), chunks, n))
    rc, took = s.stop()
    check(rc == 0, "server exit %s after %.1fs; log:\n%s" % (rc, took, s.log_text()))
    c.close()


# ------------------------------------------------------------------------------------------

def main():
    failed = []

    def run(name, fn, *args):
        t0 = time.monotonic()
        try:
            fn(*args)
            print("ok   %-28s %.2fs" % (name, time.monotonic() - t0), flush=True)
        except Exception:  # noqa: BLE001
            failed.append(name)
            print("FAIL %s\n%s" % (name, traceback.format_exc()), flush=True)

    main_srv = Server("main", "--tick-ms", "2")
    c = Client("127.0.0.1:%d" % main_srv.port)
    try:
        for name, fn in [("basic_stream", test_basic_stream), ("token_ids_and_stop", test_token_ids_and_stop),
                         ("assigned_id", test_assigned_id), ("concurrent_32", test_concurrent_32),
                         ("abort", test_abort), ("bad_inputs", test_bad_inputs), ("duplicate_id", test_duplicate_id),
                         ("oversized", test_oversized), ("cancel", test_cancel), ("deadline", test_deadline),
                         ("info", test_info), ("backend_errors", test_backend_errors),
                         ("unknown_method", test_unknown_method), ("backpressure", test_backpressure),
                         ("compressed_refused", test_compressed_refused)]:
            run(name, fn, c)
        run("still_serving", test_basic_stream, c)
    finally:
        c.close()
        rc, took = main_srv.stop()
        if rc != 0:
            failed.append("main_server_exit")
            print("FAIL main server exit %s after %.1fs; log:\n%s" % (rc, took, main_srv.log_text()))
        else:
            print("ok   main server exit 0 after %.2fs" % took)
        # The server layer logs only contract violations and internal failures: none expected.
        bad = [l for l in main_srv.log_text().splitlines() if "strata api_server:" in l]
        if bad:
            failed.append("main_server_log")
            print("FAIL main server logged:\n" + "\n".join(bad))
    run("max_streams", test_max_streams)
    run("lingering_streams_freed", test_lingering_streams_freed)
    run("tls_token", test_tls_token)
    run("start_errors", test_start_errors)
    run("shutdown_drain_completes", test_shutdown_drain_completes)
    run("shutdown_cancels", test_shutdown_cancels)
    run("shutdown_stuck_client", test_shutdown_stuck_client)
    run("shutdown_completed_unread", test_shutdown_completed_unread)
    if failed:
        print("FAILED: " + ", ".join(failed))
        sys.exit(1)
    print("all server API tests passed (grpcio %s, protobuf %s)" % (grpc.__version__,
                                                                    __import__("google.protobuf").protobuf.__version__))


if __name__ == "__main__":
    main()

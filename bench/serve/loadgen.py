#!/usr/bin/python3
"""Load generator for strata's public gRPC API (proto/strata.proto), with a sequential baseline.

For each concurrency level C of the sweep, C client threads replay the same deterministic list of
N Generate requests (closed loop: a thread sends its next request as soon as the previous one
ends) and the tool reports requests ok/failed (with their gRPC codes), output tokens/s,
requests/s, and percentiles of time to first token (TTFT), inter-token latency (ITL), time per
output token (TPOT) and end-to-end latency. With --baseline it also runs the same requests one
after another, each as its own `strata generate` process, and reports the served throughput as a
multiple of that sequential run. See bench/serve/README.md for definitions and caveats.

Needs /usr/bin/python3 with grpcio and protobuf, and protoc (the message classes are generated
from proto/strata.proto into a temporary folder at start; calls use generic stubs).

Examples:
  bench/serve/loadgen.py --server 127.0.0.1:50051 --concurrency 1,4,16 --requests 32
  bench/serve/loadgen.py --start "build/strata serve --listen 127.0.0.1:{port}" \\
      --baseline "build/strata generate" --json out.json
  bench/serve/loadgen.py --self-test
"""
import argparse
import atexit
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

pb = None    # strata_pb2, imported by load_stubs()
grpc = None  # imported lazily so that --help and --self-test work without grpcio

# Words that the default model's tokenizer (SmolLM2, byte-level BPE) keeps as one token each when
# preceded by a space, so a prompt of "the" plus N-1 of these words, space-separated, is N prompt
# tokens on that model (checked with `strata generate --stats`, see README). Other tokenizers give
# other counts: the server's Complete.prompt_tokens is reported beside the target.
WORDS = """
of and to in is that for it as was with be by on not he this are or his from at which but have an
had they you were their one all we can her has there been if more when will would who so no time
people year way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night
point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea body information back parent face level office door
health person art war history party result change morning reason research girl moment air teacher
force education early small large great little old new good long high young different important
public bad same able last next few open full best free real sure clear true hard simple strong low
green red blue white black cold warm dark light short deep wide quick slow river stone tree road
field garden window table paper letter music voice picture color sound food bread fire wind rain
snow sea sky sun moon star town market bridge train ship plan model test answer value price cost
rate size form order note list page step
""".split()
FIRST_WORD = "the"

PERCENTILES = (50, 90, 99)
PERCENTILE_METHOD = ("linear interpolation between closest ranks: value at rank (n-1)*p/100 "
                     "(numpy.percentile's default, Hyndman-Fan type 7)")
ITL_METHOD = ("per token: for each chunk after the first token-carrying chunk of a request, the "
              "gap since the previous token-carrying chunk divided by the chunk's token count, "
              "counted once per token; pooled over all tokens of all successful requests")

GRPC_CODE_NAMES = {0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
                   5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
                   9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
                   13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED"}


def log(msg):
    sys.stderr.write("loadgen: %s\n" % msg)
    sys.stderr.flush()


class Fatal(Exception):
    """An error that ends the run with a one-line message (exit 1)."""


# ------------------------------------------------------------------------------------------
# Statistics

def percentile(values, p):
    """The p-th percentile (0 <= p <= 100) of values by linear interpolation between closest
    ranks (numpy's default). None for an empty sequence."""
    if not 0 <= p <= 100:
        raise ValueError("percentile %r outside [0, 100]" % (p,))
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * (p / 100.0)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def pct_summary(values):
    xs = sorted(values)
    out = {"n": len(xs)}
    for p in PERCENTILES:
        out["p%d" % p] = percentile(xs, p)
    out["mean"] = statistics.fmean(xs) if xs else None
    out["max"] = xs[-1] if xs else None
    return out


def itl_samples(chunk_times, chunk_tokens):
    """Per-token inter-token latencies of one request (see ITL_METHOD): chunk_times are arrival
    times (seconds, increasing), chunk_tokens the token count of each chunk. Chunks without tokens
    are ignored; tokens that arrive in the same chunk as the first token count toward TTFT only."""
    out = []
    prev = None
    for t, n in zip(chunk_times, chunk_tokens):
        if n <= 0:
            continue
        if prev is not None:
            out.extend([(t - prev) / n] * n)
        prev = t
    return out


def tpot(first_to_last, tokens, first_chunk_tokens):
    """Time per output token after the first chunk: (last token time - first token time) /
    (tokens - tokens of the first chunk); None when only one chunk carried tokens."""
    rest = tokens - first_chunk_tokens
    if rest <= 0:
        return None
    return first_to_last / rest


# ------------------------------------------------------------------------------------------
# Workload

class Dist:
    """An integer distribution from a spec: N or fixed:N, uniform:A:B (inclusive),
    normal:MEAN:SD[:MIN:MAX] (rounded, clipped; MIN defaults to 1), choice:A,B,C."""

    def __init__(self, spec):
        self.spec = spec
        parts = spec.strip().split(":")
        kind = parts[0].lower()
        try:
            if len(parts) == 1 and kind.isdigit():
                self.kind, self.args = "fixed", (int(kind),)
            elif kind == "fixed" and len(parts) == 2:
                self.kind, self.args = "fixed", (int(parts[1]),)
            elif kind == "uniform" and len(parts) == 3:
                a, b = int(parts[1]), int(parts[2])
                if a > b:
                    raise ValueError("uniform needs A <= B")
                self.kind, self.args = "uniform", (a, b)
            elif kind == "normal" and len(parts) in (3, 5):
                mean, sd = float(parts[1]), float(parts[2])
                lo = int(parts[3]) if len(parts) == 5 else 1
                hi = int(parts[4]) if len(parts) == 5 else None
                if sd < 0 or (hi is not None and lo > hi):
                    raise ValueError("normal needs SD >= 0 and MIN <= MAX")
                self.kind, self.args = "normal", (mean, sd, lo, hi)
            elif kind == "choice" and len(parts) == 2:
                vals = tuple(int(v) for v in parts[1].split(",") if v.strip())
                if not vals:
                    raise ValueError("choice needs values")
                self.kind, self.args = "choice", vals
            else:
                raise ValueError("unknown form")
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                "bad distribution %r (%s); use N, fixed:N, uniform:A:B, normal:MEAN:SD[:MIN:MAX] "
                "or choice:A,B,C" % (spec, e))
        if self.min() < 1:
            raise argparse.ArgumentTypeError("bad distribution %r: values must be at least 1" % spec)

    def min(self):
        if self.kind == "fixed":
            return self.args[0]
        if self.kind == "uniform":
            return self.args[0]
        if self.kind == "normal":
            return self.args[2]
        return min(self.args)

    def max(self):
        if self.kind in ("fixed",):
            return self.args[0]
        if self.kind == "uniform":
            return self.args[1]
        if self.kind == "normal":
            return self.args[3]  # may be None: unbounded
        return max(self.args)

    def sample(self, rng):
        if self.kind == "fixed":
            return self.args[0]
        if self.kind == "uniform":
            return rng.randint(*self.args)
        if self.kind == "normal":
            mean, sd, lo, hi = self.args
            v = int(round(rng.gauss(mean, sd)))
            v = max(v, lo)
            return min(v, hi) if hi is not None else v
        return rng.choice(self.args)

    def __str__(self):
        return self.spec


def build_requests(n, prompt_dist, max_dist, seed, prefix=""):
    """The deterministic request list: [{index, prompt, prompt_words, max_tokens}]. Prompts are
    "the" followed by words drawn from WORDS, prompt_words words in all, after prefix (if any)
    and a space."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = prompt_dist.sample(rng)
        mt = max_dist.sample(rng)
        text = " ".join([FIRST_WORD] + [rng.choice(WORDS) for _ in range(words - 1)])
        if prefix:
            text = prefix + " " + text
        out.append({"index": i, "prompt": text, "prompt_words": words, "max_tokens": mt})
    return out


# ------------------------------------------------------------------------------------------
# gRPC client

def load_stubs(proto):
    """Generates strata_pb2 with protoc into a temporary folder and imports it (and grpc)."""
    global pb, grpc
    try:
        import grpc as _grpc
        import google.protobuf  # noqa: F401
    except ImportError as e:
        raise Fatal("%s has no grpc or protobuf module (%s); run with /usr/bin/python3" % (sys.executable, e))
    grpc = _grpc
    if not os.path.isfile(proto):
        raise Fatal("proto file %s not found (--proto)" % proto)
    tmp = tempfile.mkdtemp(prefix="loadgen-stubs-")
    atexit.register(shutil.rmtree, tmp, True)
    try:
        r = subprocess.run(["protoc", "--proto_path=" + os.path.dirname(os.path.abspath(proto)),
                            "--python_out=" + tmp, os.path.abspath(proto)], capture_output=True, text=True)
    except FileNotFoundError:
        raise Fatal("protoc is not installed (apt-get install protobuf-compiler)")
    if r.returncode != 0:
        raise Fatal("protoc failed on %s: %s" % (proto, r.stderr.strip()))
    sys.path.insert(0, tmp)
    import strata_pb2  # noqa: E402
    pb = strata_pb2


class Client:
    """Generic stubs over one or more channels (each its own connection)."""

    def __init__(self, target, channels=1, token=None):
        opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
        self.chans = [grpc.insecure_channel(target, options=opts) for _ in range(max(1, channels))]
        self.metadata = [("authorization", "Bearer " + token)] if token else None
        self.gen = [ch.unary_stream("/strata.v1.Strata/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString) for ch in self.chans]

        def uu(name, req, resp):
            return self.chans[0].unary_unary("/strata.v1.Strata/" + name, request_serializer=req.SerializeToString,
                                             response_deserializer=resp.FromString)

        self._health = uu("Health", pb.HealthRequest, pb.HealthResponse)
        self._info = uu("GetModelInfo", pb.ModelInfoRequest, pb.ModelInfo)
        self._stats = uu("GetStats", pb.StatsRequest, pb.Stats)

    def health(self, timeout=5):
        return self._health(pb.HealthRequest(), timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout=10):
        return self._info(pb.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def stats(self, timeout=10):
        return self._stats(pb.StatsRequest(), timeout=timeout, metadata=self.metadata)

    def close(self):
        for ch in self.chans:
            ch.close()


def msg_to_dict(m):
    from google.protobuf import json_format
    try:
        return json_format.MessageToDict(m, preserving_proto_field_name=True, including_default_value_fields=True)
    except TypeError:  # protobuf >= 26 renamed the option
        return json_format.MessageToDict(m, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)


def health_problem(address, token, server=None, wait=10.0):
    """None when the server answers Health SERVING within wait seconds (a fresh channel per try),
    else why not. With server (a StartedServer), also checks that its process is alive."""
    t0 = time.monotonic()
    why = "no answer"
    while True:
        if server is not None and server.proc.poll() is not None:
            return "the server process exited with status %s; last lines of %s:\n%s" % (
                server.proc.returncode, server.log_path, server.tail())
        probe = Client(address, 1, token)
        try:
            h = probe.health(timeout=2)
            if h.status == pb.SERVING_STATUS_SERVING:
                return None
            why = "Health says %s (%d/%d workers ready)" % (pb.ServingStatus.Name(h.status), h.workers_ready,
                                                          h.workers_total)
        except grpc.RpcError as e:
            why = "Health failed: %s: %s" % (e.code().name, e.details())
        finally:
            probe.close()
        if time.monotonic() - t0 >= wait:
            return why
        time.sleep(0.2)


def stats_dict(client):
    try:
        return msg_to_dict(client.stats())
    except grpc.RpcError as e:
        return {"error": "%s: %s" % (e.code().name, e.details())}


def run_one(client, chan, req, rid, args, calls, calls_lock):
    """One Generate call; returns its record. Times are perf_counter seconds."""
    r = pb.GenerateRequest(request_id=rid, text=req["prompt"],
                           sampling=pb.SamplingParams(max_tokens=req["max_tokens"], ignore_eos=args.ignore_eos,
                                                      temperature=args.temperature, seed=args.sampling_seed))
    if args.kv_codec:
        r.kv_codec = args.kv_codec
    rec = {"index": req["index"], "request_id": rid, "max_tokens": req["max_tokens"],
           "prompt_words": req["prompt_words"], "ok": False, "code": None, "message": "",
           "chunk_times": [], "chunk_tokens": [], "tokens": 0, "text": "",
           "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None, "finish_reason": None}
    t0 = time.perf_counter()
    rec["t_start"] = t0
    call = None
    texts = []
    try:
        call = client.gen[chan](r, timeout=args.timeout, metadata=client.metadata)
        with calls_lock:
            calls.add(call)
        final = None
        for resp in call:
            now = time.perf_counter()
            kind = resp.WhichOneof("kind")
            if kind == "chunk":
                if final is not None:
                    rec["code"], rec["message"] = "PROTOCOL", "chunk after the final message"
                    call.cancel()
                    break
                n = len(resp.chunk.token_ids)
                rec["chunk_times"].append(now - t0)
                rec["chunk_tokens"].append(n)
                rec["tokens"] += n
                texts.append(resp.chunk.text)
            elif kind == "complete":
                final = resp
                c = resp.complete
                rec["prompt_tokens"] = c.prompt_tokens
                rec["completion_tokens"] = c.completion_tokens
                rec["cached_tokens"] = c.cached_tokens
                rec["finish_reason"] = pb.FinishReason.Name(c.finish_reason)
            elif kind == "error":
                final = resp
                rec["code"] = "STREAM_" + GRPC_CODE_NAMES.get(resp.error.code, str(resp.error.code))
                rec["message"] = resp.error.message
            else:
                rec["code"], rec["message"] = "PROTOCOL", "response without a kind"
        if rec["code"] is None:
            if final is None:
                rec["code"], rec["message"] = "NO_COMPLETE", "stream ended with OK but without Complete or Error"
            elif rec["completion_tokens"] != rec["tokens"]:
                rec["code"] = "COUNT_MISMATCH"
                rec["message"] = "Complete.completion_tokens %d != %d tokens received" % (
                    rec["completion_tokens"], rec["tokens"])
            else:
                rec["code"], rec["ok"] = "OK", True
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        rec["code"] = code.name if code is not None else "RPC_ERROR"
        rec["message"] = (e.details() if hasattr(e, "details") else str(e)) or ""
    except Exception as e:  # noqa: BLE001 -- a client bug must not kill the level
        rec["code"], rec["message"] = "CLIENT_ERROR", repr(e)
    finally:
        if call is not None:
            with calls_lock:
                calls.discard(call)
    rec["e2e"] = time.perf_counter() - t0
    rec["text"] = "".join(texts)
    first = next((i for i, n in enumerate(rec["chunk_tokens"]) if n > 0), None)
    rec["ttft"] = rec["chunk_times"][first] if first is not None else None
    if first is not None:
        last = max(i for i, n in enumerate(rec["chunk_tokens"]) if n > 0)
        rec["tpot"] = tpot(rec["chunk_times"][last] - rec["ttft"], rec["tokens"], rec["chunk_tokens"][first])
    else:
        rec["tpot"] = None
    return rec


class Interrupted(Exception):
    pass


def run_level(client, conc, requests, args, run_id, stop_event):
    """Runs all requests with conc client threads; returns (records, wall seconds)."""
    lock = threading.Lock()
    calls, calls_lock = set(), threading.Lock()
    records = []
    next_i = [0]
    state = {"ok": 0, "failed": 0, "tokens": 0, "last_print": 0.0}
    t_level = time.perf_counter()

    def progress(final=False):
        now = time.perf_counter()
        done = state["ok"] + state["failed"]
        if not final and now - state["last_print"] < args.progress_interval and done < len(requests):
            return
        if final and state.get("printed") == done:
            return
        state["last_print"], state["printed"] = now, done
        el = now - t_level
        log("[c=%d] %d/%d done (%d ok, %d failed), %.1f s, %.1f output tok/s so far%s" % (
            conc, state["ok"] + state["failed"], len(requests), state["ok"], state["failed"], el,
            state["tokens"] / el if el > 0 else 0.0, "" if not final else ": level done"))

    def worker(w):
        while not stop_event.is_set():
            with lock:
                if next_i[0] >= len(requests):
                    return
                req = requests[next_i[0]]
                next_i[0] += 1
            rid = "%s-c%d-%d" % (run_id, conc, req["index"])
            rec = run_one(client, w % len(client.gen), req, rid, args, calls, calls_lock)
            rec["t_start"] -= t_level
            rec["worker"] = w
            with lock:
                records.append(rec)
                if rec["ok"]:
                    state["ok"] += 1
                    state["tokens"] += rec["tokens"]
                else:
                    state["failed"] += 1
                    if state["failed"] <= 5:
                        log("[c=%d] request %d failed: %s %s" % (conc, req["index"], rec["code"], rec["message"]))
                progress()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(conc)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        stop_event.set()
        log("interrupted: cancelling %d calls in flight" % len(calls))
        with calls_lock:
            for c in list(calls):
                c.cancel()
        for t in threads:
            t.join(5)
        raise Interrupted()
    wall = max([r["t_start"] + r["e2e"] for r in records] or [0.0])
    progress(final=True)
    return records, wall


def summarize_level(conc, records, wall):
    ok = [r for r in records if r["ok"]]
    failures, examples = {}, {}
    for r in sorted(records, key=lambda r: r["index"]):
        if not r["ok"]:
            failures[r["code"]] = failures.get(r["code"], 0) + 1
            examples.setdefault(r["code"], r["message"])
    tokens = sum(r["tokens"] for r in ok)
    itl = []
    for r in ok:
        itl.extend(itl_samples(r["chunk_times"], r["chunk_tokens"]))
    s = {
        "concurrency": conc,
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "failures": failures,
        "failure_examples": examples,
        "wall_s": wall,
        "output_tokens": tokens,
        "failed_output_tokens": sum(r["tokens"] for r in records if not r["ok"]),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "ttft_s": pct_summary([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": pct_summary(itl),
        "tpot_s": pct_summary([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_s": pct_summary([r["e2e"] for r in ok]),
        "chunks_per_token": (sum(len([n for n in r["chunk_tokens"] if n > 0]) for r in ok) / tokens) if tokens else None,
    }
    return s


def request_json(r):
    keep = ("index", "request_id", "worker", "ok", "code", "message", "max_tokens", "prompt_words", "prompt_tokens",
            "completion_tokens", "cached_tokens", "finish_reason", "tokens", "t_start", "ttft", "tpot", "e2e")
    out = {k: r.get(k) for k in keep}
    out["chunk_times"] = [round(t, 6) for t in r["chunk_times"]]  # seconds since the call started
    out["chunk_tokens"] = r["chunk_tokens"]
    return out


# ------------------------------------------------------------------------------------------
# Server process (--start)

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StartedServer:
    def __init__(self, cmd, log_path):
        self.cmd = cmd
        self.log_path = log_path
        self.logf = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.logf, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as e:
            raise Fatal("cannot start %s: %s" % (cmd[0], e))
        self.t_start = time.monotonic()

    def tail(self, n=20):
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
            return "\n".join("    " + ln for ln in lines[-n:])
        except OSError:
            return ""

    def wait_serving(self, address, token, timeout):
        """Polls Health until SERVING. Each attempt uses a fresh channel: a channel whose first
        connection was refused (server still loading) fails calls fast for its reconnect backoff
        (about 5 s with grpcio 1.51) even after the server is up."""
        last = "no answer yet"
        while time.monotonic() - self.t_start < timeout:
            if self.proc.poll() is not None:
                raise Fatal("the server exited with status %s before serving; last lines of %s:\n%s" % (
                    self.proc.returncode, self.log_path, self.tail()))
            probe = Client(address, 1, token)
            try:
                h = probe.health(timeout=2)
                if h.status == pb.SERVING_STATUS_SERVING:
                    return time.monotonic() - self.t_start
                last = "%s (%d/%d workers)" % (pb.ServingStatus.Name(h.status), h.workers_ready, h.workers_total)
            except grpc.RpcError as e:
                last = "%s: %s" % (e.code().name, e.details())
            finally:
                probe.close()
            time.sleep(0.2)
        raise Fatal("the server did not report SERVING within %.0f s (last Health: %s); last lines of %s:\n%s" % (
            timeout, last, self.log_path, self.tail()))

    def stop(self, timeout):
        """SIGTERM, then SIGKILL after timeout. Returns {exit_status, stop_s, killed}."""
        t0 = time.monotonic()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = True
                self.proc.kill()
                self.proc.wait()
        self.logf.close()
        return {"exit_status": self.proc.returncode, "stop_s": time.monotonic() - t0, "killed": killed,
                "log": self.log_path}


# ------------------------------------------------------------------------------------------
# Sequential single-process baseline

RE_LOADED = re.compile(r"loaded in ([0-9.]+) s")
RE_PREFILL = re.compile(r"^prefill: (\d+) tokens in ([0-9.]+) s", re.M)
RE_DECODE = re.compile(r"^decode:\s+(\d+) tokens in ([0-9.]+) s", re.M)
RE_FINISH = re.compile(r"^finish:\s+(\S+) after (\d+) tokens", re.M)


def parse_generate_stats(stderr):
    """The numbers `strata generate --stats` prints (None where a line is missing)."""
    out = {"load_s": None, "prompt_tokens": None, "prefill_s": None, "decode_steps": None, "decode_s": None,
           "finish": None, "completion_tokens": None}
    m = RE_LOADED.search(stderr)
    if m:
        out["load_s"] = float(m.group(1))
    m = RE_PREFILL.search(stderr)
    if m:
        out["prompt_tokens"], out["prefill_s"] = int(m.group(1)), float(m.group(2))
    m = RE_DECODE.search(stderr)
    if m:
        out["decode_steps"], out["decode_s"] = int(m.group(1)), float(m.group(2))
    m = RE_FINISH.search(stderr)
    if m:
        out["finish"], out["completion_tokens"] = m.group(1), int(m.group(2))
    return out


def run_baseline(cmd, requests, args, stop_event):
    base = shlex.split(cmd)
    recs = []
    t_all = time.perf_counter()
    last_print = 0.0
    for req in requests:
        if stop_event.is_set():
            break
        argv = base + ["-p", "-", "-n", str(req["max_tokens"]), "--no-echo", "--stats"]
        if args.ignore_eos:
            argv.append("--ignore-eos")
        if args.temperature:
            argv += ["-t", repr(args.temperature), "-s", str(args.sampling_seed)]
        if args.kv_codec:
            argv += ["--kv", args.kv_codec]
        rec = {"index": req["index"], "max_tokens": req["max_tokens"], "prompt_words": req["prompt_words"],
               "ok": False, "code": None, "message": ""}
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, input=req["prompt"], capture_output=True, text=True, timeout=args.timeout,
                               errors="replace")
            rec.update(parse_generate_stats(p.stderr))
            out = p.stdout[:-1] if p.stdout.endswith("\n") else p.stdout
            rec["text"] = out
            if p.returncode != 0:
                rec["code"] = "EXIT_%d" % p.returncode
                lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
                errs = [ln for ln in lines if ln.startswith("strata generate:") or "error" in ln.lower()]
                rec["message"] = (errs or lines or [""])[0]
            elif rec["completion_tokens"] is None or rec["prefill_s"] is None or rec["decode_s"] is None:
                rec["code"] = "NO_STATS"
                rec["message"] = "no --stats lines on stderr (is the command `strata generate`?)"
            else:
                rec["code"], rec["ok"] = "OK", True
        except subprocess.TimeoutExpired:
            rec["code"], rec["message"] = "TIMEOUT", "no exit within %.0f s" % args.timeout
        except OSError as e:
            raise Fatal("cannot run the baseline %r: %s" % (argv[0], e))
        rec["wall_s"] = time.perf_counter() - t0
        recs.append(rec)
        if not rec["ok"] and sum(1 for r in recs if not r["ok"]) <= 5:
            log("[baseline] request %d failed: %s %s" % (req["index"], rec["code"], rec["message"]))
        now = time.perf_counter()
        if now - last_print >= args.progress_interval or len(recs) == len(requests):
            last_print = now
            log("[baseline] %d/%d done, %.1f s" % (len(recs), len(requests), now - t_all))
    total_wall = time.perf_counter() - t_all
    ok = [r for r in recs if r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    engine_s = sum(r["prefill_s"] + r["decode_s"] for r in ok)
    ok_wall = sum(r["wall_s"] for r in ok)
    itl = []
    for r in ok:
        if r["decode_steps"]:
            itl.extend([r["decode_s"] / r["decode_steps"]] * r["decode_steps"])
    failures = {}
    for r in recs:
        if not r["ok"]:
            failures[r["code"]] = failures.get(r["code"], 0) + 1
    summary = {
        "command": cmd,
        "requests": len(recs),
        "ok": len(ok),
        "failed": len(recs) - len(ok),
        "failures": failures,
        "output_tokens": tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "total_wall_s": total_wall,
        "ok_wall_s": ok_wall,
        "engine_s": engine_s,
        "load_s_total": sum(r["load_s"] or 0.0 for r in ok),
        "output_tokens_per_s_wall": tokens / ok_wall if ok_wall > 0 else None,
        "output_tokens_per_s_engine": tokens / engine_s if engine_s > 0 else None,
        "requests_per_s_wall": len(ok) / ok_wall if ok_wall > 0 else None,
        "ttft_s": pct_summary([r["prefill_s"] for r in ok]),
        "itl_s": pct_summary(itl),
        "e2e_s": pct_summary([r["prefill_s"] + r["decode_s"] for r in ok]),
        "process_wall_s": pct_summary([r["wall_s"] for r in ok]),
    }
    return summary, recs


# ------------------------------------------------------------------------------------------
# Output

def fmt(v, scale=1.0, prec=1):
    if v is None:
        return "-"
    return "%.*f" % (prec, v * scale)


def ratio(a, b):
    if a is None or not b:
        return None
    return a / b


def print_report(result, out=sys.stdout):
    w = out.write
    wl = result["workload"]
    w("\n# strata serve load test\n\n")
    if result.get("error"):
        w("**Incomplete run: %s**\n\n" % result["error"].splitlines()[0])
    w("- workload: %d requests per level; prompt %s words (target tokens), max_tokens %s, ignore_eos %s, "
      "temperature %g, seed %d\n" % (wl["requests"], wl["prompt_tokens_dist"], wl["max_tokens_dist"],
                                     "on" if wl["ignore_eos"] else "off", wl["temperature"], wl["seed"]))
    srv = result.get("server")
    if srv:
        mi = srv.get("model_info") or {}
        w("- server: %s%s; model %s, %s x %s (replicas x stages), n_ctx %s, default KV %s\n" % (
            srv["address"], " (started by loadgen)" if srv.get("command") else "",
            mi.get("name", "?"), mi.get("replicas", "?"), mi.get("stages_per_replica", "?"), mi.get("n_ctx", "?"),
            mi.get("default_kv_codec", "?")))
    la0, la1 = result["host"].get("loadavg_start"), result["host"].get("loadavg_end")
    w("- machine: %s, %s CPUs (client, server and baseline share them); 1-minute load average %s at start, "
      "%s at the end%s\n" % (result["host"]["cpu"], result["host"]["cpus"], la0[0] if la0 else "?",
                              la1[0] if la1 else "?",
                              " (load before the run: other processes compete, numbers are noisy)"
                              if la0 and result["host"]["cpus"] and la0[0] > 0.5 * result["host"]["cpus"] else ""))
    base = result.get("baseline")
    levels = result.get("levels", [])
    if levels:
        w("\n## Throughput\n\n")
        w("| concurrency | ok | failed | wall s | req/s | output tok/s | vs sequential (engine) | "
          "vs sequential (process wall) | mean prompt tokens |\n")
        w("|---|---|---|---|---|---|---|---|---|\n")
        for lv in levels:
            s = lv["summary"]
            re_ = ratio(s["output_tokens_per_s"], base and base["output_tokens_per_s_engine"])
            rw = ratio(s["output_tokens_per_s"], base and base["output_tokens_per_s_wall"])
            w("| %d | %d | %d | %s | %s | %s | %s | %s | %s |\n" % (
                s["concurrency"], s["ok"], s["failed"], fmt(s["wall_s"], prec=2), fmt(s["requests_per_s"], prec=2),
                fmt(s["output_tokens_per_s"]), "-" if re_ is None else "%.2fx" % re_,
                "-" if rw is None else "%.2fx" % rw,
                fmt(s["prompt_tokens"] / s["ok"], prec=1) if s["ok"] else "-"))
        w("\n## Latency (successful requests)\n\n")
        w("| concurrency | TTFT ms p50 | p90 | p99 | ITL ms p50 | p90 | p99 | TPOT ms p50 | p90 | p99 | "
          "E2E s p50 | p90 | p99 |\n")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for lv in levels:
            s = lv["summary"]
            row = [str(s["concurrency"])]
            for key, scale, prec in (("ttft_s", 1e3, 1), ("itl_s", 1e3, 1), ("tpot_s", 1e3, 1), ("e2e_s", 1, 2)):
                row += [fmt(s[key]["p%d" % p], scale, prec) for p in PERCENTILES]
            w("| " + " | ".join(row) + " |\n")
        fails = [lv["summary"] for lv in levels if lv["summary"]["failed"]]
        if fails:
            w("\nFailed requests by code (STREAM_X: an Error message inside the stream; others: the call's "
              "gRPC status):\n\n")
            for s in fails:
                for code, n in sorted(s["failures"].items()):
                    w("- concurrency %d: %s x%d (e.g. \"%s\")\n" % (s["concurrency"], code, n,
                                                                   s["failure_examples"].get(code, "")))
        for lv in levels:
            d = lv.get("server_stats_delta")
            s = lv["summary"]
            if d and d.get("tokens_generated") is not None and \
                    d["tokens_generated"] != s["output_tokens"] + s["failed_output_tokens"]:
                w("- note: concurrency %d: the server's tokens_generated grew by %d, the client received %d\n" % (
                    s["concurrency"], d["tokens_generated"], s["output_tokens"] + s["failed_output_tokens"]))
    if base:
        w("\n## Sequential baseline (`%s`, one process per request)\n\n" % base["command"])
        w("| requests ok | failed | output tokens | process wall s | tok/s (process wall) | engine s "
          "(prefill + decode) | tok/s (engine) | model load s (total) | TTFT ms p50 | p90 | p99 | ITL ms p50 "
          "| p90 | p99 |\n")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        w("| %d | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n" % (
            base["ok"], base["failed"], base["output_tokens"], fmt(base["ok_wall_s"], prec=2),
            fmt(base["output_tokens_per_s_wall"]), fmt(base["engine_s"], prec=2),
            fmt(base["output_tokens_per_s_engine"]), fmt(base["load_s_total"], prec=2),
            *[fmt(base["ttft_s"]["p%d" % p], 1e3) for p in PERCENTILES],
            *[fmt(base["itl_s"]["p%d" % p], 1e3) for p in PERCENTILES]))
        if base["failed"]:
            w("\nBaseline failures: %s\n" % ", ".join("%s x%d" % kv for kv in sorted(base["failures"].items())))
        if base.get("text_match") is not None:
            w("\nServed text identical to the baseline's (concurrency 1, greedy): %d of %d compared\n" % (
                base["text_match"], base["text_compared"]))
    w("\nTTFT: call start to the first chunk with tokens. ITL: per token (chunk gap / tokens in the chunk). "
      "TPOT: per request, (last token time - first token time) / tokens after the first chunk. Percentiles: linear interpolation. "
      "Baseline TTFT = prefill time, ITL = decode time / decode steps of each request, engine time excludes "
      "process start and model load.\n")
    out.flush()


# ------------------------------------------------------------------------------------------
# Self-test

def self_test():
    fails = []

    def eq(a, b, what, tol=1e-9):
        ok = (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= tol * max(1, abs(b)))
        if not ok:
            fails.append("%s: got %r, want %r" % (what, a, b))

    # Known values (numpy.percentile, default method, gives the same numbers).
    eq(percentile([], 50), None, "empty")
    eq(percentile([7], 0), 7, "one value p0")
    eq(percentile([7], 99), 7, "one value p99")
    eq(percentile([1, 2, 3, 4], 50), 2.5, "1..4 p50")
    eq(percentile([1, 2, 3, 4], 90), 3.7, "1..4 p90")
    eq(percentile([1, 2, 3, 4], 0), 1, "1..4 p0")
    eq(percentile([1, 2, 3, 4], 100), 4, "1..4 p100")
    eq(percentile([4, 1, 3, 2], 25), 1.75, "unsorted p25")
    xs = list(range(1, 101))
    eq(percentile(xs, 50), 50.5, "1..100 p50")
    eq(percentile(xs, 90), 90.1, "1..100 p90")
    eq(percentile(xs, 99), 99.01, "1..100 p99")
    eq(percentile([10, 20], 99), 19.9, "two values p99")
    eq(percentile([0.1] * 5 + [10.0], 90), 5.05, "outlier p90")
    eq(percentile(list(range(11)), 90), 9.0, "0..10 p90 exact rank")
    try:
        percentile([1], 101)
        fails.append("p=101 accepted")
    except ValueError:
        pass
    # Against the standard library's type-7 quantiles on random data.
    rng = random.Random(1)
    for n in (2, 3, 10, 57, 1000):
        data = [rng.expovariate(1.0) for _ in range(n)]
        q = statistics.quantiles(data, n=100, method="inclusive")  # q[k-1] is the k-th percentile
        for p in (1, 25, 50, 90, 99):
            eq(percentile(data, p), q[p - 1], "random n=%d p%d vs statistics.quantiles" % (n, p), tol=1e-12)

    # ITL: chunks at 1.0 (2 tokens), 1.3 (1), 1.3 (0 tokens: ignored), 1.9 (3 tokens).
    got = itl_samples([1.0, 1.3, 1.35, 1.9], [2, 1, 0, 3])
    want = [0.3, 0.2, 0.2, 0.2]
    if len(got) != len(want) or any(abs(a - b) > 1e-12 for a, b in zip(got, want)):
        fails.append("itl_samples: %r != %r" % (got, want))
    if itl_samples([0.5], [4]) != []:
        fails.append("itl_samples of one chunk must be empty")
    eq(tpot(0.9, 6, 2), 0.225, "tpot")
    eq(tpot(0.0, 2, 2), None, "tpot one chunk")

    # Distributions.
    rng = random.Random(5)
    for spec, lo, hi in (("64", 64, 64), ("fixed:3", 3, 3), ("uniform:16:128", 16, 128), ("normal:50:20", 1, None),
                         ("normal:50:200:10:60", 10, 60), ("choice:8,32", 8, 32)):
        d = Dist(spec)
        vals = [d.sample(rng) for _ in range(2000)]
        if min(vals) < lo or (hi is not None and max(vals) > hi):
            fails.append("%s: values outside [%s, %s]: %d..%d" % (spec, lo, hi, min(vals), max(vals)))
    u = [Dist("uniform:1:4").sample(rng) for _ in range(4000)]
    if set(u) != {1, 2, 3, 4}:
        fails.append("uniform:1:4 gave %s" % sorted(set(u)))
    for bad in ("uniform:5:1", "fixed:0", "gauss:1", "choice:", "uniform:a:b", "normal:5:-1"):
        try:
            Dist(bad)
            fails.append("bad spec %r accepted" % bad)
        except argparse.ArgumentTypeError:
            pass

    # Workload determinism and prompt shape.
    a = build_requests(20, Dist("uniform:1:40"), Dist("uniform:1:9"), 3)
    b = build_requests(20, Dist("uniform:1:40"), Dist("uniform:1:9"), 3)
    c = build_requests(20, Dist("uniform:1:40"), Dist("uniform:1:9"), 4)
    if a != b:
        fails.append("build_requests is not deterministic")
    if a == c:
        fails.append("build_requests ignores the seed")
    for r in a:
        if len(r["prompt"].split()) != r["prompt_words"] or not r["prompt"].startswith(FIRST_WORD):
            fails.append("prompt %d has %d words, want %d" % (r["index"], len(r["prompt"].split()), r["prompt_words"]))
    if len(set(WORDS)) != len(WORDS):
        fails.append("WORDS has duplicates")

    # --stats parsing (the lines strata generate prints).
    st = parse_generate_stats("strata: SmolLM2, 30 layers, 9 heads (3 KV), 514 MiB of fp32 weights, loaded in 0.42 s\n"
                              "\n--- stats ---\nprefill: 5 tokens in 0.148 s (33.7 tokens/s)\n"
                              "decode:  15 tokens in 0.797 s (18.81 tokens/s)\nfinish:  length after 16 tokens\n")
    want = {"load_s": 0.42, "prompt_tokens": 5, "prefill_s": 0.148, "decode_steps": 15, "decode_s": 0.797,
            "finish": "length", "completion_tokens": 16}
    if st != want:
        fails.append("parse_generate_stats: %r" % st)

    for f in fails:
        print("FAIL " + f)
    print("self-test: %s (%d failures)" % ("ok" if not fails else "FAILED", len(fails)))
    return 0 if not fails else 1


# ------------------------------------------------------------------------------------------
# Main

def parse_conc(s):
    try:
        vals = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("bad --concurrency %r: want a comma list such as 1,4,16" % s)
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError("bad --concurrency %r: want positive integers" % s)
    return vals


def host_info():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "platform": platform.platform(), "python": sys.version.split()[0],
            "loadavg_start": loadavg()}


def loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="loadgen.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load generator for strata's gRPC API: a concurrency sweep reporting throughput, TTFT, "
                    "inter-token and end-to-end latency percentiles, against a sequential single-process baseline.",
        epilog="Exit status: 0 when the run completed (even with failed requests: they are reported), "
               "1 when it could not run (server not serving, bad setup), 2 on bad usage, 130 when interrupted. "
               "Progress goes to stderr, the report (markdown tables) to stdout.")
    g = ap.add_argument_group("server")
    g.add_argument("--server", metavar="HOST:PORT", help="address of a running server")
    g.add_argument("--start", metavar="CMD",
                   help="start this server command (one string, split like a shell would, not run by one); "
                        "{port} is replaced by a free port and the address becomes 127.0.0.1:{port} unless "
                        "--server is given. Waits for Health SERVING, stops it with SIGTERM at the end")
    g.add_argument("--start-timeout", type=float, default=600, metavar="S",
                   help="seconds to wait for SERVING after --start (default 600)")
    g.add_argument("--stop-timeout", type=float, default=60, metavar="S",
                   help="seconds to wait for exit after SIGTERM before SIGKILL (default 60)")
    g.add_argument("--server-log", metavar="FILE", help="stdout+stderr of the started server (default: a temp file)")
    g.add_argument("--token", help="bearer token sent as 'authorization: Bearer TOKEN'")
    g.add_argument("--channels", type=int, default=1, metavar="N",
                   help="gRPC channels (connections) shared round-robin by the client threads (default 1)")
    g.add_argument("--proto", default=os.path.join(REPO, "proto", "strata.proto"),
                   help="strata.proto (default: the repository's)")
    g = ap.add_argument_group("workload")
    g.add_argument("--concurrency", type=parse_conc, default=[1, 4, 16], metavar="LIST",
                   help="concurrency levels of the sweep, comma separated (default 1,4,16)")
    g.add_argument("--requests", type=int, default=32, metavar="N",
                   help="requests per level (default 32); every level replays the same N requests")
    g.add_argument("--prompt-tokens", type=Dist, default=Dist("uniform:16:128"), metavar="DIST",
                   help="prompt length in words, one token each on the default model: N, fixed:N, uniform:A:B, "
                        "normal:MEAN:SD[:MIN:MAX], choice:A,B,... (default uniform:16:128)")
    g.add_argument("--prompt-prefix", default="", metavar="TEXT",
                   help="text put before every prompt (and a space), e.g. a shared system prompt; its tokens "
                        "come on top of --prompt-tokens")
    g.add_argument("--max-tokens", type=Dist, default=Dist("uniform:16:64"), metavar="DIST",
                   help="sampling.max_tokens per request, same forms (default uniform:16:64)")
    g.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=True,
                   help="set sampling.ignore_eos so every request generates max_tokens (default)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at end-of-generation tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--sampling-seed", type=int, default=0, metavar="S", help="sampling.seed (default 0)")
    g.add_argument("--kv-codec", default="", metavar="SPEC", help="kv_codec of every request (default: server's)")
    g.add_argument("--seed", type=int, default=1, help="seed of the workload (prompts and lengths; default 1)")
    g.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="requests sent one by one before the sweep and not counted (default 1)")
    g.add_argument("--timeout", type=float, default=300, metavar="S",
                   help="deadline of each request in seconds (gRPC deadline; the baseline's process timeout), "
                        "default 300")
    g = ap.add_argument_group("baseline and output")
    g.add_argument("--baseline", metavar="CMD",
                   help="sequential single-process baseline: a `strata generate` command (e.g. "
                        "\"build/strata generate --model M\"); each request runs as its own process with "
                        "-p - -n MAX --no-echo --stats [--ignore-eos]")
    g.add_argument("--baseline-requests", type=int, metavar="K",
                   help="run only the first K requests in the baseline (default: all N)")
    g.add_argument("--json", metavar="OUT", help="write machine-readable results to OUT")
    g.add_argument("--progress-interval", type=float, default=2.0, metavar="S",
                   help="seconds between progress lines on stderr (default 2)")
    g.add_argument("--self-test", action="store_true",
                   help="check the percentile, ITL, distribution and --stats parsing code and exit")
    args = ap.parse_args(argv)

    if args.self_test:
        return self_test()
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    if args.channels < 1:
        ap.error("--channels must be at least 1")
    if args.start and "{port}" not in args.start and not args.server:
        ap.error("--start: put {port} in the command (e.g. --listen 127.0.0.1:{port}) or give --server")
    if not (args.server or args.start or args.baseline):
        ap.error("nothing to do: give --server or --start (and/or --baseline)")

    # SIGTERM (e.g. from run.sh's trap) ends the run like Ctrl-C: calls cancelled, server stopped.
    def on_term(signum, frame):
        raise KeyboardInterrupt()
    signal.signal(signal.SIGTERM, on_term)

    requests = build_requests(args.requests, args.prompt_tokens, args.max_tokens, args.seed, args.prompt_prefix)
    run_id = "lg%x%04x" % (int(time.time()), os.getpid() & 0xFFFF)
    result = {
        "tool": "bench/serve/loadgen.py",
        "format": 1,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv if argv is None else ["loadgen.py"] + list(argv),
        "host": host_info(),
        "percentile_method": PERCENTILE_METHOD,
        "itl_method": ITL_METHOD,
        "workload": {"requests": args.requests, "prompt_tokens_dist": str(args.prompt_tokens),
                     "max_tokens_dist": str(args.max_tokens), "ignore_eos": args.ignore_eos,
                     "temperature": args.temperature, "sampling_seed": args.sampling_seed,
                     "prompt_prefix": args.prompt_prefix,
                     "kv_codec": args.kv_codec, "seed": args.seed, "timeout_s": args.timeout,
                     "prompt_words_total": sum(r["prompt_words"] for r in requests),
                     "max_tokens_total": sum(r["max_tokens"] for r in requests)},
        "levels": [],
    }
    stop_event = threading.Event()
    server = None
    client = None
    exit_code = 0
    sweep_error = None
    level1_texts = {}
    try:
        if args.server or args.start:
            load_stubs(args.proto)
            address = args.server
            if args.start:
                port = free_port()
                cmd = [a.replace("{port}", str(port)) for a in shlex.split(args.start)]
                address = address or "127.0.0.1:%d" % port
                log_path = args.server_log or tempfile.mkstemp(prefix="loadgen-server-", suffix=".log")[1]
                log("starting server: %s (log: %s)" % (" ".join(shlex.quote(a) for a in cmd), log_path))
                server = StartedServer(cmd, log_path)
            result["server"] = {"address": address, "command": server.cmd if server else None}
            if server:
                took = server.wait_serving(address, args.token, args.start_timeout)
                result["server"]["ready_s"] = took
                log("server SERVING after %.1f s" % took)
            else:
                why = health_problem(address, args.token, wait=10)
                if why:
                    raise Fatal("%s is not serving: %s" % (address, why))
            client = Client(address, args.channels, args.token)
            try:
                mi = client.model_info()
                result["server"]["model_info"] = msg_to_dict(mi)
                need = (args.prompt_tokens.max() or 0) + (args.max_tokens.max() or 0)
                if mi.n_ctx and args.prompt_tokens.max() and args.max_tokens.max() and need > mi.n_ctx:
                    log("warning: the longest prompt + max_tokens (%d) exceeds the server's n_ctx %d: "
                        "such requests will fail with RESOURCE_EXHAUSTED" % (need, mi.n_ctx))
            except grpc.RpcError as e:
                result["server"]["model_info"] = None
                log("GetModelInfo failed: %s: %s" % (e.code().name, e.details()))

            if args.warmup > 0:
                wreqs = build_requests(args.warmup, Dist("fixed:8"), Dist("fixed:4"), args.seed + 7919)
                calls, cl = set(), threading.Lock()
                for wr in wreqs:
                    rec = run_one(client, 0, wr, "%s-warmup-%d" % (run_id, wr["index"]), args, calls, cl)
                    log("warmup request: %s in %.2f s" % (rec["code"], rec["e2e"]))

            for i, conc in enumerate(args.concurrency):
                why = health_problem(address, args.token, server) if i > 0 else None
                if why:
                    sweep_error = "sweep stopped before concurrency %d: %s" % (conc, why)
                    log("error: " + sweep_error)
                    break
                log("level: concurrency %d, %d requests" % (conc, len(requests)))
                before = stats_dict(client)
                records, wall = run_level(client, conc, requests, args, run_id, stop_event)
                after = stats_dict(client)
                summ = summarize_level(conc, records, wall)
                delta = None
                if "error" not in before and "error" not in after:
                    delta = {k: int(after.get(k, 0)) - int(before.get(k, 0))
                             for k in ("requests_total", "tokens_generated", "spills", "restores", "crc_failures")}
                records.sort(key=lambda r: r["index"])
                if conc == 1:
                    level1_texts = {r["index"]: r["text"] for r in records if r["ok"]}
                result["levels"].append({
                    "concurrency": conc,
                    "summary": summ,
                    "server_stats_before": before,
                    "server_stats_after": after,
                    "server_stats_delta": delta,
                    "requests": [request_json(r) for r in records],
                })
                s = summ
                log("[c=%d] %d ok, %d failed, %.1f output tok/s, TTFT p50 %s ms, ITL p50 %s ms" % (
                    conc, s["ok"], s["failed"], s["output_tokens_per_s"] or 0.0, fmt(s["ttft_s"]["p50"], 1e3),
                    fmt(s["itl_s"]["p50"], 1e3)))
            if server:
                log("stopping the server (SIGTERM)")
                result["server"]["stop"] = server.stop(args.stop_timeout)
                log("server exited with status %s after %.1f s%s" % (
                    result["server"]["stop"]["exit_status"], result["server"]["stop"]["stop_s"],
                    " (killed)" if result["server"]["stop"]["killed"] else ""))
                server = None
        if sweep_error:
            result["error"] = sweep_error
            exit_code = 1
            if args.baseline:
                log("baseline skipped: the sweep did not complete")
        elif args.baseline:
            k = args.baseline_requests if args.baseline_requests else len(requests)
            log("baseline: %d requests one after another through: %s" % (min(k, len(requests)), args.baseline))
            summary, recs = run_baseline(args.baseline, requests[:k], args, stop_event)
            if level1_texts:
                cmp = [r for r in recs if r["ok"] and r["index"] in level1_texts]
                summary["text_compared"] = len(cmp)
                summary["text_match"] = sum(1 for r in cmp if r.get("text") == level1_texts[r["index"]])
            summary["request_records"] = [{k2: v for k2, v in r.items() if k2 != "text"} for r in recs]
            result["baseline"] = summary
            log("baseline: %d ok, %d failed, %.1f output tok/s (engine), %.1f (process wall)" % (
                summary["ok"], summary["failed"], summary["output_tokens_per_s_engine"] or 0.0,
                summary["output_tokens_per_s_wall"] or 0.0))
        result["host"]["loadavg_end"] = loadavg()
        for lv in result["levels"]:
            b = result.get("baseline")
            s = lv["summary"]
            s["vs_baseline_engine"] = ratio(s["output_tokens_per_s"], b and b["output_tokens_per_s_engine"])
            s["vs_baseline_wall"] = ratio(s["output_tokens_per_s"], b and b["output_tokens_per_s_wall"])
        print_report(result)
    except Fatal as e:
        log("error: %s" % e)
        result["error"] = str(e)
        exit_code = 1
    except (KeyboardInterrupt, Interrupted):
        stop_event.set()
        log("interrupted")
        result["error"] = "interrupted"
        exit_code = 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if client:
            client.close()
        if server:
            st = server.stop(args.stop_timeout)
            result.setdefault("server", {})["stop"] = st
            log("server stopped: status %s after %.1f s%s" % (st["exit_status"], st["stop_s"],
                                                               " (killed)" if st["killed"] else ""))
        result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
            os.replace(tmp, args.json)
            log("results written to %s" % args.json)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())

"""A real strata-worker against coordinators written here, which prove (or fail to prove) the
cluster secret on the control plane (proto/strata_internal.proto, protocol version 3).

  honest     knows the secret: checks the worker's proof with Python's hmac, that the Join's
             bytes do not hold the secret, and that two calls use fresh nonces; sends Admitted,
             then Shutdown: the worker must stop cleanly ("shutdown requested", status 0)
  impostor   does not know the secret: Admitted with a proof under another key, then Shutdown:
             the worker must refuse it (status 1, "did not prove") and never act on the Shutdown
  skipper    sends Shutdown where Admitted belongs: refused the same way
  silent     never sends a Challenge (what a coordinator of protocol version 2 does): the
             worker must give up within its connect timeout, saying so

usage: test_worker_auth.py STRATA_WORKER STUBS_DIR TMP_DIR
"""
import hashlib
import hmac
import os
import subprocess
import sys
import threading
from concurrent import futures

import grpc

worker_bin, stubs, tmp = sys.argv[1:4]
sys.path.insert(0, stubs)
import strata_internal_pb2 as ipb  # noqa: E402

SECRET = b"0123456789abcdef-the-cluster-secret"
failures = []


def fail(msg):
    print("FAIL:", msg, file=sys.stderr)
    failures.append(msg)


def proof(key, role, coord_nonce, worker_nonce, name):
    label = b"strata-control-v3 " + role + b"\0"
    return hmac.new(key, label + coord_nonce + worker_nonce + name.encode(), hashlib.sha256).digest()


class Coordinator:
    def __init__(self, mode):
        self.mode = mode
        self.joins = []      # (raw bytes, Join, coordinator nonce)
        self.ended = threading.Event()

    def attach(self, requests, context):
        nonce = os.urandom(32)
        if self.mode == "silent":
            for _ in requests:   # waits for a Join that never comes
                pass
            self.ended.set()
            return
        yield ipb.CoordinatorMessage(challenge=ipb.Challenge(nonce=nonce)).SerializeToString()
        raw = next(requests, None)
        if raw is None:
            self.ended.set()
            return
        join = ipb.WorkerMessage.FromString(raw).join
        self.joins.append((raw, join, nonce))
        key = SECRET if self.mode == "honest" else b"not the secret, but 16+ bytes long"
        admit = proof(key, b"coordinator", nonce, join.worker_nonce, join.worker_name)
        if self.mode != "skipper":
            yield ipb.CoordinatorMessage(admitted=ipb.Admitted(secret_proof=admit)).SerializeToString()
        yield ipb.CoordinatorMessage(shutdown=ipb.Shutdown()).SerializeToString()
        for _ in requests:   # until the worker ends the stream
            pass
        self.ended.set()


def serve(coord):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(
        "strata.internal.v1.WorkerControl",
        {"Attach": grpc.stream_stream_rpc_method_handler(coord.attach)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def run_worker(port, name, timeout_ms=10000):
    secret_file = os.path.join(tmp, "secret")
    with open(secret_file, "wb") as f:
        f.write(SECRET + b"\n")
    r = subprocess.run([worker_bin, "--coordinator", f"127.0.0.1:{port}", "--secret-file", secret_file,
                        "--name", name, "--connect-timeout-ms", str(timeout_ms), "--exit-timeout", "5"],
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stderr


def check_honest():
    before = len(failures)
    coord = Coordinator("honest")
    server, port = serve(coord)
    try:
        for name in ("auth-a", "auth-b"):
            rc, err = run_worker(port, name)
            if rc != 0 or "shutdown requested" not in err:
                fail(f"honest coordinator: worker {name} exited {rc}: {err.strip()[-300:]}")
    finally:
        server.stop(1)
    if len(coord.joins) != 2:
        fail(f"honest coordinator: {len(coord.joins)} Joins, expected 2")
        return
    for raw, join, nonce in coord.joins:
        if SECRET in raw or SECRET.hex().encode() in raw:
            fail("the cluster secret is in the Join's bytes on the wire")
        want = proof(SECRET, b"worker", nonce, join.worker_nonce, join.worker_name)
        if len(join.worker_nonce) != 32 or not hmac.compare_digest(join.secret_proof, want):
            fail(f"Join of {join.worker_name}: the proof is not HMAC-SHA256 of the documented bytes")
        if join.protocol_version != 3:
            fail(f"Join.protocol_version {join.protocol_version}, expected 3")
    if coord.joins[0][1].worker_nonce == coord.joins[1][1].worker_nonce:
        fail("two calls used the same worker nonce")
    if len(failures) == before:
        print("honest: ok")


def check_refused(mode, reason):
    before = len(failures)
    coord = Coordinator(mode)
    server, port = serve(coord)
    try:
        rc, err = run_worker(port, f"auth-{mode}")
    finally:
        server.stop(1)
    want = "did not prove that it holds the cluster secret (" + reason
    if rc != 1 or want not in err:
        fail(f"{mode}: worker exited {rc}, expected 1 with '{want}': {err.strip()[-300:]}")
    if "shutdown requested" in err:
        fail(f"{mode}: the worker obeyed a coordinator that did not prove the secret")
    if len(failures) == before:
        print(f"{mode}: ok")


def check_silent():
    coord = Coordinator("silent")
    server, port = serve(coord)
    try:
        rc, err = run_worker(port, "auth-silent", timeout_ms=1500)
    finally:
        server.stop(0)
    want = "sent no Challenge within 1500 ms"
    if rc != 1 or want not in err:
        fail(f"silent: worker exited {rc}, expected 1 with '{want}': {err.strip()[-300:]}")
    else:
        print("silent: ok")


check_honest()
check_refused("impostor", "wrong proof")
check_refused("skipper", "no Admitted message")
check_silent()
if failures:
    sys.exit(1)
print("test_worker_auth: ok")

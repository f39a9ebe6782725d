#!/usr/bin/env bash
# TLS on the control port (ctest control_tls): strata serve whose local workers check the
# coordinator's certificate and serve as without TLS; the port speaks TLS to Python's ssl module
# (an independent client); a worker without the CA, with another CA, dialling a name the
# certificate lacks, or with TLS against a plaintext port does not join, each with its reason
# at once (the worker's own handshake with the port), also when the coordinator comes up
# during the worker's wait; bad files and flag combinations are usage errors.
# Certificates are made with the openssl command for the run.
# Usage: test_control_tls.sh BUILD_DIR SOURCE_DIR. Exits 77 (skipped) without openssl.
set -uo pipefail

build=$1
src=$2
strata=$build/strata
worker=$build/strata-worker
coordinator=$build/strata-coordinator
# shellcheck source=tests/python_env.sh
source "$src/tests/python_env.sh"
require_tools openssl
# shellcheck source=tests/cli/lib.sh
source "$src/tests/cli/lib.sh"

make_cert() {   # NAME [SAN]: $tmp/NAME.pem and $tmp/NAME-key.pem, self-signed for localhost and 127.0.0.1
  openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost -days 1 \
    -addext "subjectAltName=${2:-DNS:localhost,IP:127.0.0.1}" -keyout "$tmp/$1-key.pem" -out "$tmp/$1.pem" \
    >/dev/null 2>&1 || { echo "test_control_tls: openssl could not make a certificate"; exit 1; }
}
make_cert ctl
make_cert other
make_cert named DNS:localhost   # for the name only: dialling 127.0.0.1 must fail the host check
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/secret"

# Usage errors (exit 2), before anything listens.
serve=("$strata" serve --listen 127.0.0.1:0 --model synthetic:tiny:seed=4)
expect 2 "--control-tls-cert and --control-tls-key go together" "${serve[@]}" --control-tls-cert "$tmp/ctl.pem"
expect 2 "--control-tls-ca needs --control-tls-cert" "${serve[@]}" --control-tls-ca "$tmp/ctl.pem"
expect 2 "the TLS key $tmp/other-key.pem does not belong to the certificate $tmp/ctl.pem" "${serve[@]}" \
  --control-tls-cert "$tmp/ctl.pem" --control-tls-key "$tmp/other-key.pem"
expect 2 "cannot read the TLS certificate $tmp/none.pem" "${serve[@]}" \
  --control-tls-cert "$tmp/none.pem" --control-tls-key "$tmp/ctl-key.pem"
# serve knows the host its local workers dial: a certificate without it fails at start, not
# after the workers' connect timeouts.
expect 2 "does not name 127.0.0.1 (a subjectAltName IP:127.0.0.1 is needed), the host its local workers dial" \
  "${serve[@]}" --control-tls-cert "$tmp/named.pem" --control-tls-key "$tmp/named-key.pem"
# strata-coordinator's workers may dial another name of its host: a warning only.
timeout 5 "$coordinator" --model synthetic:tiny --secret-file "$tmp/secret" --listen 127.0.0.1:0 --control 127.0.0.1:0 \
  --control-tls-cert "$tmp/named.pem" --control-tls-key "$tmp/named-key.pem" -q 2>"$tmp/warn.log"
grep -q "warning: --control-tls-cert: .* does not name 127.0.0.1 .*workers must dial a name it holds" "$tmp/warn.log" ||
  fail "no warning for a certificate without the --control address: $(head -3 "$tmp/warn.log")"
expect 2 "--control-tls-ca is not an option of this command" "$coordinator" --model synthetic:tiny \
  --secret-file "$tmp/secret" --control-tls-ca "$tmp/ctl.pem"
expect 2 "--coordinator-ca $tmp/ctl-key.pem holds no valid PEM certificate" "$worker" \
  --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" --coordinator-ca "$tmp/ctl-key.pem"
expect 2 "--coordinator-ca $tmp/none.pem: No such file" "$worker" \
  --coordinator 127.0.0.1:1 --secret-file "$tmp/secret" --coordinator-ca "$tmp/none.pem"

# strata serve with TLS on its control port: its local workers join (they get the certificate as
# their CA) and it serves what the local program generates.
"$strata" generate --model synthetic:tiny:seed=4 --prompt "served?" --max-tokens 12 -q >"$tmp/local.txt" ||
  fail "local generate failed"
"${serve[@]}" --control-tls-cert "$tmp/ctl.pem" --control-tls-key "$tmp/ctl-key.pem" 2>"$tmp/serve.log" &
server=$!
port=$(serve_port "$tmp/serve.log" "$server")
if [ -z "$port" ]; then
  fail "strata serve with control TLS did not become ready: $(tail -n 20 "$tmp/serve.log")"
else
  "$strata" generate --server "127.0.0.1:$port" --prompt "served?" --max-tokens 12 >"$tmp/served.txt" 2>"$tmp/err" ||
    fail "generate --server: $(tail -2 "$tmp/err")"
  # (the server sends UTF-8: each invalid byte of the local program's raw output is U+FFFD there)
  "$py" - "$tmp/local.txt" "$tmp/served.txt" <<'PY' || fail "served text differs: $(head -c 80 "$tmp/served.txt")"
import sys
local, served = (open(f, "rb").read() for f in sys.argv[1:3])
sys.exit(local.decode("utf-8", "replace").encode() != served)
PY
  ctl_port=$(sed -n 's/.*(control port \([0-9]*\), TLS).*/\1/p' "$tmp/serve.log")
  if [ -z "$ctl_port" ]; then
    fail "serve did not say its control port has TLS: $(grep 'control port' "$tmp/serve.log")"
  else
    # Python's ssl: a TLS handshake with the certificate checked for localhost, and h2 agreed.
    "$py" - "$ctl_port" "$tmp/ctl.pem" <<'PY' || fail "the control port does not speak TLS with its certificate"
import socket, ssl, sys
ctx = ssl.create_default_context(cafile=sys.argv[2])
ctx.set_alpn_protocols(["h2"])
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as raw:
    with ctx.wrap_socket(raw, server_hostname="localhost") as s:
        assert s.selected_alpn_protocol() == "h2", s.selected_alpn_protocol()
        assert s.getpeercert()["subject"] == ((("commonName", "localhost"),),), s.getpeercert()
PY
    # A plaintext client at a TLS port: gRPC says only "Socket closed"; strata generate's own
    # handshake with the port adds why.
    expect 1 "Socket closed (the server speaks TLS: give --tls-ca with the CA of its certificate)" \
      "$strata" generate --server "127.0.0.1:$ctl_port" --prompt hi
  fi
fi
kill "$server" 2>/dev/null
wait "$server" || fail "serve exited $? after SIGTERM"

# start_coordinator LOG ARG...: strata-coordinator for one worker (pid in $coord), waiting up to
# 30 s for the line that names its control port; prints the port (nothing if it never came).
start_coordinator() {
  local log=$1
  shift
  "$coordinator" --model synthetic:tiny:seed=4 --secret-file "$tmp/secret" --listen 127.0.0.1:0 \
    --control 127.0.0.1:0 --replicas 1 --stages 1 "$@" 2>"$log" &
  coord=$!
  for _ in $(seq 1 300); do grep -q "control port" "$log" 2>/dev/null && break; sleep 0.1; done
  sed -n 's/.*(control port \([0-9]*\)\(, TLS\)\{0,1\}).*/\1/p' "$log"
}

# strata-coordinator with TLS, one worker wanted: workers without the right CA do not join.
start_coordinator "$tmp/coord.log" --control-tls-cert "$tmp/ctl.pem" --control-tls-key "$tmp/ctl-key.pem" >"$tmp/port"
cport=$(cat "$tmp/port")
grep -q "(control port $cport, TLS)" "$tmp/coord.log" || fail "the coordinator does not say its control port has TLS"
if [ -z "$cport" ]; then
  fail "strata-coordinator with control TLS did not start: $(tail -n 5 "$tmp/coord.log")"
else
  # A handshake that fails for good ends the wait at once (not after --connect-timeout-ms): the
  # worker's own handshake with the port (proto/tls_probe.h) says why before gRPC would retry.
  SECONDS=0
  expect 1 "the control port of the coordinator at 127.0.0.1:$cport speaks TLS: this worker needs the CA of its certificate" \
    "$worker" --coordinator "127.0.0.1:$cport" --secret-file "$tmp/secret" --connect-timeout-ms 30000
  ((SECONDS < 15)) || fail "a plaintext worker at a TLS port waited $SECONDS s"
  SECONDS=0
  expect 1 "the TLS handshake with the coordinator at 127.0.0.1:$cport failed: certificate verify failed: self-signed certificate (the CA given did not sign" \
    "$worker" --coordinator "127.0.0.1:$cport" --secret-file "$tmp/secret" --connect-timeout-ms 30000 \
    --coordinator-ca "$tmp/other.pem"
  ((SECONDS < 15)) || fail "a worker with another CA waited $SECONDS s"
  grep -q "joined" "$tmp/coord.log" && fail "a worker without the right CA joined: $(grep joined "$tmp/coord.log")"
  # The name checked is the one dialled: localhost is in the certificate too.
  "$worker" --coordinator "localhost:$cport" --secret-file "$tmp/secret" --coordinator-ca "$tmp/ctl.pem" \
    --name tls-worker 2>"$tmp/worker.log" &
  good=$!
  for _ in $(seq 1 300); do grep -q "is serving" "$tmp/coord.log" && break; sleep 0.1; done
  grep -q "worker tls-worker joined" "$tmp/coord.log" ||
    fail "the worker with the CA did not join: $(tail -n 3 "$tmp/worker.log") / $(tail -n 3 "$tmp/coord.log")"
fi
kill "$coord" 2>/dev/null
wait "$coord"
[ -n "${good:-}" ] && { wait "$good" || true; }

# The host name is checked: a certificate for localhost alone, dialled as 127.0.0.1 (gRPC says
# so only at debug verbosity; the worker's own handshake names it at once).
start_coordinator "$tmp/named.log" --control-tls-cert "$tmp/named.pem" --control-tls-key "$tmp/named-key.pem" >"$tmp/port"
nport=$(cat "$tmp/port")
if [ -z "$nport" ]; then
  fail "strata-coordinator with the localhost-only certificate did not start: $(tail -n 5 "$tmp/named.log")"
else
  SECONDS=0
  expect 1 "failed: certificate verify failed: IP address mismatch (its certificate does not name the host dialled)" \
    "$worker" --coordinator "127.0.0.1:$nport" --secret-file "$tmp/secret" --connect-timeout-ms 30000 \
    --coordinator-ca "$tmp/named.pem"
  ((SECONDS < 15)) || fail "a worker dialling a name the certificate lacks waited $SECONDS s"
  grep -q "joined" "$tmp/named.log" && fail "a worker joined through a certificate for another name"
fi
kill "$coord" 2>/dev/null
wait "$coord"

# A coordinator that comes up while the worker waits: the handshake after the wait names the
# mismatch (here the name again) instead of "cannot reach".
lport=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$worker" --coordinator "127.0.0.1:$lport" --secret-file "$tmp/secret" --connect-timeout-ms 4000 \
  --coordinator-ca "$tmp/named.pem" 2>"$tmp/late.err" &
late=$!
sleep 1
"$coordinator" --model synthetic:tiny:seed=4 --secret-file "$tmp/secret" --listen 127.0.0.1:0 \
  --control "127.0.0.1:$lport" --replicas 1 --stages 1 --control-tls-cert "$tmp/named.pem" \
  --control-tls-key "$tmp/named-key.pem" 2>"$tmp/late-coord.log" &
coord=$!
wait "$late"
late_rc=$?
[ "$late_rc" -eq 1 ] || fail "the late worker exited $late_rc: $(tail -2 "$tmp/late.err")"
grep -q "IP address mismatch (its certificate does not name the host dialled)" "$tmp/late.err" ||
  fail "the wait's end does not name the mismatch: $(tail -2 "$tmp/late.err") / $(tail -2 "$tmp/late-coord.log")"
kill "$coord" 2>/dev/null
wait "$coord"

# A worker with a CA against a plaintext control port does not join either.
start_coordinator "$tmp/plain.log" >"$tmp/port"
pport=$(cat "$tmp/port")
if [ -z "$pport" ]; then
  fail "plaintext strata-coordinator did not start: $(tail -n 5 "$tmp/plain.log")"
else
  SECONDS=0
  expect 1 "failed: wrong version number (its control port has no TLS?)" "$worker" --coordinator "127.0.0.1:$pport" \
    --secret-file "$tmp/secret" --connect-timeout-ms 30000 --coordinator-ca "$tmp/ctl.pem"
  ((SECONDS < 15)) || fail "a TLS worker at a plaintext port waited $SECONDS s"
  grep -q "joined" "$tmp/plain.log" && fail "a TLS worker joined a plaintext port"
  # strata generate with --tls-ca at a plaintext port: OpenSSL's reason, and what to do.
  expect 1 "wrong version number (the server has no TLS? then without --tls-ca)" \
    "$strata" generate --server "127.0.0.1:$pport" --tls-ca "$tmp/ctl.pem" --prompt hi
  # Said once: gRPC's own log line of the handshake is not printed beside the status.
  [ "$(grep -c "wrong version number" "$tmp/err")" = 1 ] || fail "the reason is said more than once: $(cat "$tmp/err")"
fi
kill "$coord" 2>/dev/null
wait "$coord"

[ "$failures" -eq 0 ] || { echo "test_control_tls: $failures failure(s)"; exit 1; }
echo "test_control_tls: all passed"

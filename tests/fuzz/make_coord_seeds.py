#!/usr/bin/env python3
"""Writes fuzz seeds for tests/fuzz/fuzz_coord.c into tests/fuzz/corpus/fuzz_coord/: programs of
operations in the target's byte format (the OP_ names there) for a coordinator's life: workers
join and become ready, requests run to the end, with and without a host tier and prefix caching;
then the same with workers that answer wrongly (failed sequences, tokens outside the vocabulary,
sequences left out, unknown ids, the wrong step, twice, never), workers lost mid-step, drains with
migrations answered wrongly, cancels and aborts, and raw WorkerMessages (protobuf encoded here
by hand, independent of protobuf-c).
usage: make_coord_seeds.py"""
from pathlib import Path

OUT = Path(__file__).resolve().parent / "corpus" / "fuzz_coord"

(JOIN, HANDLE, MISHANDLE, REPORT, GENERATE, CANCEL, ABORT, GONE, DRAIN, STATS, RAW, WAIT) = range(12)
(F_FAIL_ONE, F_BAD_TOKEN, F_LEAVE_OUT, F_UNKNOWN_SEQ, F_WRONG_STEP, F_TWICE, F_FAIL_ALL, F_EMPTY, F_SILENT) = range(9)

# The first byte: bit 0 one step in flight, bit 1 a small device budget, bit 2 a host tier, bit 3
# prefix caching (with a host tier), bit 4 a step timeout of 300 ms (workers may then go silent),
# bit 5 two recoveries per request (a request whose KV is lost goes on from its tokens) and a
# 300 ms wait for a replica when none serves.
ONE_FLIGHT, SMALL, HOST, PREFIX, TIMEOUT, RECOVER = 1, 2, 4, 8, 16, 32


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, value):
    """A protobuf field: int -> varint, bytes -> length delimited."""
    if isinstance(value, int):
        return varint(num << 3) + varint(value)
    return varint(num << 3 | 2) + varint(len(value)) + value


def step_result(step, results):
    body = field(1, step)
    for seq, token, status in results:
        body += field(2, field(1, seq) + field(2, token) + field(3, status))
    return field(2, body)   # WorkerMessage.step_result


def migrate_done(seq, status):
    return field(4, field(1, seq) + field(2, status) + field(3, b"raw"))


def kv_report(blocks, spills):
    tier = field(1, b"device") + field(2, blocks) + field(3, blocks * 4096)
    return field(3, field(1, tier) + field(2, spills))


class Program:
    def __init__(self, conf):
        self.b = bytearray([conf])

    def op(self, *args):
        self.b += bytes(args)
        return self

    def cluster(self):
        """Four workers join and each handles its assignment (the ready report)."""
        for _ in range(4):
            self.op(JOIN, 0)
        for p in range(4):
            self.op(HANDLE, p)
        return self

    def generate(self, n, max_tokens, shared=False, codec=0, ignore_eos=True, ids=None):
        shape = (1 if shared else 0) | (2 if ignore_eos else 0)
        ids = ids or [(7 * i + 11) % 128 for i in range(n)]
        # len byte: n - 1 (the target takes 1 + b % 48); ids are read for every position, but a
        # shared opening ignores the first 20 of them
        self.op(GENERATE, shape, n - 1, *ids[:n], max_tokens - 1, codec)
        return self

    def serve(self, rounds):
        """Waits and answers correctly on every worker, `rounds` times."""
        for _ in range(rounds):
            self.op(WAIT, 3)
            for p in range(4):
                self.op(HANDLE, p)
        return self

    def raw(self, peer, msg):
        assert len(msg) < 256
        return self.op(RAW, peer, len(msg), *msg)


def seeds():
    yield "basic", Program(0).cluster().generate(5, 4).generate(12, 3).serve(8).op(STATS)
    yield "one_flight", Program(ONE_FLIGHT).cluster().generate(30, 6).serve(10)
    yield "small_host", (Program(SMALL | HOST).cluster().generate(40, 12).generate(40, 12).generate(40, 12)
                         .serve(20).op(STATS))
    yield "prefix", (Program(HOST | PREFIX).cluster().generate(30, 2, shared=True).serve(6)
                     .generate(34, 2, shared=True).serve(6).generate(26, 3, shared=True).serve(6))
    yield "prefix_copy_fails", (Program(HOST | PREFIX).cluster().generate(30, 2, shared=True).serve(6)
                                .generate(34, 2, shared=True).op(WAIT, 3).op(MISHANDLE, 0, F_FAIL_ONE, 0)
                                .serve(8))
    yield "codecs", Program(0).cluster().generate(8, 3, codec=2).generate(8, 3, codec=3).generate(8, 3, codec=5).serve(8)
    for name, fault in [("fail_one", F_FAIL_ONE), ("bad_token", F_BAD_TOKEN), ("leave_out", F_LEAVE_OUT),
                        ("unknown_seq", F_UNKNOWN_SEQ), ("wrong_step", F_WRONG_STEP), ("twice", F_TWICE),
                        ("fail_all", F_FAIL_ALL), ("empty", F_EMPTY)]:
        p = Program(0).cluster().generate(6, 5).generate(9, 5).op(WAIT, 3)
        for stage in (1, 3, 0):   # the last stage of each replica, then a first stage
            p.op(MISHANDLE, stage, fault, 1).op(HANDLE, stage ^ 1).op(WAIT, 3)
        yield "fault_" + name, p.serve(8)
    p = Program(TIMEOUT).cluster().generate(6, 5).generate(9, 5).op(WAIT, 3).op(MISHANDLE, 1, F_SILENT, 0)
    yield "fault_silent", p.op(HANDLE, 0).op(HANDLE, 2).op(HANDLE, 3).serve(8)
    p = Program(TIMEOUT).cluster().generate(6, 12).generate(6, 12).serve(3).op(DRAIN, 0).op(WAIT, 3)
    for peer in range(4):
        p.op(MISHANDLE, peer, 4, 0)   # no MigrateDone at all
    yield "drain_migration_silent", p.serve(10)
    yield "lost_mid_step", Program(0).cluster().generate(6, 8).generate(7, 8).serve(2).op(GONE, 1).serve(10)
    yield "lost_twice", (Program(SMALL | HOST).cluster().generate(20, 8).serve(1).op(GONE, 0).op(GONE, 2)
                         .op(JOIN, 0).op(JOIN, 0).serve(6))
    # recoveries: a lost stage's requests go on on the other replica, lost again there (and the
    # replacement that joined meanwhile); KV faults (EIO: arg 2, ECRC: arg 4) on every sequence
    yield "recover_lost", (Program(RECOVER).cluster().generate(6, 12).generate(7, 12).serve(2).op(GONE, 1).serve(3)
                           .op(JOIN, 0).op(GONE, 2).serve(10))
    yield "recover_all_lost", (Program(RECOVER).cluster().generate(6, 12).generate(7, 12).serve(2).op(GONE, 0)
                               .op(GONE, 3).op(JOIN, 0).op(JOIN, 0).op(HANDLE, 4).op(HANDLE, 5).serve(8))
    yield "recover_faults", (Program(RECOVER | SMALL | HOST).cluster().generate(20, 10).generate(9, 10).serve(2)
                             .op(MISHANDLE, 0, F_FAIL_ALL, 2).op(MISHANDLE, 1, F_FAIL_ALL, 4).serve(3)
                             .op(MISHANDLE, 2, F_UNKNOWN_SEQ, 3).serve(10))
    yield "cancel_abort", (Program(0).cluster().generate(6, 12).generate(8, 12).generate(9, 12).serve(2)
                           .op(CANCEL, 0).op(ABORT, 1).op(ABORT, 0).serve(6).op(CANCEL, 2))
    yield "drain", Program(0).cluster().generate(6, 12).generate(6, 12).serve(3).op(DRAIN, 0).serve(12).op(DRAIN, 0)
    p = Program(0).cluster().generate(6, 12).generate(6, 12).serve(3).op(DRAIN, 1).op(WAIT, 3)
    for peer in range(4):
        p.op(MISHANDLE, peer, 1, 0)   # a failed MigrateDone from each worker holding one
    yield "drain_migration_fails", p.serve(10)
    p = Program(0).cluster().generate(6, 12).generate(6, 12).serve(3).op(DRAIN, 2).op(WAIT, 3)
    for peer in range(4):
        p.op(MISHANDLE, peer, 3, 0)   # each MigrateDone twice
    yield "drain_migration_twice", p.serve(10)
    yield "raw", (Program(0).cluster().generate(6, 4).op(WAIT, 3)
                  .raw(1, step_result(1, [(1, 5, 0), (2, 400, 0)])).raw(1, step_result(1, [(1, 3, 0)]))
                  .raw(0, migrate_done(1, 0)).raw(2, kv_report(3, 1 << 40)).raw(3, b"\x10\x01")
                  .serve(6))
    yield "refused_joins", (Program(0).op(JOIN, 0xF0).op(JOIN, 3).op(JOIN, 0x0C).cluster().op(JOIN, 0)
                            .generate(4, 2).serve(4))
    yield "reports", (Program(HOST).cluster().op(REPORT, 0, 9, 9, 9, 9, 9, 9).op(REPORT, 1, 0, 0, 0, 0, 0, 0)
                      .op(REPORT, 0, 1, 1, 1, 1, 1, 1).op(STATS).generate(5, 2).serve(4))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    n = 0
    for name, prog in seeds():
        (OUT / name).write_bytes(bytes(prog.b))
        n += 1
    print(f"wrote {n} seeds to {OUT}")


if __name__ == "__main__":
    main()

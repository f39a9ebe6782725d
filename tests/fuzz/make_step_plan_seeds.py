#!/usr/bin/env python3
"""Writes fuzz seeds for tests/fuzz/fuzz_step_plan.c into tests/fuzz/corpus/fuzz_step_plan/:
programs of steps in the target's byte format (see decode_step there) for the runs a coordinator
makes (prefill in chunks and decode, several sequences, preemption with and without a host tier,
per-request KV plans, prefix parking and reuse) and for plans it never makes (a sequence twice,
wrong positions, unknown ids, tokens outside the vocabulary, unassigned plans); and 'P' inputs of
StepPlan messages encoded by Python's protobuf (independent of protobuf-c).
usage: make_step_plan_seeds.py   (needs /usr/bin/python3 with protobuf, and protoc)"""
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "corpus" / "fuzz_step_plan"
PROTO = HERE.parent.parent / "proto"

PLAN = {"": 0, "fp16": 3, "kivi4-r32": 4, "kivi2-r32": 5, "tada2": 6, "kivi2-q9": 7, "x": 8}
POS_RIGHT = 0  # the position the target tracks for the id


def ident(i):
    """Byte for a sequence id: 1..6, or 0 / 2^64-1 / 1000+b for ids no coordinator uses."""
    if i == 0:
        return 0xE0
    if i == "max":
        return 0xE1
    if i >= 1000:
        return i - 1000
    assert 1 <= i <= 6
    return i - 1


def pos(p):
    """Byte for pos0: the tracked one, or a multiple of 8 below 400."""
    if p is None:
        return POS_RIGHT
    assert p % 8 == 0 and p < 400
    return 200 + p // 8


def seq(i, tokens, sample=True, last=True, plan="", p=None, prefix=None, temp=0, top_p=255, top_k=0, seed=1):
    assert 1 <= len(tokens) <= 48
    out = [ident(i), len(tokens) - 1, pos(p)] + list(tokens)
    flags = int(sample) | int(last) << 1
    if prefix is None:
        flags |= PLAN[plan] << 2
    else:
        flags |= 54 << 2  # flags >> 6 == 3 (a prefix entry follows) and plan index 54 % 9 == 0: ""
    out.append(flags)
    if prefix is not None:
        out.append(ident(prefix))
    return out + [temp, top_p, top_k, seed]


def step(seqs=(), free=(), preempt=(), resume=(), park=None, drop=()):
    assert len(seqs) <= 6 and len(free) <= 3 and len(preempt) <= 3 and len(resume) <= 3 and len(drop) <= 1
    out = [len(seqs)]
    for s in seqs:
        out += s
    out.append(len(free) | len(preempt) << 2 | len(resume) << 4 | (park is not None) << 6 | len(drop) << 7)
    out += [ident(i) for i in free] + [ident(i) for i in preempt] + [ident(i) for i in resume]
    out += [ident(i) for i in drop]
    if park is not None:
        out += [ident(park[0]), park[1] // 32]
    return out


def program(tiered, steps):
    return bytes([1 if tiered else 0] + [b for s in steps for b in s])


def toks(n, start=3):
    return [(start + 11 * k) % 200 for k in range(n)]


def decode(ids):
    return step([seq(i, [5 + i]) for i in ids])


def main():
    seeds = {}
    seeds["prefill_decode"] = program(False, [step([seq(1, toks(40)), seq(2, toks(20, 9))])]
                                      + [decode([1, 2])] * 5 + [step(free=[1, 2])])
    seeds["chunked_prefill"] = program(False, [step([seq(1, toks(48), sample=False, last=False)]),
                                               step([seq(1, toks(30, 5))])] + [decode([1])] * 4)
    seeds["preempt_tiered"] = program(True, [step([seq(i, toks(47, i)) for i in (1, 2, 3)]), decode([1, 2, 3]),
                                             step([seq(1, [7]), seq(2, [8])], preempt=[3]), decode([1, 2]),
                                             step([seq(3, [9])], resume=[3]), decode([1, 2, 3]),
                                             step(free=[1, 2, 3])])
    seeds["preempt_no_tier"] = program(False, [step([seq(1, toks(40))]), step(preempt=[1]), decode([1]),
                                               step(resume=[1]), decode([1])])
    seeds["plans"] = program(False, [step([seq(1, toks(33), plan="fp16"), seq(2, toks(33), plan="kivi4-r32"),
                                           seq(3, toks(33), plan="kivi2-r32"), seq(4, toks(10), plan="tada2"),
                                           seq(5, toks(10), plan="kivi2-q9"), seq(6, toks(10), plan="x")])]
                             + [decode([1, 2, 3])] * 3)
    seeds["prefix_reuse"] = program(False, [step([seq(1, toks(48), sample=False, last=False)]),
                                            step([seq(1, toks(30, 7))]), decode([1]),
                                            step(park=(1, 32), free=[1]),
                                            step([seq(2, toks(9, 50), p=32, prefix=1)]), decode([2]),
                                            step([seq(3, toks(4, 60), p=32, prefix=1)]), decode([2, 3]),
                                            step(drop=[1]), step(free=[2, 3])])
    seeds["prefix_wrong"] = program(False, [step([seq(1, toks(20))]), step(park=(1, 32)), step(park=(2, 32)),
                                            step([seq(3, toks(4), p=32, prefix=2)]),
                                            step([seq(4, toks(4), p=64, prefix=1)]), step(drop=[5])])
    seeds["sampling"] = program(False, [step([seq(1, toks(12), temp=200, top_p=230, top_k=40, seed=3),
                                              seq(2, toks(12), temp=129, top_p=0, top_k=1, seed=4)])]
                                + [decode([1, 2])] * 6)
    seeds["bad_plans"] = program(False, [
        step([seq(1, toks(10)), seq(1, toks(10))]),                       # one sequence twice
        step([seq(2, toks(10), p=16)]),                                   # a first chunk not at 0
        step([seq(3, [5])]), step([seq(3, [6], p=8)]),                    # a wrong position
        step([seq(4, [0xff, 0xfe, 3])]),                                  # tokens outside the vocabulary
        step([seq(0, toks(5)), seq("max", toks(5)), seq(1100, toks(5))]),  # odd ids
        step(free=[0, "max", 6], preempt=[5, 1100], resume=[4, 2, 1]),
        step([seq(2, [1])], preempt=[2]), step([seq(2, [1])], resume=[2], free=[2])])
    seeds["full_pool"] = program(False, [step([seq(i, toks(48, i), sample=False, last=False) for i in range(1, 7)]),
                                         step([seq(i, toks(48, i + 1), sample=False, last=False) for i in range(1, 7)]),
                                         step([seq(i, toks(48, i + 3), sample=False, last=False) for i in range(1, 7)]),
                                         step([seq(i, toks(48, i + 2)) for i in range(1, 7)])]
                                 + [decode(range(1, 7))] * 3)
    seeds["full_pool_tiered"] = b"\x01" + seeds["full_pool"][1:]

    with tempfile.TemporaryDirectory() as stubs:
        subprocess.run(["protoc", f"--proto_path={PROTO}", f"--python_out={stubs}", "strata_internal.proto"],
                       check=True)
        sys.path.insert(0, stubs)
        import strata_internal_pb2 as ipb  # noqa: E402

        def frame(plan):
            b = plan.SerializeToString()
            return len(b).to_bytes(2, "little") + b

        p1 = ipb.StepPlan(step=1, seqs=[ipb.SeqWork(seq_id=7, tokens=list(range(3, 43)), pos0=0, sample=True,
                                                    last_chunk_of_prompt=True, kv_plan="fp16"),
                                        ipb.SeqWork(seq_id=8, tokens=[10, 20, 30], sample=True,
                                                    last_chunk_of_prompt=True, temperature=0.8, top_p=0.9,
                                                    top_k=20, seed=99)])
        p2 = ipb.StepPlan(step=2, seqs=[ipb.SeqWork(seq_id=7, tokens=[4], pos0=40, sample=True),
                                        ipb.SeqWork(seq_id=8, tokens=[5], pos0=3, sample=True)])
        p3 = ipb.StepPlan(step=3, park_prefixes=[ipb.PrefixPark(seq_id=7, n_tokens=32)], free_seqs=[7],
                          seqs=[ipb.SeqWork(seq_id=9, tokens=[1, 2], pos0=32, prefix_entry=7, sample=True),
                                ipb.SeqWork(seq_id=8, tokens=[6], pos0=4, sample=True)])
        p4 = ipb.StepPlan(step=4, preempt_seqs=[8], drop_prefixes=[7], seqs=[ipb.SeqWork(seq_id=9, tokens=[3],
                                                                                       pos0=34, sample=True)])
        p5 = ipb.StepPlan(step=5, resume_seqs=[8], free_seqs=[9])
        seeds["wire_run"] = b"P" + b"".join(frame(p) for p in (p1, p2, p3, p4, p5))
        seeds["wire_empty"] = b"P" + frame(ipb.StepPlan(step=1))
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    for name, data in seeds.items():
        (OUT / name).write_bytes(data)
    print(f"wrote {len(seeds)} seeds to {OUT}")


if __name__ == "__main__":
    main()

"""Sample messages for the C <-> Python protobuf check (tests/proto/check_python.sh).

The same messages are built in C in tests/test_proto.c (fill_generate_text, fill_generate_tokens,
fill_step_plan, fill_join, test_interop_python); keep the two in step.

  interop.py write DIR   encode each message to DIR/py_<name>
  interop.py check DIR   decode DIR/c_<name> (written by the C side) and compare
DIR must hold strata_pb2.py and strata_internal_pb2.py (protoc --python_out).
"""
import sys


def messages(pb, ipb):
    out = {}

    text = pb.GenerateRequest(
        request_id="req-42",
        text="Grüße, 世界! 😀\nline2",
        sampling=pb.SamplingParams(
            temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1, max_tokens=128,
            stop=["\n\n", "END"], stop_token_ids=[2, 128001], ignore_eos=True),
        kv_codec="0-9:tada4,10-29:tada2")
    out["generate_request_text.bin"] = text

    tokens = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 0, 2**32 - 1, 300]),
        sampling=pb.SamplingParams(max_tokens=1))
    out["generate_request_tokens.bin"] = tokens

    out["generate_response_complete.bin"] = pb.GenerateResponse(
        request_id="r",
        complete=pb.Complete(finish_reason=pb.FINISH_REASON_LENGTH, prompt_tokens=5,
                             completion_tokens=7))

    plan = ipb.StepPlan(step=2**40 + 1, free_seqs=[3], preempt_seqs=[4, 5], resume_seqs=[6], drop_prefixes=[2, 1])
    plan.park_prefixes.add(seq_id=3, n_tokens=128)
    plan.seqs.add(seq_id=7, tokens=[1, 2, 3], pos0=4096, last_chunk_of_prompt=True,
                  temperature=0.5, top_p=0.95, top_k=20, seed=99, sample=True, kv_plan="kivi2",
                  prefix_entry=3, sampled_before=17)
    plan.seqs.add(seq_id=8, tokens=[5], pos0=100)
    out["coordinator_step_plan.bin"] = ipb.CoordinatorMessage(step_plan=plan)

    out["worker_join.bin"] = ipb.WorkerMessage(join=ipb.Join(
        secret_proof=b"\x00\x01proof\xff", worker_nonce=b"\xfenonce\x00", worker_name="node1-gpu0",
        device="cuda:0", device_kv_bytes=60 << 30, host_kv_bytes=200 << 30, nvme_kv_bytes=1 << 40,
        data_addr="10.0.0.2:7001", protocol_version=3))
    return out


def main():
    mode, folder = sys.argv[1], sys.argv[2]
    sys.path.insert(0, folder)
    import strata_pb2
    import strata_internal_pb2

    msgs = messages(strata_pb2, strata_internal_pb2)
    for name, msg in msgs.items():
        if mode == "write":
            with open(f"{folder}/py_{name}", "wb") as f:
                f.write(msg.SerializeToString())
        elif mode == "check":
            with open(f"{folder}/c_{name}", "rb") as f:
                got = type(msg).FromString(f.read())
            if got != msg:
                sys.exit(f"{name}: C's encoding decodes to\n{got}\nexpected\n{msg}")
        else:
            sys.exit(f"unknown mode {mode}")
    print(f"{mode}: {len(msgs)} messages ok")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes fuzz seeds for tests/fuzz/fuzz_generate_request.c into
tests/fuzz/corpus/fuzz_generate_request/: GenerateRequest messages encoded by Python's protobuf
(an implementation independent of protobuf-c) with every input kind, sampling field and kinds of
kv_codec, and bare kv_codec strings ('K' then the text) covering the plan grammar.
usage: make_request_seeds.py   (needs /usr/bin/python3 with protobuf, and protoc)"""
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "corpus" / "fuzz_generate_request"
PROTO = HERE.parent.parent / "proto"

CODECS = ["fp16", "kivi2", "kivi4", "kivi2-g32", "kivi4-g64-r128", "kivi2-r0", "gear2", "gear4-s2", "gearl2",
          "ott2", "ott4-n8", "tada", "tada2", "tada4", "tada8", "0-14:tada4,15-29:tada2", "0:kivi2,1-29:kivi4",
          "0-29:ott2", "0-9:gear2,10-19:kivi4,20-29:fp16"]


def main():
    with tempfile.TemporaryDirectory() as stubs:
        subprocess.run(["protoc", f"--proto_path={PROTO}", f"--python_out={stubs}", "strata.proto"], check=True)
        sys.path.insert(0, stubs)
        import strata_pb2 as pb  # noqa: E402
        OUT.mkdir(parents=True, exist_ok=True)
        seeds = {}
        for i, codec in enumerate(CODECS):
            r = pb.GenerateRequest(text="The capital of France is", kv_codec=codec,
                                   sampling=pb.SamplingParams(max_tokens=16))
            seeds[f"req_codec_{i:02d}"] = r.SerializeToString()
            seeds[f"kv_{i:02d}"] = b"K" + codec.encode()
        r = pb.GenerateRequest(request_id="req-1", sampling=pb.SamplingParams(
            max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=["\n\n", "END"],
            stop_token_ids=[2, 0], ignore_eos=True))
        r.token_ids.ids.extend([1, 504, 3458, 282, 49151])
        seeds["req_ids_sampling"] = r.SerializeToString()
        seeds["req_text_unicode"] = pb.GenerateRequest(text="héllo wörld \u4e16\u754c \U0001f600",
                                                       sampling=pb.SamplingParams(max_tokens=1)).SerializeToString()
        seeds["req_empty"] = b""
        seeds["kv_comment"] = b"K0-14:kivi4 # lower\n15-29:kivi2\n"
        for name, data in seeds.items():
            (OUT / name).write_bytes(data)
        print(f"wrote {len(seeds)} seeds to {OUT}")


if __name__ == "__main__":
    main()

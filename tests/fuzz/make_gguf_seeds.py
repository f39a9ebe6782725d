#!/usr/bin/env python3
"""Writes small valid GGUF files as fuzz seeds (tests/fuzz/corpus/fuzz_gguf/), with the
independent `gguf` Python writer: metadata of every value type and tensors of every type the
reader dequantizes."""
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import quantize

OUT = Path(__file__).with_name("corpus") / "fuzz_gguf"


def write(name, quant_types, n_words):
    OUT.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(OUT / name), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("general.name", "seed")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_words)])
    w.add_array("tokenizer.ggml.token_type", [1] * n_words)
    w.add_int64("test.i64", -5)
    w.add_float64("test.f64", 0.25)
    rng = np.random.default_rng(0)
    for qt in quant_types:
        x = rng.standard_normal((2, 32)).astype(np.float32)
        if qt in (Q.F32,):
            w.add_tensor(f"t.{qt.name}", x)
        elif qt == Q.F16:
            w.add_tensor(f"t.{qt.name}", x.astype(np.float16))
        else:
            q = quantize(x, qt)
            w.add_tensor(f"t.{qt.name}", q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


write("all_types.gguf", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], 8)
write("q4_only.gguf", [Q.Q4_1], 3)
write("no_tensors.gguf", [], 2)
print(sorted(p.name for p in OUT.iterdir()))

#!/usr/bin/env python3
"""Copy a GGUF model with every value of one F32 tensor set to VALUE: finite weights that make a
model misbehave (an output norm of 3e38 overflows the logits), for the command-line tests.

usage: gguf_fill_tensor.py SRC DST TENSOR VALUE
"""
import struct
import sys

SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY, GGML_F32 = 8, 9, 0


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 8   # past the magic and the version

    def scalar(self, fmt):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self):
        n = self.scalar("<Q")
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos])

    def skip_value(self, kind):
        if kind == GGUF_STRING:
            self.string()
        elif kind == GGUF_ARRAY:
            elem, n = self.scalar("<I"), self.scalar("<Q")
            for _ in range(n):
                self.skip_value(elem)
        else:
            self.pos += SCALAR_BYTES[kind]


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__.strip())
    src, dst, tensor, value = sys.argv[1], sys.argv[2], sys.argv[3].encode(), float(sys.argv[4])
    data = bytearray(open(src, "rb").read())
    r = Reader(data)
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    alignment = 32
    for _ in range(n_kv):
        key, kind = r.string(), r.scalar("<I")
        if key == b"general.alignment":
            alignment = struct.unpack_from("<I", data, r.pos)[0]
        r.skip_value(kind)
    infos = {}
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        infos[name] = (dims, r.scalar("<I"), r.scalar("<Q"))
    if tensor not in infos:
        sys.exit(f"{src}: no tensor {tensor.decode()}")
    dims, kind, offset = infos[tensor]
    if kind != GGML_F32:
        sys.exit(f"{src}: tensor {tensor.decode()} is not F32 (type {kind})")
    start = (r.pos + alignment - 1) // alignment * alignment + offset
    count = 1
    for d in dims:
        count *= d
    struct.pack_into(f"<{count}f", data, start, *([value] * count))
    open(dst, "wb").write(data)


if __name__ == "__main__":
    main()

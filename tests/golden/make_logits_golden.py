#!/usr/bin/env python3
"""Writes tests/golden/logits.txt: reference next-token logits for the default model.

Two independent references, neither sharing code with strata:
  * a float64 NumPy implementation of the Llama forward pass written here, with the weights
    dequantized by the `gguf` Python package (the primary reference: the C test compares to it);
  * llama.cpp through `llama-cpp-python` on the same GGUF (tokenizes the prompts and
    cross-checks the NumPy reference: same greedy tokens, logits close, see the header).

For each case the sequence is the prompt followed by the reference's own greedy continuation;
logits are stored at a few positions: the 32 largest (id, value) pairs and every 48th vocabulary
entry. Usage: python3 tests/golden/make_logits_golden.py [MODEL] (needs numpy, gguf,
llama-cpp-python; dev-only, CI reads the committed file).
"""
import hashlib
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).with_name("logits.txt")
STRIDE = 48
TOPN = 32

LONG_TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
    "continental Europe and North America during the following decades. It replaced hand production "
    "with machines, introduced new chemical manufacturing and iron production processes, and made "
    "steam power and water power far more widely used. Textiles were the dominant industry in terms "
    "of employment, the value of output and the capital invested. Many of the technological and "
    "architectural innovations were of British origin. By the middle of the eighteenth century Britain "
    "was the world's leading commercial nation, controlling a global trading empire with colonies in "
    "North America and the Caribbean. Economic historians agree that the onset of the Industrial "
    "Revolution is the most important event in human history since the domestication of animals and "
    "plants. The standard of living for the general population in the Western world began to increase "
    "consistently for the first time in history, although others have said that it did not begin to "
    "improve meaningfully until the late nineteenth and twentieth centuries. The"
)
CASES = [
    # name, prompt, greedy continuation length, positions to store (None = all prompt positions)
    ("capital", "The capital of France is", 8, None),
    ("long", LONG_TEXT, 8, "sparse"),
]


def load(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    a = dequantize(t.data, t.tensor_type).astype(np.float64)
    return a.reshape([int(x) for x in reversed(t.shape)])


def field(reader, key):
    return reader.fields[key].contents()


class Reference:
    def __init__(self, path):
        r = GGUFReader(str(path))
        self.n_layers = int(field(r, "llama.block_count"))
        self.n_embd = int(field(r, "llama.embedding_length"))
        self.n_heads = int(field(r, "llama.attention.head_count"))
        self.n_kv = int(field(r, "llama.attention.head_count_kv"))
        self.theta = float(field(r, "llama.rope.freq_base"))
        self.eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
        self.hd = self.n_embd // self.n_heads
        self.embd = load(r, "token_embd.weight")            # [vocab, embd]
        names = {t.name for t in r.tensors}
        self.out = load(r, "output.weight") if "output.weight" in names else self.embd
        self.out_norm = load(r, "output_norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            g = lambda s: load(r, f"blk.{i}.{s}.weight")
            self.layers.append({k: g(k) for k in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, n_heads):
        # GGUF llama tensors rotate adjacent pairs (x[2i], x[2i+1]) by pos * theta^(-2i/d).
        n = x.shape[0]
        x = x.reshape(n, n_heads, self.hd // 2, 2)
        pos = np.arange(n, dtype=np.float64)[:, None]
        freq = self.theta ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        ang = pos * freq[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0], x[..., 1]
        return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(n, n_heads * self.hd)

    def forward(self, tokens):
        """Logits for every position of tokens (exact causal attention, float64)."""
        n = len(tokens)
        x = self.embd[np.asarray(tokens)]
        mask = np.triu(np.full((n, n), -np.inf), 1)
        group = self.n_heads // self.n_kv
        for L in self.layers:
            h = self.rmsnorm(x, L["attn_norm"])
            q = self.rope(h @ L["attn_q"].T, self.n_heads).reshape(n, self.n_heads, self.hd)
            k = self.rope(h @ L["attn_k"].T, self.n_kv).reshape(n, self.n_kv, self.hd)
            v = (h @ L["attn_v"].T).reshape(n, self.n_kv, self.hd)
            att = np.empty((n, self.n_heads, self.hd))
            for hh in range(self.n_heads):
                kh = hh // group
                s = q[:, hh, :] @ k[:, kh, :].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                s /= s.sum(axis=1, keepdims=True)
                att[:, hh, :] = s @ v[:, kh, :]
            x = x + att.reshape(n, -1) @ L["attn_output"].T
            h = self.rmsnorm(x, L["ffn_norm"])
            gate = h @ L["ffn_gate"].T
            ff = gate / (1.0 + np.exp(-gate)) * (h @ L["ffn_up"].T)
            x = x + ff @ L["ffn_down"].T
        return self.rmsnorm(x, self.out_norm) @ self.out.T


def main():
    import llama_cpp

    sha = hashlib.sha256(MODEL.read_bytes()).hexdigest()
    ref = Reference(MODEL)
    llm = llama_cpp.Llama(model_path=str(MODEL), n_ctx=2048, logits_all=True, verbose=False, seed=0)
    lines = [
        "# strata golden logits v1: reference = float64 NumPy forward (tests/golden/make_logits_golden.py)",
        f"# model {MODEL.name} sha256 {sha}",
        f"# cross-checked against llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        f"stride {STRIDE}",
        f"topn {TOPN}",
    ]
    for name, prompt, n_gen, which in CASES:
        prompt_ids = llm.tokenize(prompt.encode(), add_bos=False, special=False)
        ids = list(prompt_ids)
        for _ in range(n_gen):  # the reference's own greedy continuation
            ids.append(int(np.argmax(ref.forward(ids)[-1])))
        logits = ref.forward(ids)
        llm.reset()
        llm.eval(ids)
        cpp = np.array(llm.scores[: len(ids)], dtype=np.float64)
        diff = np.abs(cpp - logits).max(axis=1)
        agree = int(np.sum(np.argmax(cpp, axis=1) == np.argmax(logits, axis=1)))
        text = llm.detokenize(ids[len(prompt_ids):]).decode("utf-8", "replace")
        print(f"{name}: {len(prompt_ids)} prompt + {n_gen} generated tokens, continuation {text!r}")
        print(f"  llama.cpp vs float64 reference: top-1 agree {agree}/{len(ids)}, "
              f"max |logit diff| {diff.max():.4f} (median over positions {np.median(diff):.4f})")
        n_prompt = len(prompt_ids)
        if which is None:
            positions = list(range(len(ids) - 1))
        else:
            positions = sorted(set(list(range(0, n_prompt, 40)) + list(range(n_prompt - 1, len(ids) - 1))))
        lines.append(f"case {name} prompt {n_prompt} tokens {' '.join(map(str, ids))}")
        lines.append(f"# llama.cpp top-1 agreement {agree}/{len(ids)}, max |diff| {diff.max():.4f}")
        for p in positions:
            row = logits[p]
            top = np.argsort(-row)[:TOPN]
            lines.append(f"pos {p} top " + " ".join(f"{i}:{row[i]:.6f}" for i in top))
            lines.append(f"pos {p} strided " + " ".join(f"{v:.6f}" for v in row[::STRIDE]))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

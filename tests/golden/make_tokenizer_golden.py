#!/usr/bin/env python3
"""Writes tests/golden/tokenizer_ids.txt: reference token ids from llama.cpp (through the
llama-cpp-python package) for a fixed list of texts, for tests/test_tokenizer.c.

usage: python3 tests/golden/make_tokenizer_golden.py [MODEL.gguf] [OUTPUT]

File format (UTF-8, one case per line, '#' lines are comments):
    special<TAB>hex-of-text-bytes<TAB>space-separated ids
where special is 1 when the text was tokenized with special=True (control tokens such as
<|im_start|> are parsed) and 0 otherwise. No BOS is added. A few texts are invalid UTF-8: llama.cpp
replaces each invalid byte by U+FFFD (and re-encodes overlong forms), which the C test takes into
account for those lines."""
import hashlib
import os
import sys

import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODEL = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "tokenizer_ids.txt")

TEXTS = [
    # English prose
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "In 1492, Columbus sailed the ocean blue. It wasn't easy -- nor cheap!",
    "Large language models (LLMs) are trained on trillions of tokens; serving them efficiently "
    "requires careful memory management, batching and caching of attention keys/values.",
    "HELLO World hElLo WORLD",
    # code
    "int main(void)\n{\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (size_t i = 0; i < n; i++) {\n\tsum += a[i] * b[i];\n}",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment\n",
    "if (a != b && c >= d || !e) { return x->y[z]; }",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))",
    "    \tindented with mixed\t tabs",
    # numbers
    "12345 3.14159 1,000,000",
    "0 00 007 1e-9 -42 +17 0x1F 3/4",
    "Call 555-0123 or 1-800-555-0199 before 23:59:59 on 2024-02-29.",
    "\u0661\u0662\u0663 \u2160\u2161 \u00bd \u00b2 \uff11\uff12",
    # whitespace
    "   \n\n  ",
    " ",
    "  ",
    "\t",
    "\n",
    "a  b   c    d",
    "line1\nline2\r\nline3\n\n\nline4",
    "trailing spaces   ",
    "   leading spaces",
    "  both  ",
    " \t \n x",
    "tabs\t\tand\t\t\tmore",
    "nbsp\u00a0here\u3000ideographic\u2003em space\u2028line sep",
    "\x1c\x1d\x1e\x1f control \x00 nul \x7f del",
    # contractions
    "I'm don't we'll they're you've she'd it's",
    "I'M DON'T 'S 'll' ''s 'x 're",
    "rock'n'roll o'clock",
    # emoji
    "\U0001F600 \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466",
    "flags: \U0001F1FA\U0001F1F8 \U0001F1EF\U0001F1F5 \U0001F3F3\ufe0f\u200d\U0001F308",
    "\u2764\ufe0f love it!!! \U0001F525\U0001F525\U0001F525",
    # CJK
    "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c\u6211\u4eec\u53bb\u516c\u56ed\u5427\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca\u3002",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4.",
    # other scripts
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u0141\u00f3d\u017a",
    "cafe\u0301 (combining accent)",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u041a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "\u0393\u03b5\u03b9\u03b1 \u03c3\u03bf\u03c5 \u03ba\u03cc\u03c3\u03bc\u03b5",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    # CJK Extension I (Unicode 15.1, newer than some libutf8proc releases) and Tangut
    "x@\U0002EDC4't \U0002EBF0\U0002EE5D'm \U00017890'd",
    # punctuation
    "Wait... what?! (really) [yes] {no} <maybe> \"quoted\" 'single' `tick`",
    "a--b---c \u2014 d \u2013 e \u2026 \u00ab\u00bb \u201c\u201d \u2018\u2019",
    "@user #tag $100 50% a&b a*b a+b=c a|b a^b ~a \\path\\to/file",
    "!!!???...,,,;;;:::",
    "https://example.com/path?query=1&x=y#frag",
    "email@example.org, see <http://x.y>",
    # special-token text
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more <|endoftext|> end",
    "<|im_start|><|im_start|>",
    "< |im_start| > <|im_start <|im_end|",
    "<jupyter_code>print(1)<jupyter_output>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    # empty and tiny
    "",
    "a",
    ".",
    "'",
    "'s",
    # long repetitive stretches
    "a" * 200,
    "1" * 50,
    " " * 40 + "x",
    "ab" * 60,
]

# Not valid UTF-8: llama.cpp tokenizes U+FFFD for each invalid byte.
INVALID = [
    b"abc\xffdef",
    b"\x80\x81 lone continuation",
    b"truncated \xe2\x82",
    b"truncated at end \xf0\x9f\x98",
    b"overlong \xc0\xaf slash",
    b"surrogate \xed\xa0\x80 x",
    b"mixed \xe2\x82\xac ok \xe2 bad \xc3\xa9 ok",
]


def main():
    llm = llama_cpp.Llama(model_path=MODEL, vocab_only=True, verbose=False)
    with open(MODEL, "rb") as f:
        sha = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    cases = [t.encode("utf-8") for t in TEXTS] + INVALID
    lines = [
        "# Reference token ids for tests/test_tokenizer.c, written by make_tokenizer_golden.py",
        "# reference: llama.cpp via llama-cpp-python %s" % llama_cpp.__version__,
        "# model: %s sha256 %s" % (os.path.basename(MODEL), sha.hexdigest()),
        "# format: special<TAB>hex-of-text-bytes<TAB>space-separated ids (no BOS)",
    ]
    for data in cases:
        for special in (False, True):
            ids = llm.tokenize(data, add_bos=False, special=special)
            lines.append("%d\t%s\t%s" % (int(special), data.hex(), " ".join(map(str, ids))))
    with open(OUT, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote %d cases to %s" % (len(lines) - 4, OUT))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Turns `strata eval --json` output into a markdown table and a gnuplot data file.
usage: quality_report.py EVAL.json OUT.dat "COMMAND"  (markdown on stdout)"""
import json
import sys

def main():
    src, dat, command = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(src) as f:
        ev = json.load(f)
    rows = ev["results"]
    print(f"Command: `{command}`  ")
    print(f"Model: {ev['model']}; text: `{ev['text']}`; prefill {ev['prefill']} tokens, "
          f"{ev['tokens']} decode steps scored; blocks of {ev['block_tokens']} tokens.\n")
    print("| kv | ppl | ppl change | KL(fp16 ‖ kv) | top-1 agreement | bytes/token | vs fp16 | mean K err | mean V err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        k = sum(r["k_err"]) / len(r["k_err"])
        v = sum(r["v_err"]) / len(r["v_err"])
        print(f"| {r['kv']} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.2f} % | {r['kl']:.5f} | "
              f"{100 * r['top1']:.1f} % | {r['bytes_per_token']:.0f} | {r['ratio_vs_fp16']:.3f} | {k:.4f} | {v:.4f} |")
    print("\nPlans (per layer):\n")
    for r in rows:
        print(f"- `{r['kv']}`: `{r['plan']}`")
    print("\nPer-layer relative error ||X - X'||_F / ||X||_F of K / V:\n")
    names = [r["kv"] for r in rows if r["kv"] != "fp16"]
    print("| layer | " + " | ".join(names) + " |")
    print("|---:|" + "---|" * len(names))
    n = len(rows[0]["k_err"])
    for layer in range(n):
        cells = [f"{r['k_err'][layer]:.3f} / {r['v_err'][layer]:.3f}" for r in rows if r["kv"] != "fp16"]
        print(f"| {layer} | " + " | ".join(cells) + " |")
    with open(dat, "w") as f:
        for r in rows:
            if r["kv"] == "fp16":
                continue   # KL 0 has no place on a log axis
            f.write(f"\"{r['kv']}\" {r['bytes_per_token']:.1f} {max(r['kl'], 1e-6):.6g}\n")

if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The decode workload of strata-bench-decode-gpu through Hugging Face transformers (fp16 weights,
its default dynamic fp16 KV cache, PyTorch on the same GPU), for the side-by-side comparison the
CUDA issue asks for.

A Llama model of the named shape with random fp16 weights (the same published hyperparameters as
strata's synthetic models), BATCH sequences of PROMPT random ordinary tokens, GEN tokens generated
greedily. Decode throughput = BATCH x (GEN - 1) / (generate time - prefill time), the prefill time
measured by a separate forward pass over the same prompts. Prints one JSON object.

  python3 bench/gpu/hf_decode.py --shape llama3-8b --batch 64 --prompt 512 --gen 128
"""
import argparse
import json
import sys
import time

SHAPES = {  # the rows of worker/synthetic.c
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=384, rope_theta=10000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0, tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.batch < 1 or args.prompt < 1 or args.gen < 2:
        ap.error("--batch and --prompt must be >= 1, --gen >= 2")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        print("hf_decode: no CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(max_position_embeddings=max(8192, args.prompt + args.gen), rms_norm_eps=1e-5,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0, **SHAPES[args.shape])
    torch.set_default_dtype(torch.float16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.eval()
    prompts = torch.randint(32, min(932, cfg.vocab_size), (args.batch, args.prompt), device="cuda")
    mask = torch.ones_like(prompts)

    def generate(gen):
        return model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=gen, min_new_tokens=gen,
                              do_sample=False, use_cache=True, pad_token_id=0)

    with torch.inference_mode():
        generate(2)  # warm-up: kernels, cuBLAS handles, allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model(input_ids=prompts, attention_mask=mask, use_cache=True)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = generate(args.gen)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    assert out.shape == (args.batch, args.prompt + args.gen), out.shape
    decode = max(total - prefill, 1e-9)
    print(json.dumps({
        "impl": "hf-transformers", "device": torch.cuda.get_device_name(0), "shape": args.shape,
        "batch": args.batch, "prompt": args.prompt, "gen": args.gen,
        "decode_tok_s": round(args.batch * (args.gen - 1) / decode, 2), "prefill_s": round(prefill, 3),
        "generate_s": round(total, 3), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

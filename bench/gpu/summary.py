#!/usr/bin/env python3
"""The short table a GPU kit run prints last: each JSON line of `bench
kernels` and `bench engine` (perf.jsonl) as one row of the figures issue 29
states its goals in, each beside its ceiling measured in the same run.

Usage: summary.py PERF_JSONL
"""
import json
import sys


def rows(path):
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                yield json.loads(line)


def main():
    out = []
    for r in rows(sys.argv[1]):
        if r.get("bench") == "kernels" and "paged_attention" in r:
            a = r["paged_attention"]
            out.append((f"decode attention b{a['batch']} ctx {a['context']} {a['kv_dtype']}",
                        f"{a['seconds'] * 1e3:.3f} ms",
                        f"{a['fraction_of_copy_bandwidth']:.2f} of copy"))
        if r.get("bench") == "kernels" and "prefill_attention" in r:
            for p in r["prefill_attention"] or []:
                if p:
                    out.append((f"prefill attention {p['tokens']} tokens {p.get('kv_dtype', 'bf16')}",
                                f"{p['tflops']:.0f} TFLOPS",
                                f"{p['fraction_of_bf16_gemm']:.2f} of GEMM"))
            for kind in ("bf16", "fp8"):
                for g in r.get(f"{kind}_gemv") or []:
                    out.append((f"{kind} GEMV {g['rows']} rows",
                                f"{g['weight_read_gbytes_per_s']:.0f} GB/s",
                                f"{g['fraction_of_copy_bandwidth']:.2f} of copy"))
        if r.get("bench") == "engine":
            sampled = ", sampled" if r.get("temperature", 0) > 0 else ""
            what = f"engine b{r['batch']} after {r['prompt_tokens']} ({r['weight_dtype']}{sampled})"
            out.append((what + " decode", f"{r['decode_step_ms']:.2f} ms, {r['decode_tokens_per_s']:.0f} tok/s",
                        f"{r['decode_bandwidth_fraction']:.2f} of copy"))
            # A line without a GEMM ceiling (a CPU run) still gets its row.
            gemm = r.get("prefill_matrix_fraction")
            out.append((what + " prefill", f"{r['prefill_tokens_per_s']:.0f} tok/s",
                        f"{gemm:.2f} of GEMM" if gemm is not None else "no GEMM ceiling"))
    width = max((len(w) for w, _, _ in out), default=0)
    for what, value, ceiling in out:
        print(f"{what:<{width}}  {value:>24}  {ceiling}")


if __name__ == "__main__":
    main()

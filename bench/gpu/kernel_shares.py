#!/usr/bin/env python3
"""Each kernel's share of a decode step, from Nsight Compute's raw CSV.

Reads `ncu --metrics gpu__time_duration.sum --csv --page raw` of a `bench
engine` run without graphs (bench/gpu/run_kit.sh profile), cuts the launches
into steps at each argmax launch (every step ends with one), keeps the last
STEPS steps (decode; the prompt's steps come first) and prints one JSON line:
the mean step's device time and, per kernel (template arguments dropped), its
milliseconds per step, launches per step and share, largest first.

Usage: kernel_shares.py NCU_CSV [STEPS] [LABEL]
"""
import csv
import json
import re
import sys

UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
         "second": 1e3, "s": 1e3}


def main():
    path = sys.argv[1]
    steps_kept = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    label = sys.argv[3] if len(sys.argv) > 3 else path
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    header = rows[head]
    name_col = header.index("Kernel Name")
    time_col = header.index("gpu__time_duration.sum")
    scale = UNITS.get(rows[head + 1][time_col], None)
    body = rows[head + 2:] if scale is not None else rows[head + 1:]
    scale = scale if scale is not None else 1e-6
    launches = []
    for r in body:
        if len(r) <= max(name_col, time_col) or not r[time_col]:
            continue
        name = r[name_col].replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
        name = re.sub(r"^void ", "", name)
        name = re.split(r"[<(]", name)[0].split("::")[-1].strip()
        launches.append((name, float(r[time_col].replace(",", "")) * scale))
    steps, current = [], []
    for name, ms in launches:
        current.append((name, ms))
        if "ArgMax" in name:
            steps.append(current)
            current = []
    kept = steps[-steps_kept:]
    if not kept:
        sys.exit("kernel_shares: no step ended by an argmax launch in " + path)
    per = {}
    for step in kept:
        for name, ms in step:
            t, n = per.get(name, (0.0, 0))
            per[name] = (t + ms, n + 1)
    step_ms = sum(t for t, _ in per.values()) / len(kept)
    kernels = sorted(per.items(), key=lambda kv: -kv[1][0])
    print(json.dumps({
        "profile": label,
        "steps": len(kept),
        "device_ms_per_step": step_ms,
        "kernels": [{"kernel": k, "ms_per_step": t / len(kept), "launches_per_step": n / len(kept),
                     "share": t / len(kept) / step_ms} for k, (t, n) in kernels],
    }))


if __name__ == "__main__":
    main()

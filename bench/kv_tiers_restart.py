#!/usr/bin/env python3
"""Warm restart of a worker with a host and a disk KV tier (issue 27).

A router and one worker (role both) with a small device pool, a host tier
that holds the whole working set and a disk tier behind it; two passes over
the prompts, then the worker is stopped (SIGKILL or SIGTERM) and started
again on the same disk folder, and a third pass measures how many prompt
tokens came from the cache (`usage.prompt_tokens_details.cached_tokens`)
and whether the text equals the first pass's.

  bench/kv_tiers_restart.py [--bin build/pdserve] [--model DIR] [--stop sigkill|sigterm]
                            [--write through|back|none] [--prompts 12] [--words 205]
                            [--label NAME]

`--write none` passes no --kv-disk-write flag (for builds that lack it).
Defaults: the issue's scenario on stories260K (1.25 MiB device pool, 16 MiB
host tier, 64 MiB disk tier, 12 prompts of about 375 tokens). One JSON line.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

WORDS = ("once upon a time there was a little girl named lily she liked to play "
         "outside with her dog in the big green park one day the sun was bright and "
         "the birds sang happy songs in the tall trees").split()


def prompt(i, words):
    # A different opening per prompt, so no two share a first block.
    out = ["story", str(i), "begins"]
    for k in range(words):
        out.append(WORDS[(k * 7 + i * 3) % len(WORDS)])
    return " ".join(out)


def http(url, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_for(pred, what, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if pred():
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.1)
    raise SystemExit("timed out waiting for " + what)


def metrics(port):
    _, text = http("http://127.0.0.1:%d/metrics" % port)
    return text


def metric(text, name, labels=""):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if labels in line:
                total += float(line.split()[-1])
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/pdserve")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--model", default=os.path.join(here, "..", "..", "shared", "models",
                                                    "stories260K"))
    ap.add_argument("--stop", default="sigkill", choices=["sigkill", "sigterm"])
    ap.add_argument("--write", default="through", choices=["through", "back", "none"])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--words", type=int, default=205)
    ap.add_argument("--pool", default="1310720")  # 1.25 MiB
    ap.add_argument("--host", default="16MiB")
    ap.add_argument("--disk", default="64MiB")
    ap.add_argument("--label", default="", help="a name for the build, copied into the line")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="kv-restart-")
    secret = os.path.join(work, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(secret, 0o600)
    procs = []

    def start(argv, log):
        p = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def grep(log, pattern, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            m = re.search(pattern, open(log).read())
            if m:
                return m
            time.sleep(0.1)
        raise SystemExit("timed out waiting for %r in %s:\n%s" % (pattern, log, open(log).read()))

    rlog = os.path.join(work, "router.log")
    start([args.bin, "router", "--model", args.model, "--port", "0", "--control-port", "0",
           "--cluster-secret-file", secret, "--host", "127.0.0.1"], rlog)
    m = grep(rlog, r"on http :(\d+), control :(\d+)")
    http_port, control_port = int(m.group(1)), int(m.group(2))
    base = "http://127.0.0.1:%d" % http_port
    disk = os.path.join(work, "disk")
    worker_argv = [args.bin, "worker", "--role", "both", "--model", args.model,
                   "--router", "127.0.0.1:%d" % control_port, "--host", "127.0.0.1",
                   "--port", "0", "--metrics-port", "0", "--worker-id", "w0", "--threads", "1",
                   "--cluster-secret-file", secret, "--kv-cache-bytes", args.pool,
                   "--kv-host-cache-bytes", args.host, "--kv-disk-cache-dir", disk,
                   "--kv-disk-cache-bytes", args.disk]
    if args.write != "none":
        worker_argv += ["--kv-disk-write", args.write]

    def start_worker(n):
        log = os.path.join(work, "worker%d.log" % n)
        p = start(worker_argv, log)
        port = int(grep(log, r"metrics :(\d+)").group(1))
        wait_for(lambda: len(re.findall(r"worker w0 synced", open(rlog).read())) > n,
                 "the worker's resync")
        wait_for(lambda: http(base + "/ready")[0] == 200, "/ready")
        return p, port, log

    def run_pass():
        out = []
        for i in range(args.prompts):
            _, body = http(base + "/v1/completions",
                           {"prompt": prompt(i, args.words), "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True})
            r = json.loads(body)
            out.append((r["choices"][0]["text"], r["usage"]["prompt_tokens"],
                        r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)))
        return out

    try:
        w, mport, _ = start_worker(0)
        first = run_pass()
        second = run_pass()
        time.sleep(1.0)  # let the tier mover settle, as a user would not wait for it
        m = metrics(mport)
        host_blocks = metric(m, "pdserve_kv_tier_blocks", 'tier="host"')
        disk_blocks = metric(m, "pdserve_kv_tier_blocks", 'tier="disk"')
        w.send_signal(signal.SIGKILL if args.stop == "sigkill" else signal.SIGTERM)
        w.wait(timeout=120)
        w2, mport2, _ = start_worker(1)
        synced = re.findall(r"worker w0 synced: [^\n]*", open(rlog).read())
        third = run_pass()
        prompt_tokens = sum(p for _, p, _ in third)
        cached = sum(c for _, _, c in third)
        print(json.dumps({
            "bench": "kv_tiers_restart", "label": args.label, "stop": args.stop, "write": args.write,
            "model": os.path.basename(os.path.normpath(args.model)), "kv_cache_bytes": args.pool,
            "host_tier": args.host, "disk_tier": args.disk, "prompts": args.prompts,
            "prompt_tokens": prompt_tokens, "cached_tokens_after_restart": cached,
            "cached_fraction": round(cached / prompt_tokens, 4),
            "second_pass_cached_tokens": sum(c for _, _, c in second),
            "host_tier_blocks_before_stop": host_blocks,
            "disk_tier_blocks_before_stop": disk_blocks,
            "resync": synced[-1] if synced else "",
            "text_equal_first_pass": all(a[0] == b[0] for a, b in zip(first, third)),
        }))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()

"""Why does cuDNN (benchmark mode, fp32, TF32 off) take ~400 us on AlexNet conv3 at N=128 in one process and
~1000 us in another? Times the same convolution in several contexts, each in a fresh process (cuDNN's
benchmark cache is per process), and names the kernels cuDNN ran (torch.profiler). Needs a GPU.

    python benchmarks/probes/cudnn_contexts.py --json /tmp/cudnn_contexts.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


# (N, C, H=W, K, kernel, stride, pad)
LAYERS = {"conv3_n128": (128, 192, 13, 384, 3, 1, 1), "conv4_n128": (128, 384, 13, 256, 3, 1, 1),
          "conv5_n128": (128, 256, 13, 256, 3, 1, 1), "conv3_n32": (32, 192, 13, 384, 3, 1, 1)}
CONTEXTS = ("plain", "heuristics", "requires_grad", "busy_cpu", "side_stream", "after_alexnet", "big_alloc")


def child(context: str, layer: str) -> dict:
    import threading
    import hashlib

    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = context != "heuristics"
    n, c, hw, k, ks, st, pad = LAYERS[layer]
    dev = torch.device("cuda")
    if context == "after_alexnet":  # a stock AlexNet forward in benchmark mode first, as bench_alexnet runs it
        from bagf_torch.models import alexnet

        model = alexnet(tuned=False).to(dev).eval()
        with torch.no_grad():
            model(torch.randn(n, 3, 224, 224, device=dev))
        torch.cuda.synchronize()
    hold = None
    if context == "big_alloc":  # most of the GPU's memory held by the caching allocator's user
        free, total = torch.cuda.mem_get_info()
        hold = torch.empty(int(free * 0.9) // 4, device=dev)
    x = torch.randn(n, c, hw, hw, device=dev)
    w = torch.randn(k, c, ks, ks, device=dev, requires_grad=context == "requires_grad") / (c * ks * ks) ** 0.5
    b = torch.randn(k, device=dev)

    def call():
        return F.conv2d(x, w, b, st, pad)

    stream = torch.cuda.Stream() if context == "side_stream" else torch.cuda.current_stream()
    stop = threading.Event()
    workers = []
    if context == "busy_cpu":  # 16 threads hashing (GIL released) during cuDNN's algorithm search
        blob = os.urandom(1 << 24)

        def spin():
            while not stop.is_set():
                hashlib.sha256(blob).digest()

        workers = [threading.Thread(target=spin, daemon=True) for _ in range(16)]
        for t in workers:
            t.start()
    with torch.cuda.stream(stream):
        call()  # the benchmark-mode algorithm search happens here
        torch.cuda.synchronize()
        stop.set()
        for t in workers:
            t.join()
        for _ in range(10):
            call()
        times = []
        for _ in range(30):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(stream)
            call()
            e.record(stream)
            e.synchronize()
            times.append(s.elapsed_time(e) * 1000)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                call()
            torch.cuda.synchronize()
    kernels = sorted(((ev.key, ev.device_time_total / 3) for ev in prof.key_averages() if ev.device_time_total > 0),
                     key=lambda t: -t[1])
    del hold
    return {"context": context, "layer": layer, "median_us": statistics.median(times),
            "kernels": [(name[:110], round(us, 1)) for name, us in kernels[:4]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("CONTEXT", "LAYER"))
    ap.add_argument("--layers", default="conv3_n128,conv4_n128")
    ap.add_argument("--contexts", default=",".join(CONTEXTS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    rows = []
    for layer in args.layers.split(","):
        for context in args.contexts.split(","):
            env = dict(os.environ)
            r = subprocess.run([sys.executable, __file__, "--child", context, layer], capture_output=True, text=True,
                               env=env, timeout=300)
            if r.returncode != 0:
                rows.append({"context": context, "layer": layer, "error": r.stderr[-800:]})
                print(f"{layer} {context}: FAILED {r.stderr[-300:]}", flush=True)
                continue
            row = json.loads(r.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{layer:11s} {context:14s} {row['median_us']:8.1f} us  " +
                  "; ".join(f"{n} {us:.0f}" for n, us in row["kernels"][:2]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

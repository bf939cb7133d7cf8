"""``python -m bagf_torch``: the command line.

* ``demo [--batch N]``: tune and run AlexNet's conv layers, print a per-layer table. On a machine without
  a CUDA GPU it says so and runs the same model through the ATen fallback.
* ``cache list | export FILE | import FILE | clear``: the tuning cache in ``BAGF_CACHE_DIR``. Export and
  import are how a pre-tuned cache moves to production machines; import keeps only the entries made for
  this machine's GPU and versions and says why it skipped the others.

Errors are one line saying what to do, with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _alexnet_features():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))


def demo(batch: int, budget: int | None) -> int:
    import os

    import torch

    import bagf_torch
    from bagf_torch import runtime
    from bagf_torch.kernels import implicit_gemm

    if budget is not None:
        os.environ["BAGF_BUDGET"] = str(budget)
    model = bagf_torch.convert(_alexnet_features()).eval()
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"No CUDA GPU here ({why}): nothing to tune. Running AlexNet's conv layers through the ATen "
              "fallback instead.")
        x = torch.randn(batch, 3, 224, 224)
        t0 = time.perf_counter()
        with torch.no_grad():
            y = model(x)
        print(f"CPU forward of N={batch}: output {tuple(y.shape)} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        return 0
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False  # our kernels are strict fp32: compare like with like
    model = model.cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    print(f"Tuning AlexNet's 5 conv layers at N={batch} on {torch.cuda.get_device_name()} "
          "(first call tunes; later calls and processes reuse the cache)...", flush=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    rt = runtime.get()
    print(f"\n{'layer':<32} {'cuDNN us':>9} {'tuned us':>9} {'speedup':>8} {'trials':>7} {'tune s':>7}  plan")
    for r in rt.results:
        plan = "aten (cuDNN)" if r.config is None else implicit_gemm.name(r.config)
        print(f"{r.problem.short():<32} {r.aten_us:9.1f} {r.time_us:9.1f} {r.speedup:7.2f}x "
              f"{r.evaluations:7d} {r.seconds:7.1f}  {plan}")
    if not rt.results:
        print(f"(all {rt.stats['cache_hits']} layers came from the cache in {settings_dir()}: no tuning)")
    print(f"\nfirst forward (tuning included): {first:.1f} s")
    return 0


def cache_command(action: str, path: str | None) -> int:
    from bagf_torch import settings
    from bagf_torch.cache import Cache
    from bagf_torch.kernels import FAMILIES
    from bagf_torch.problem import ConvProblem

    cache = Cache.for_dir(settings.cache_dir())
    try:
        if action == "list":
            plans = cache.plans()
            print(f"{len(plans)} plans in {cache.path}")
            print(f"{'key':<16} {'gpu':<20} {'problem':<44} {'plan':<48} {'us':>9} {'cuDNN us':>9} {'evals':>5}")
            for p in sorted(plans, key=lambda p: p["created"]):
                fam = FAMILIES.get(p["family"])
                plan = "aten (cuDNN)" if p["config"] is None or fam is None else fam.name(p["config"])
                try:
                    problem = ConvProblem.from_dict(p["problem"]).short()
                except (TypeError, KeyError, ValueError):
                    problem = str(p["problem"])[:44]
                print(f"{p['key'][:16]:<16} {str(p['env'].get('gpu', '?'))[:20]:<20} {problem:<44} {plan:<48} "
                      f"{p['time_us']:9.1f} {p['aten_us'] or float('nan'):9.1f} {p['evaluations']:5d}")
        elif action == "export":
            n = cache.export(path)
            print(f"exported {n} plans from {cache.path} to {path}")
        elif action == "import":
            env = _this_machine_env()
            if env is None:
                return 2
            n, skipped = cache.import_(path, env)
            print(f"imported {n} plans from {path} into {cache.path}; skipped {len(skipped)}")
            for line in skipped:
                print(f"  skipped {line}")
        elif action == "clear":
            n = len(cache.plans())
            cache.clear()
            print(f"cleared {cache.path} ({n} plans)")
    finally:
        cache.close()
    return 0


def _this_machine_env() -> dict | None:
    """The environment import validates against; None (with the reason printed) when it cannot be known."""
    import torch

    if not torch.cuda.is_available():
        print("bagf_torch: cache import needs this machine's CUDA GPU to check entries against it "
              "(torch.cuda.is_available() is False); run it on the machine that will use the cache.",
              file=sys.stderr)
        return None
    from bagf_torch.jit.extension import BuildError, environment

    try:
        return environment(torch.cuda.current_device())
    except BuildError as e:
        print(f"bagf_torch: {e}", file=sys.stderr)
        return None


def settings_dir() -> str:
    from bagf_torch import settings

    return str(settings.cache_dir())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bagf_torch", description="bagf_torch: auto-tuned CUDA convs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="tune and run AlexNet's conv layers, print a per-layer table")
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--budget", type=int, default=None, help="evaluations per layer (default BAGF_BUDGET)")
    c = sub.add_parser("cache", help="list, export, import or clear the tuning cache (BAGF_CACHE_DIR)")
    c.add_argument("action", choices=["list", "export", "import", "clear"])
    c.add_argument("file", nargs="?", help="JSON file for export / import")
    args = ap.parse_args(argv)
    if args.cmd == "cache":
        if args.action in ("export", "import") and not args.file:
            ap.error(f"cache {args.action} needs a FILE")
        if args.action == "import" and not os.path.isfile(args.file):
            ap.error(f"no such file: {args.file}")
        return cache_command(args.action, args.file)
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    return demo(args.batch, args.budget)


if __name__ == "__main__":
    sys.exit(main())

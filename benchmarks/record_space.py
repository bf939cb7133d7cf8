"""Record every valid configuration of kernel families on this GPU, for a list of conv problems (needs a GPU).

For each family, its whole valid space (no pruning: implicit_gemm has 3568 valid configurations of 5120) is
compiled ONCE: shapes are run-time arguments, so one cubin serves every problem. Cubins go through the
bagf cache (BAGF_CACHE_DIR), so a second run, or a resumed one, compiles nothing. Then, per problem:
cuDNN is timed once; every configuration is checked against the float64 reference first (CudaChecker),
then timed with CUDA events (CudaBenchmarker.timing: median, p20, p80), or, where one event-timed call takes under
``HOST_PACED_US`` (the host may have paced it: batch-1 layers), by the GPU time of queued calls as the tuner times
such calls (``gpu_timing``; such rows say ``"timing": "queued"``). A configuration whose first timed sample is
already ``--cutoff-factor`` times slower than the best of this problem so far is recorded as status "cutoff" with
that one sample (hopeless configurations cost one sample, not a full timing; never on a host-paced sample). The
family's default configuration is measured first so the cut-off has a sensible reference from the start.

With ``--gpus N`` (N > 1) the run is spread over N GPUs: this process compiles every family's space into the
cubin cache first (``BAGF_COMPILE_WORKERS`` NVRTC threads: give it the machine's cores), then one child process per
GPU records its share of the (problem, family) pairs, balanced by their configuration counts, into its own
``OUT.gpu<i>.json.gz`` (loading the cached cubins, compiling nothing), and the children's rows are merged into OUT.
Compiling is CPU-bound and measuring one GPU's work, so the whole spaces of the tensor-core families (thousands of
cubins each) fit a machine with many cores and GPUs where one GPU would take hours.

Rows are appended to ``OUT.partial.jsonl`` as they are measured; after every (problem, family) the
compressed file OUT (format ``bagf-recorded-space/1``, benchmarks/data/README.md) is rewritten from it.
A run stopped by ``--limit-seconds`` (per problem and family, measuring only) or killed resumes where it
stopped when run again with the same OUT: recorded configurations are skipped. Delete the partial file to
start over.

    BAGF_CACHE_DIR=$PWD/build/bagf_cache python benchmarks/record_space.py \\
        --out benchmarks/data/implicit_gemm_h200.json.gz --limit-seconds 120
    python benchmarks/record_space.py --problems alexnet_conv2_n128 --families implicit_gemm --out /tmp/x.json.gz
    python benchmarks/record_space.py --list
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path


from bagf_torch.kernels import FAMILIES  # noqa: E402
from bagf_torch.kernels.space import config_key  # noqa: E402
from bagf_torch.problem import ConvProblem  # noqa: E402
from bagf_torch.tuning.replay import FORMAT, write_recording  # noqa: E402

# torchvision's AlexNet features: (C, H=W, K, kernel, stride, padding)
_ALEXNET = {"conv1": (3, 224, 64, 11, 4, 2), "conv2": (64, 27, 192, 5, 1, 2), "conv3": (192, 13, 384, 3, 1, 1),
            "conv4": (384, 13, 256, 3, 1, 1), "conv5": (256, 13, 256, 3, 1, 1)}


def _conv(n: int, c: int, hw: int, k: int, ks: int, stride: int, pad: int) -> ConvProblem:
    return ConvProblem(n=n, c=c, h=hw, w=hw, k=k, r=ks, s=ks, stride=(stride, stride), padding=(pad, pad))


PROBLEMS: dict[str, ConvProblem] = {
    **{f"alexnet_{name}_n{n}": _conv(n, *dims) for n in (1, 128) for name, dims in _ALEXNET.items()},
    # a ResNet-style 3x3 at high resolution (stage 2 of ResNet-50 at 224) and a bottleneck's 1x1 reduction
    "conv3x3_256_56_n1": _conv(1, 256, 56, 256, 3, 1, 1),
    "conv1x1_1024to256_14_n32": _conv(32, 1024, 14, 256, 1, 1, 0),
}
"""The default problems: AlexNet's five convolutions at N=1 and N=128, plus two others."""

MORE_PROBLEMS: dict[str, ConvProblem] = {
    **{f"alexnet_{name}_n32": _conv(32, *dims) for name, dims in _ALEXNET.items()},
    "conv3x3_256_56_n32": _conv(32, 256, 56, 256, 3, 1, 1),
    "conv3x3_128_28_n1": _conv(1, 128, 28, 128, 3, 1, 1),
    "conv3x3_128_28_n32": _conv(32, 128, 28, 128, 3, 1, 1),
}
"""Problems recorded only when named in --problems: the other batch size and the ResNet-style layers."""


class Partial:
    """The append-only record of a run: one JSON object per line, flushed as it is written."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[dict] = self.read(path) if path.exists() else []
        self._f = open(path, "a")

    @staticmethod
    def read(path: Path) -> list[dict]:
        lines = []
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill: the row is measured again
                    pass
        return lines

    def add(self, obj: dict) -> None:
        self.lines.append(obj)
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def done_keys(self, problem: str, family: str) -> set:
        return {tuple(x["row"]["config"]) for x in self.lines
                if x["kind"] == "row" and x["problem"] == problem and x["family"] == family}

    def cudnn(self, problem: str) -> dict | None:
        found = [x["cudnn"] for x in self.lines if x["kind"] == "cudnn" and x["problem"] == problem]
        return found[-1] if found else None

    def meta(self) -> dict | None:
        found = [x["meta"] for x in self.lines if x["kind"] == "meta"]
        return found[0] if found else None

    def document(self, families: dict) -> list[dict]:
        """The file's "problems" list from every line so far (problems in recording order)."""
        order: list[str] = []
        by: dict[str, dict] = {}
        for x in self.lines:
            if x["kind"] not in ("row", "cudnn", "status") or x.get("family", next(iter(families))) not in families:
                continue
            name = x["problem"]
            if name not in by:
                order.append(name)
                by[name] = {"name": name, "conv": x["conv"], "cudnn": None, "families": {}}
            p = by[name]
            if x["kind"] == "cudnn":
                p["cudnn"] = x["cudnn"]
                continue
            fam = p["families"].setdefault(x["family"], {
                "knobs": families[x["family"]]["knobs"], "default": families[x["family"]]["default"],
                "raw_size": families[x["family"]]["raw_size"], "valid": families[x["family"]]["valid"],
                "complete": False, "seconds": 0.0, "records": []})
            if "sample" in families[x["family"]]:
                fam["sample"] = families[x["family"]]["sample"]
            if x["kind"] == "row":
                fam["records"].append(x["row"])
            else:
                fam["complete"] = x["complete"]
                fam["seconds"] += x["seconds"]
        for p in by.values():
            for fam in p["families"].values():
                fam["complete"] = fam["complete"] or len(fam["records"]) >= fam["valid"]
        return [by[n] for n in order]


def assign(items: list[tuple[str, str, int]], gpus: int) -> list[list[tuple[str, str]]]:
    """Split (problem, family, configurations) work items over ``gpus`` lists, longest first onto the least loaded
    (LPT scheduling: within 4/3 of the best split's longest list). Ties go to the lowest GPU index."""
    loads = [0] * gpus
    out: list[list[tuple[str, str]]] = [[] for _ in range(gpus)]
    for problem, family, n in sorted(items, key=lambda it: (-it[2], it[0], it[1])):
        i = loads.index(min(loads))
        out[i].append((problem, family))
        loads[i] += n
    return out


def merge_partials(into: Partial, paths: list[Path]) -> int:
    """Append every row, cuDNN timing and status line of the child partial files ``paths`` that ``into`` does not
    hold yet (a resumed merge adds nothing twice); returns how many lines were added."""
    seen = {json.dumps(x, sort_keys=True) for x in into.lines}
    added = 0
    for path in paths:
        if not path.exists():
            continue
        for x in Partial.read(path):
            key = json.dumps(x, sort_keys=True)
            if x.get("kind") in ("row", "cudnn", "status") and key not in seen:
                seen.add(key)
                into.add(x)
                added += 1
    return added


def _child_argv(args, out: Path, family: str, problems: list[str]) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--families", family,
            "--problems", ",".join(problems), "--limit-seconds", str(args.limit_seconds),
            "--cutoff-factor", str(args.cutoff_factor), "--warmup-ms", str(args.warmup_ms), "--rep-ms", str(args.rep_ms),
            "--max-reps", str(args.max_reps), "--seed", str(args.seed)]
    return argv + (["--sample", str(args.sample)] if args.sample else [])


def open_partial(args, dev, **meta_extra) -> tuple[Path, Partial, dict]:
    """OUT, its partial file and the recording's meta (the environment on a first run; a resumed run notes when)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Partial(out.with_name(out.name + ".partial.jsonl"))
    meta = partial.meta()
    if meta is None:
        meta = environment(dev)
        meta["timing"] = {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "max_reps": args.max_reps,
                          "cutoff_factor": args.cutoff_factor, "l2_flush": False}
        meta.update(meta_extra)
        partial.add({"kind": "meta", "meta": meta})
    else:
        meta.setdefault("resumed", []).append(
            datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return out, partial, meta


def family_configs(family, smem: int, problems: list[str], known: dict, args) -> tuple[list, dict]:
    """The configurations of ``family`` to record (its valid space, or ``--sample`` of it) and its entry of the
    file's family info (knobs, default, raw size, valid count, the sample)."""
    space = family.space(smem)
    valid = space.valid_configs()
    rule = getattr(family, "problem_rule", None)
    if rule is not None:  # direct's specialised geometries: only those some recorded problem can run
        valid = [c for c in valid if any(rule(c, known[p]) is None for p in problems)]
    info = {"knobs": list(space.names), "default": [family.DEFAULT[k] for k in space.names],
            "raw_size": space.size, "valid": len(valid)}
    if args.sample and args.sample < len(valid):
        import random

        valid = random.Random(args.seed).sample(valid, args.sample) + [dict(family.DEFAULT)]
        valid = list({config_key(c): c for c in valid}.values())
        info["sample"] = {"size": len(valid), "seed": args.seed}  # "valid" stays the whole space's
    return valid, info


def record_parallel(args, families: list[str], problems: list[str], known: dict) -> int:
    """``--gpus N``: compile here, record on N GPUs in child processes, merge (see the module's docstring)."""
    import os
    import subprocess
    import threading

    import torch

    from bagf_torch import runtime

    if torch.cuda.device_count() < args.gpus:
        print(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    dev = runtime.get().device(0)
    compiler = dev.compiler
    smem = compiler.limits["shared_memory_per_block_optin"]
    out, partial, meta = open_partial(args, dev, gpus=args.gpus)
    fam_info, items = {}, []
    t0 = time.monotonic()
    for fname in families:
        family = FAMILIES[fname]
        valid, fam_info[fname] = family_configs(family, smem, problems, known, args)
        rule = getattr(family, "problem_rule", None)
        applies = getattr(family, "applies", None)
        mine = [p for p in problems if applies is None or applies(known[p]) is None]
        items += [(p, fname, sum(rule is None or rule(c, known[p]) is None for c in valid)) for p in mine]
        t = time.monotonic()
        compiler.prefetch([(family, c) for c in valid])
        print(f"{fname}: {len(valid)} configurations compiled into the cache in {time.monotonic() - t:.0f} s "
              f"({compiler.workers} threads)", flush=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(args.gpus)]
    shares = assign(items, args.gpus)
    children = [out.with_name(f"{out.name.removesuffix('.json.gz')}.gpu{i}.json.gz") for i in range(args.gpus)]
    failed: list[str] = []

    def run_gpu(i: int) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=ids[i])
        with open(children[i].with_name(children[i].name + ".log"), "a") as log:
            for fname in families:
                ps = [p for p, f in shares[i] if f == fname]
                if ps:
                    rc = subprocess.call(_child_argv(args, children[i], fname, ps), env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
                    if rc != 0:
                        failed.append(f"GPU {ids[i]} {fname}: exit {rc}")

    threads = [threading.Thread(target=run_gpu, args=(i,)) for i in range(args.gpus) if shares[i]]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    added = merge_partials(partial, [c.with_name(c.name + ".partial.jsonl") for c in children])
    write_recording(out, meta, partial.document(fam_info))
    print(f"wrote {out} ({FORMAT}): {added} lines merged from {len(threads)} GPUs in {time.monotonic() - t0:.0f} s"
          + (f"; failed: {'; '.join(failed)} (their logs: {out.parent}/*.gpu*.log)" if failed else ""))
    return 1 if failed else 0


def environment(dev) -> dict:
    import torch

    import bagf_torch
    from bagf_torch.jit.extension import load

    props = torch.cuda.get_device_properties(dev.index)
    ext = load()
    try:
        import ax

        ax_version = ax.__version__
    except ImportError:
        ax_version = None
    return {
        "gpu": props.name, "compute_capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
        "versions": {**ext.versions(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), "bagf_torch": bagf_torch.__version__,
                     "python": platform.python_version(), "ax": ax_version},
        "kernel_sources": dev.env.get("kernels"),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "synthetic": False,
    }


def one_sample_us(fn) -> float:
    """One CUDA-event timed call (the check already warmed the kernel up)."""
    import torch

    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


def gpu_timing(bench, fn, first_us: float):
    """The tuner's rule for short calls (``CudaBenchmarker.time``): a call whose event-timed sample ``first_us`` is
    under ``HOST_PACED_US`` may have been paced by the host's issue cost, so it is timed by the GPU time of queued
    calls instead (``CudaBenchmarker.queued_times``: median, p20 and p80 of the rounds, the fastest and slowest
    round under 5 rounds; reps = rounds x calls). None for a longer call, or when the host could queue no round in
    time (then the event timing stands, as in the tuner)."""
    import statistics

    from bagf_torch.tuning.measure import HOST_PACED_US, Timing

    if not first_us < HOST_PACED_US:
        return None
    times, calls = bench.queued_times(fn)
    if not times:
        return None
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0], times[0], times[-1], times[-1]]
    return Timing(statistics.median(times), q[0], q[3], len(times) * calls)


def timing_row(t, queued: bool) -> dict:
    """A recorded timing: median, p20, p80 and reps, with ``"timing": "queued"`` where it is GPU time of queued calls
    (:func:`gpu_timing`) rather than per-call events."""
    row = {"median_us": round(t.median_us, 3), "p20_us": round(t.p20_us, 3), "p80_us": round(t.p80_us, 3),
           "reps": t.reps}
    return {**row, "timing": "queued"} if queued else row


def record_problem(name: str, problem: ConvProblem, family, loaded: list, partial: Partial, args, checker, bench,
                   ws) -> tuple[int, bool, float]:
    """Check and time every compiled configuration of ``family`` on ``problem``; returns (rows written,
    complete, seconds)."""
    import torch

    from bagf_torch.tuning.common import Outcome

    knobs = list(family.space().names)
    conv = problem.as_dict()
    done = partial.done_keys(name, family.FAMILY)
    best = min((x["row"]["median_us"] for x in partial.lines if x["kind"] == "row" and x["problem"] == name
                and x["family"] == family.FAMILY and x["row"]["status"] == "ok"), default=float("inf"))
    t0 = time.monotonic()
    written, complete = 0, True
    flags = dict(enabled=True, benchmark=True, deterministic=False, allow_tf32=problem.tf32)
    rule = getattr(family, "problem_rule", None)
    for config, built in loaded:
        values = [config[k] for k in knobs]
        if tuple(values) in done or (rule is not None and rule(config, problem) is not None):
            continue
        if time.monotonic() - t0 > args.limit_seconds:
            complete = False
            break
        if isinstance(built, Outcome):  # compile or load failure: the same for every problem
            row = {"config": values, "status": built.status, "detail": built.detail[-2000:]}
        else:
            bad = checker.check(ws, built.handle)
            if bad is not None:
                row = {"config": values, "status": bad.status, "detail": bad.detail[-2000:]}
            else:
                fn = ws.op_call(built.handle)
                with torch.backends.cudnn.flags(**flags):
                    fn()
                    first = one_sample_us(fn)
                    # a host-paced first sample is only an upper bound of the GPU time: no cut-off on it
                    queued = gpu_timing(bench, fn, first)
                    if queued is None and first > args.cutoff_factor * best:
                        row = {"config": values, "status": "cutoff", "median_us": round(first, 3), "reps": 1,
                               "detail": f"first sample {first:.1f} us > {args.cutoff_factor} x best {best:.1f} us"}
                    else:
                        t = queued if queued is not None else bench.timing(fn, first)
                        row = {"config": values, "status": "ok", **timing_row(t, queued is not None)}
                        best = min(best, t.median_us)
        partial.add({"kind": "row", "problem": name, "conv": conv, "family": family.FAMILY, "row": row})
        written += 1
        if written % 500 == 0:
            el = time.monotonic() - t0
            print(f"  {name} {family.FAMILY}: {written} configs in {el:.0f} s, best {best:.1f} us", flush=True)
    complete = complete and not args.sample  # a sample is not the whole space
    seconds = time.monotonic() - t0
    partial.add({"kind": "status", "problem": name, "conv": conv, "family": family.FAMILY, "complete": complete,
                 "seconds": round(seconds, 2)})
    return written, complete, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/data/recorded.json.gz",
                    help="output file (.json.gz); OUT.partial.jsonl holds the rows as they are measured")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {sorted(FAMILIES)}")
    ap.add_argument("--problems", default=",".join(PROBLEMS), help="comma-separated names (see --list)")
    ap.add_argument("--limit-seconds", type=float, default=120.0,
                    help="measuring time per problem and family; the rest is left for a resumed run")
    ap.add_argument("--cutoff-factor", type=float, default=3.0,
                    help="a first sample this many times the best so far is recorded as 'cutoff'")
    ap.add_argument("--warmup-ms", type=float, default=1.0)
    ap.add_argument("--rep-ms", type=float, default=5.0, help="timed repetitions per configuration, in ms")
    ap.add_argument("--max-reps", type=int, default=500)
    ap.add_argument("--sample", type=int, default=0,
                    help="record a random sample of this many valid configurations per family (plus the default) "
                         "instead of the whole space; the recording is then partial")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample")
    ap.add_argument("--gpus", type=int, default=1,
                    help="record on this many GPUs at once (compile here, one child process per GPU, merge)")
    ap.add_argument("--list", action="store_true", help="print the known problems and exit")
    args = ap.parse_args(argv)

    if args.list:
        for n, p in {**PROBLEMS, **MORE_PROBLEMS}.items():
            print(f"{n:28s} {p.short() if hasattr(p, 'short') else p}  {p.macs / 1e9:.2f} GMAC")
        return 0
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    problems = [p.strip() for p in args.problems.split(",") if p.strip()]
    known = {**PROBLEMS, **MORE_PROBLEMS}
    unknown = [f for f in families if f not in FAMILIES] + [p for p in problems if p not in known]
    if unknown:
        ap.error(f"unknown families/problems {unknown}; families: {sorted(FAMILIES)}, problems: {list(known)}")

    import torch

    if not torch.cuda.is_available():
        print("record_space.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.gpus > 1:
        if args.sample:  # each child would filter by its own problems before sampling: another sample per GPU
            ap.error("--gpus records whole spaces; --sample runs on one GPU")
        return record_parallel(args, families, problems, known)
    from bagf_torch import runtime
    from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace

    torch.cuda.set_device(0)
    dev = runtime.get().device(0)
    compiler = dev.compiler
    smem = compiler.limits["shared_memory_per_block_optin"]
    checker = CudaChecker(compiler.ext)
    bench = CudaBenchmarker(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=10, max_reps=args.max_reps)
    out, partial, meta = open_partial(args, dev)
    fam_info = {}
    t_all = time.monotonic()
    for fname in families:
        family = FAMILIES[fname]
        valid, fam_info[fname] = family_configs(family, smem, problems, known, args)
        # the default first: a good reference for the cut-off from the start
        order = sorted(valid, key=lambda c: config_key(c) != config_key(family.DEFAULT))
        applies = getattr(family, "applies", None)
        skipped = [p for p in problems if applies is not None and applies(known[p]) is not None]
        if skipped:
            print(f"{fname}: does not apply to {', '.join(skipped)}")
        pending = [p for p in problems if p not in skipped and len(partial.done_keys(p, fname)) < len(valid)]
        if not pending:
            print(f"{fname}: every problem already recorded in {partial.path}")
            continue
        t = time.monotonic()
        loaded = []
        for i in range(0, len(order), 256):
            chunk = order[i:i + 256]
            loaded.extend(zip(chunk, compiler.compile(family, chunk)))
            print(f"{fname}: compiled/loaded {len(loaded)}/{len(order)} in {time.monotonic() - t:.0f} s", flush=True)
        failed = sum(not hasattr(b, "handle") for _, b in loaded)
        print(f"{fname}: {len(order)} configurations ready in {time.monotonic() - t:.0f} s ({failed} failed)")
        try:
            for pname in pending:
                problem = known[pname]
                ws = Workspace(problem, torch.device("cuda", 0), seed=0)
                if partial.cudnn(pname) is None:
                    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False,
                                                    allow_tf32=problem.tf32):
                        call = ws.aten_call()
                        call()
                        tq = gpu_timing(bench, call, one_sample_us(call))
                        tm = tq if tq is not None else CudaBenchmarker().timing(call)
                    partial.add({"kind": "cudnn", "problem": pname, "conv": problem.as_dict(),
                                 "cudnn": timing_row(tm, tq is not None)})
                n, complete, sec = record_problem(pname, problem, family, loaded, partial, args, checker, bench, ws)
                print(f"{pname} {fname}: {n} configurations in {sec:.0f} s{'' if complete else ' (limit hit)'}; "
                      f"cuDNN {partial.cudnn(pname)['median_us']:.1f} us", flush=True)
                write_recording(out, meta, partial.document(fam_info))
                del ws
        finally:
            for _, b in loaded:
                if hasattr(b, "handle"):
                    compiler.unload(b.handle)
    if fam_info:
        write_recording(out, meta, partial.document(fam_info))
    print(f"wrote {out} ({FORMAT}) in {time.monotonic() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

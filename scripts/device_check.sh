#!/usr/bin/env bash
# The whole GPU check in one device call: install the carried Ax wheels, build the extension, run
# `pytest -m cuda`, the compute-sanitizer sweep and the layer benchmark; logs and results under $OUT.
#
#   scripts/device_check.sh [build] [tests] [precision] [bench] [faults] [alexnet] [profile] [sanitize] [bench-args...]
#   (default: build tests bench sanitize)
#   e.g. device run:  bash scripts/device_check.sh tests bench --batch 1,32,128
#   stages: tests = pytest -m cuda; precision = cuDNN's fp32 modes; bench = bench_layers.py (extra arguments go
#   to it); faults = the fault matrix with the noise row; alexnet = `tune --model alexnet`, bench_alexnet.py
#   (torch.compile max-autotune at N=ALEXNET_COMPILE_BATCH, default 1), the roofline report and a cache export -> import into a fresh cache; profile =
#   benchmarks/probes/profile_tc.py (an A/B of a kernel macro at large N, $PROFILE_ARGS) and ncu on two of its kernels
#   (PROFILE_NCU=0: not); ncu = Nsight Compute's full set on one launch of each plan in $NCU_PLANS; contexts =
#   benchmarks/probes/cudnn_contexts.py (cuDNN's time on one layer in several process contexts); sanitize =
#   compute-sanitizer over a sample of each family's space ($SANITIZE_COUNT configurations each, default 64); record = benchmarks/record_space.py with $RECORD_ARGS (e.g.
#   "--families winograd --sample 300 --problems ..."), its recording in $OUT/record.json.gz.
#   wgprofile = benchmarks/probes/profile_winograd_gemm.py (the non-fused Winograd plan's time per launch, $WGPROFILE_ARGS).
#   gemmprobe = benchmarks/probes/gemm_wgmma_probe.py (winograd_gemm's GEMMs alone: wgmma vs mma.sync vs cuBLAS;
#   $GEMMPROBE_ARGS, e.g. "--tag h200").
#   hostfloor = benchmarks/host_floor.py (GPU time vs eager per-call time vs host issue cost; $HOSTFLOOR_ARGS).
#   sweep = benchmarks/probes/family_sweep.py (a family's whole space on layers against cuDNN; $SWEEP_ARGS, e.g.
#   "--family implicit_gemm_wgmma_h16 --dtype bfloat16 --channels-last --tag h200_bf16_nhwc").
#   e2e = benchmarks/bench_alexnet.py with $E2E_ARGS alone (pre-tuning what the cache lacks first), e.g.
#   E2E_ARGS="--tf32 --seconds 7 --no-compile --runs 100 --tag h200_tf32": AlexNet end to end with PyTorch's TF32.
#   smoke = scripts/smoke.py: one launch of $SMOKE_FAMILY's start point ($SMOKE_ARGS: e.g. "--set SK=1,SPLIT=1")
#   within $SMOKE_TIMEOUT s; the call stops if
#   it fails or hangs (run it before the long stages after a kernel change).
#   TESTS_K restricts the tests stage to `pytest -k "$TESTS_K"` (a test with any @pytest.mark decorator, parametrize
#   included, has a `pytestmark` attribute that -k matches: -k tma selects 99 of the 126 GPU tests; write tma_);
#   TESTS_SHARD=k/n runs the k-th of n disjoint parts of it (tests/conftest.py: the whole GPU suite no longer fits
#   one call); TESTS_X replaces its -x (e.g. TESTS_X=-rfE: run on past failures);
#   TESTS_TIMEOUT (default 480 s: the whole suite took 226 s on an H100 with NVRTC's cache warm, 380 s cold, and on a
#   fresh H200 over 530 s for 105 of its 126 tests; at the limit pytest gets SIGINT, so it still prints the failures
#   so far).
#   bench2 = a second bench_layers.py run on GPU 0
#   with $BENCH2_ARGS (e.g. the generalisation layers while bench runs AlexNet on the last GPU).
#   extras16 = bench_layers.py on the ResNet-style layers in bf16 and fp16, channels_last and NCHW (four runs,
#   $EXTRAS16_ARGS added to each, $EXTRAS16_TIMEOUT s each; EXTRAS16_MODES="bf16_nhwc fp16_nhwc": those only;
#   unset, all four). eagerhost = benchmarks/probes/eager_host.py --served (host time per eager forward: the tuning
#   process, fresh stock and served processes; $EAGERHOST_ARGS, default AlexNet bf16 channels_last at N = 1).
#   modtimes = benchmarks/probes/module_times.py
#   ($MODTIMES_ARGS; default AlexNet bf16 channels_last at N = 1). polyphase = benchmarks/probes/polyphase_tma.py
#   (AlexNet's conv1 as a 3x3 implicit GEMM over its polyphase form, in bf16 then fp16; $POLYPHASE_ARGS added to
#   both, e.g. "--batch 32"). plankernels = benchmarks/probes/plan_kernels.py
#   (an NCHW 16-bit plan's kernels beside its channels_last twin's; $PLANKERNELS_RUNS, argument sets split by ';').
#   FAULTS_ARGS: pytest arguments for the fault matrix (e.g. "-n 4", pytest-xdist); FAULTS_ALONGSIDE=1 on one GPU runs
#   the fault matrix in the background beside the tests stage, and every later stage but sanitize waits for it (on
#   2+ GPUs the matrix runs on the last GPU anyway).
#   On a machine with 2+ GPUs: the alexnet tune runs under torchrun, one rank per GPU (multi-GPU
#   pre-tuning), and the faults and bench stages run on the last GPU alongside the GPU-0 stages.
#   Everything the stages write ends up in one archive, $OUT/out.tgz (a device call returns at most 8 files), also
#   when DEADLINE (seconds, default 570) stops the call early.
#   overhead = benchmarks/bench_overhead.py ($OVERHEAD_ARGS); compare = benchmarks/compare_versions.py (an older
#   checkout in $COMPARE_OLD, default .old_main, against this one on the same plans; $COMPARE_ARGS); firstcall = benchmarks/first_call.py ($FIRSTCALL_ARGS,
#   and its --alexnet mode once per budget in $FIRSTCALL_ALEXNET, e.g. "5 25"). build installs the package
#   non-editable (pip install --no-deps --no-build-isolation .) and the tests stage runs the GPU tests against
#   that copy from outside the checkout (BAGF_TEST_INSTALLED=1). budgets = benchmarks/budgets.py (a fast and a slow
#   pre-tuning's plans re-timed side by side; BUDGETS_PAIRS, or BUDGETS_FAST and BUDGETS_SLOW; BUDGETS_ARGS).
#   Every *_ARGS variable is split at whitespace and nothing else: quotes inside it reach the program as characters
#   (write SWEEP_ARGS='... --where SPLIT=1;SK=0,2', not --where "SPLIT=1;SK=0,2"), and no argument can hold a space.
# Needs: on a machine whose Python lacks ax-platform (or tqdm, hypothesis), their wheels in ./.whl, installed into
# /tmp/site at the start: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl
# ax-platform==1.3.1 <each requirement the machine lacks> (unzip -p .whl/NAME-*.whl '*/METADATA' lists them).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bagf_out}
mkdir -p "$OUT"
# A device call returns at most 8 files from $OUT and ends at its time limit (600 s): whatever the stages wrote is
# packed into one archive, $OUT/out.tgz, when the script ends for any reason, and at DEADLINE seconds (default 570) a
# watchdog stops the stage running (TERM to the script's children, then to the script), so that the packing still
# runs inside the call. Unpack it here with: tar xzf out.tgz
DEADLINE=${DEADLINE:-570}
pack() {
  trap '' TERM  # (the watchdog goes on sending TERM to the script's children after the deadline: not to the packing)
  ( cd "$OUT" && files=$(ls -A | grep -vx 'out.tgz') && [ -n "$files" ] && tar czf out.tgz $files && rm -rf $files )
}
trap pack EXIT
trap 'echo "device_check: stopped at the ${DEADLINE} s deadline (DEADLINE)"; exit 124' TERM
script_pid=$$
(
  sleep "$DEADLINE" || exit 0  # (its sleep stopped: the script is ending on its own, see its last line)
  kill -TERM "$script_pid" 2>/dev/null  # (bash runs the trap once the command it waits for returns:)
  for _ in $(seq 120); do  # (until it has ended: gone, or a zombie its parent has not reaped yet)
    state=$(ps -o stat= -p "$script_pid" 2>/dev/null | cut -c1)
    [ -z "$state" ] || [ "$state" = "Z" ] && break
    for child in $(pgrep -P "$script_pid"); do [ "$child" != "$BASHPID" ] && kill -TERM "$child" 2>/dev/null; done
    sleep 1
  done
) &
watchdog=$!
stages=()
bench_args=()
for a in "$@"; do
  case "$a" in build|smoke|tests|sweep|precision|sanitize|bench|bench2|extras16|modtimes|eagerhost|polyphase|faults|alexnet|e2e|profile|ncu|wgprofile|contexts|record|hostfloor|gemmprobe|overhead|compare|firstcall|budgets|plankernels) stages+=("$a") ;; *) bench_args+=("$a") ;; esac
done
[ ${#stages[@]} -eq 0 ] && stages=(build tests bench sanitize)
[ ${#bench_args[@]} -eq 0 ] && bench_args=(--batch 1,32,128)
has() { [[ " ${stages[*]} " == *" $1 "* ]]; }

# An empty entry in PYTHONPATH (a leading, doubled or trailing ':', as `export PYTHONPATH=/tmp/site:$PYTHONPATH`
# leaves when it was unset) is the working directory: the benchmarks run from the checkout would import its bagf_torch
# instead of the installed copy, and build its extension a second time from its csrc. Dropped here.
PYTHONPATH=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep -v '^$' | paste -sd: - || true)
export PYTHONPATH
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || { echo "wheel install failed"; exit 1; }
fi
export BAGF_CACHE_DIR=${BAGF_CACHE_DIR:-/tmp/bagf_cache} BAGF_BUILD_DIR=${BAGF_BUILD_DIR:-$PWD/.bagf_build}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 1)
rc=0
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  python3 -c "import ax; print('ax', ax.__version__)" || echo "ax-platform missing: carry .whl"
} 2>&1 | tee "$OUT/env.txt"

if has build; then
  # As users install it: non-editable, then used from outside the checkout (the image has the dependencies;
  # the machine reaches no index, hence --no-build-isolation --no-deps).
  t0=$(date +%s)
  python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir . 2>&1 | tee "$OUT/build.log" || rc=1
  (cd /tmp && python3 -c "import bagf_torch; from bagf_torch import jit; print('bagf_torch', bagf_torch.__file__); print('extension', jit.load().__file__)") 2>&1 | tee -a "$OUT/build.log" || rc=1
  echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
fi
# The GPU's part of result file names ("h200", "h100": bagf_torch.bench.gpu_tag), as the benchmarks name theirs.
gpu=$( (cd /tmp && python3 -c "from bagf_torch.bench import gpu_tag; print(gpu_tag())") 2>/dev/null || echo gpu)
if has smoke; then
  # one launch of $SMOKE_FAMILY's start point in a child with a time limit: a hung kernel stops the call here.
  # SMOKE_RUNS: several, "family smoke.py-arguments" separated by ';' (e.g. "implicit_gemm_tma_h16 --set
  # SPLIT=4,CR=1; implicit_gemm_tma_tf32 --set SK=2,SPLIT=1"), each with its own limit, in place of SMOKE_FAMILY.
  repo=$PWD
  IFS=';' read -r -a smoke_runs <<< "${SMOKE_RUNS:-${SMOKE_FAMILY:-implicit_gemm_tc} ${SMOKE_ARGS:-}}"
  : > "$OUT/smoke.log"
  for run in "${smoke_runs[@]}"; do
    # shellcheck disable=SC2086  # the run's words: the family, then smoke.py's arguments (e.g. "--set SK=1,SPLIT=1")
    (cd /tmp && timeout -k 10 ${SMOKE_TIMEOUT:-120} python3 "$repo/scripts/smoke.py" $run) 2>&1 \
      | tee -a "$OUT/smoke.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "smoke failed ($run): stopping"; exit 1; }
  done
fi
if has alexnet; then
  t=${ALEXNET_TIMEOUT:-300}
  t0=$(date +%s)
  if [ "$NGPU" -ge 2 ]; then
    tune=(torchrun --standalone --nproc-per-node="$NGPU" -m bagf_torch)
  else
    tune=(python3 -m bagf_torch)
  fi
  echo "alexnet tune: ${tune[*]}" > "$OUT/alexnet.log"
  timeout $t "${tune[@]}" tune --model alexnet --batch 1,32,128 --tf32 off --budget 24 --seconds 8 --no-progress \
    --json "$OUT/tune_alexnet_$gpu.json" >> "$OUT/alexnet.log" 2>&1 || rc=1
  echo "alexnet tune: $(( $(date +%s) - t0 )) s on $NGPU GPU(s)" | tee -a "$OUT/alexnet.log"
fi
run_faults() {
  # shellcheck disable=SC2086  # FAULTS_ARGS is a list of pytest arguments (e.g. "-n 4": pytest-xdist)
  timeout ${FAULTS_TIMEOUT:-300} python3 benchmarks/faults.py --noise --noise-budget 12 --json "$OUT/faults_$gpu.json" \
    -- ${FAULTS_ARGS:-} > "$OUT/faults.log" 2>&1
}
run_bench() {
  timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_layers.py --out "$OUT" "${bench_args[@]}" > "$OUT/bench.log" 2>&1
}
bg_pid="" alongside=""
if [ "$NGPU" -ge 2 ] && { has faults || has bench; }; then
  # faults, then the layer benchmark, on the last GPU, alongside the GPU-0 stages below
  ( export CUDA_VISIBLE_DEVICES=$((NGPU - 1)); bad=0
    if has faults; then BAGF_CACHE_DIR=/tmp/bagf_cache_faults run_faults || bad=1; fi
    if has bench; then BAGF_CACHE_DIR=/tmp/bagf_cache_bench run_bench || bad=1; fi
    exit $bad ) &
  bg_pid=$!
  export CUDA_VISIBLE_DEVICES=0  # everything else on GPU 0
elif has faults && [ -n "${FAULTS_ALONGSIDE:-}" ]; then
  # one GPU: the fault matrix (correctness, not timing) beside the tests stage; the timing stages below wait for it
  ( BAGF_CACHE_DIR=/tmp/bagf_cache_faults run_faults ) &
  bg_pid=$!
  alongside=1
elif has faults; then
  run_faults || rc=1
  tail -n 22 "$OUT/faults.log"
fi
wait_alongside() {  # before a stage that times anything: nothing else may share the GPU
  if [ -n "$alongside" ]; then
    wait "$bg_pid" || rc=1
    tail -n 22 "$OUT/faults.log"
    bg_pid="" alongside=""
  fi
}
if has alexnet; then
  wait_alongside
  export CUDA_VISIBLE_DEVICES=0
  # (one fresh process of each kind, ALEXNET_CHILDREN: this stage's limit has no room for more; e2e times three)
  { timeout $t python3 benchmarks/bench_alexnet.py --batch 1,32,128 --runs 100 --compile-batch ${ALEXNET_COMPILE_BATCH:-1} --children ${ALEXNET_CHILDREN:-1} --out "$OUT" \
    && timeout 120 python3 -m bagf_torch report --plot "$OUT/roofline_alexnet_$gpu.png" \
    && python3 -m bagf_torch cache export /tmp/bagf_export.json \
    && python3 -m bagf_torch cache import /tmp/bagf_export.json --cache /tmp/bagf_cache_imported \
    && python3 -m bagf_torch cache list --cache /tmp/bagf_cache_imported; } >> "$OUT/alexnet.log" 2>&1 || rc=1
  tail -n 60 "$OUT/alexnet.log"
fi
if has e2e; then
  wait_alongside  # (timings beside the fault matrix would time both)
  export CUDA_VISIBLE_DEVICES=0
  # (three fresh processes of each kind, stock and served, per batch size: --children 1 for a quicker run)
  # shellcheck disable=SC2086  # E2E_ARGS is a list of bench_alexnet.py arguments
  timeout ${E2E_TIMEOUT:-540} python3 benchmarks/bench_alexnet.py --out "$OUT" ${E2E_ARGS:-} > "$OUT/e2e.log" 2>&1 || rc=1
  tail -n 30 "$OUT/e2e.log"
fi
if has tests; then
  # against the installed copy, from outside the checkout (conftest refuses the checkout's copy with this set)
  repo=$PWD
  echo "# $(date -u +%FT%TZ), commit ${GIT_COMMIT:-?}," \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1):" \
    "pytest -m cuda -v ${TESTS_X:--x}${TESTS_K:+ -k \"$TESTS_K\"} tests${TESTS_SHARD:+ (part $TESTS_SHARD)}" \
    "(the installed copy, from /tmp)" > "$OUT/pytest_cuda.log"
  # -v: each test's outcome is in the log as it ends, so a run the DEADLINE watchdog stops (TERM: pytest prints no
  # summary) still names its failures; the call's output shows the failures and the summary only
  (cd /tmp && BAGF_TEST_SHARD=${TESTS_SHARD:-} BAGF_TEST_INSTALLED=1 timeout -s INT -k 30 ${TESTS_TIMEOUT:-480} \
    python3 -m pytest -m cuda -v ${TESTS_X:--x} --durations=10 \
    -c "$repo/pytest.ini" --rootdir "$repo" ${TESTS_K:+-k "$TESTS_K"} "$repo/tests") 2>&1 \
    | tee -a "$OUT/pytest_cuda.log" \
    | grep --line-buffered -E "FAILED|ERROR|KeyboardInterrupt|no tests ran|[0-9]+ (passed|failed|errors?|skipped|deselected)"
  status=${PIPESTATUS[0]}
  [ "$status" -eq 0 ] || { echo "pytest: exit $status (124: stopped at TESTS_TIMEOUT)"; rc=1; }
fi
if has sweep; then
  wait_alongside
  timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/probes/family_sweep.py --out "$OUT" ${SWEEP_ARGS:-} \
    > "$OUT/sweep.log" 2>&1 || rc=1
  grep -vE "^    " "$OUT/sweep.log" | tail -n 30
fi
if has gemmprobe; then
  wait_alongside
  # shellcheck disable=SC2086  # GEMMPROBE_ARGS is a list of arguments
  timeout ${GEMMPROBE_TIMEOUT:-240} python3 benchmarks/probes/gemm_wgmma_probe.py --out "$OUT" ${GEMMPROBE_ARGS:-} \
    > "$OUT/gemmprobe.log" 2>&1 || rc=1
  grep -E "^correct|^\| conv" "$OUT/gemmprobe.log"
fi
if has bench2; then
  wait_alongside
  # shellcheck disable=SC2086  # BENCH2_ARGS is a list of arguments
  BAGF_CACHE_DIR=/tmp/bagf_cache_bench2 timeout ${BENCH2_TIMEOUT:-420} python3 benchmarks/bench_layers.py --out "$OUT" \
    ${BENCH2_ARGS:-} > "$OUT/bench2.log" 2>&1 || rc=1
  tail -n 30 "$OUT/bench2.log"
fi
if has extras16; then
  wait_alongside
  for m in ${EXTRAS16_MODES:-}; do
    case "$m" in bf16_nhwc|fp16_nhwc|bf16_nchw|fp16_nchw) ;; *) echo "EXTRAS16_MODES: no mode $m (bf16_nhwc," \
      "fp16_nhwc, bf16_nchw or fp16_nchw, separated by spaces)"; rc=1 ;; esac
  done
  # The ResNet-style layers in each 16-bit dtype and memory format, one bench_layers.py run (and cache) each:
  # bench_layers_extra_<gpu>_{bf16,fp16}_{nhwc,nchw}.{json,md}; EXTRAS16_ARGS adds arguments to every run.
  for combo in "bfloat16 --channels-last:bf16_nhwc" "float16 --channels-last:fp16_nhwc" "bfloat16:bf16_nchw" \
               "float16:fp16_nchw"; do
    tag=${combo##*:}
    case " ${EXTRAS16_MODES:-$tag} " in *" $tag "*) ;; *) continue ;; esac
    # shellcheck disable=SC2086  # the dtype and format words; EXTRAS16_ARGS is a list of arguments
    BAGF_CACHE_DIR=/tmp/bagf_cache_extras16_$tag timeout ${EXTRAS16_TIMEOUT:-110} python3 benchmarks/bench_layers.py \
      --out "$OUT" --dtype ${combo%%:*} --layers r3x3_256,r3x3_128,r1x1_1024 --batch 1,32 --tag "extra_${gpu}_$tag" \
      ${EXTRAS16_ARGS:-} > "$OUT/extras16_$tag.log" 2>&1 || rc=1
    echo "== extras16 $tag"
    grep -E "^Geomean|^\| r[13]x" "$OUT/bench_layers_extra_${gpu}_$tag.md" 2>/dev/null | head -7
  done
fi
if has modtimes; then
  wait_alongside
  # benchmarks/probes/module_times.py: each module's GPU time in CUDA graphs, stock vs bagf ($MODTIMES_ARGS, default
  # AlexNet in bf16 channels_last at N = 1)
  # shellcheck disable=SC2086  # MODTIMES_ARGS is a list of arguments
  BAGF_CACHE_DIR=/tmp/bagf_cache_modtimes timeout ${MODTIMES_TIMEOUT:-150} python3 benchmarks/probes/module_times.py \
    --out "$OUT" ${MODTIMES_ARGS:---dtype bfloat16 --channels-last --batch 1} > "$OUT/modtimes.log" 2>&1 || rc=1
  tail -n 40 "$OUT/modtimes.log"
fi
if has polyphase; then
  wait_alongside
  : > "$OUT/polyphase.log"
  for combo in bfloat16:bf16 float16:fp16; do
    dt=${combo%%:*}
    # shellcheck disable=SC2086  # POLYPHASE_ARGS is a list of arguments
    BAGF_CACHE_DIR=/tmp/bagf_cache_polyphase_$dt timeout ${POLYPHASE_TIMEOUT:-200} python3 \
      benchmarks/probes/polyphase_tma.py --out "$OUT" --dtype $dt ${POLYPHASE_ARGS:-} >> "$OUT/polyphase.log" 2>&1 \
      || rc=1
    echo "== polyphase $dt"
    grep -E "^\| " "$OUT/polyphase_tma_${gpu}_${combo##*:}_nhwc.md" 2>/dev/null | cut -c1-400
  done
fi
if has eagerhost; then
  wait_alongside
  # benchmarks/probes/eager_host.py --served: where an eager forward spends host time, in this process and in fresh
  # stock and served (BAGF_TUNE=0) processes ($EAGERHOST_ARGS, default AlexNet bf16 channels_last at N = 1; it tunes
  # what its cache lacks first)
  # (each fresh process has --child-timeout, 120 s, to report; the files are written before they start and after)
  # (the machine beside it: the host's processor, and every 10 s the processes using the CPUs, in eagerhost_cpu.log:
  # a fresh process's host time is only as good as the cores it gets)
  { lscpu | grep -E '^Model name|^CPU\(s\)|^Thread|MHz'; nproc; } > "$OUT/eagerhost_cpu.log" 2>&1
  # (its output, its sleep's too, goes to the log: nothing of it holds this script's output open after the stage)
  ( while sleep 10; do date +%T; uptime; ps -eo pcpu,pid,etime,args --sort=-pcpu | head -n 6 | cut -c1-160; done ) \
    >> "$OUT/eagerhost_cpu.log" 2>&1 &
  sampler=$!
  # shellcheck disable=SC2086  # EAGERHOST_ARGS is a list of arguments
  BAGF_CACHE_DIR=/tmp/bagf_cache_eagerhost timeout ${EAGERHOST_TIMEOUT:-480} python3 benchmarks/probes/eager_host.py \
    --served --out "$OUT" ${EAGERHOST_ARGS:---dtype bfloat16 --channels-last --batch 1 --runs 100} \
    > "$OUT/eagerhost.log" 2>&1 || rc=1
  pkill -P "$sampler" 2>/dev/null; kill "$sampler" 2>/dev/null  # (its sleep, then the loop)
  head -n 6 "$OUT/eagerhost_cpu.log"
  # the whole forward without hooks, here and in the fresh processes, and what invalidates the latter
  sed -n '/^The whole forward without hooks/,/^Each conv/p; /^Fresh processes/,/^cProfile/p; /^No fresh processes/p' \
    "$OUT/eagerhost.log" | grep -v '^Each conv\|^cProfile'
  tail -n 5 "$OUT/eagerhost.log"
fi
if has plankernels; then
  wait_alongside
  # benchmarks/probes/plan_kernels.py: an NCHW 16-bit plan's kernels beside its channels_last twin's; one run per
  # ';'-separated argument set in $PLANKERNELS_RUNS (default: the N = 32 persistent and N = 1 split-K starts, bf16)
  IFS=';' read -r -a pk_runs <<< "${PLANKERNELS_RUNS:---batch 32 --set WN=128,MI=2,WG=2,STAGES=4,SK=2,SPLIT=1;\
--batch 1 --set WN=64,MI=1,WG=1,STAGES=5,SPLIT=4,CR=1}"
  : > "$OUT/plankernels.log"
  for run in "${pk_runs[@]}"; do
    # shellcheck disable=SC2086  # the run's arguments
    timeout ${PLANKERNELS_TIMEOUT:-120} python3 benchmarks/probes/plan_kernels.py --out "$OUT" $run \
      >> "$OUT/plankernels.log" 2>&1 || rc=1
  done
  grep -E "^\| (r|conv)" "$OUT"/plan_kernels_*.md
fi
if has record; then
  wait_alongside
  # shellcheck disable=SC2086  # RECORD_ARGS is a list of arguments
  # (its results under $OUT, where the call returns them from: record_space.py's own default is benchmarks/data)
  timeout ${RECORD_TIMEOUT:-400} python3 benchmarks/record_space.py --out "$OUT/record.json.gz" ${RECORD_ARGS:-} \
    > "$OUT/record.log" 2>&1 || rc=1
  grep -vE "^  " "$OUT/record.log" | tail -n 40
fi
if has precision; then
  wait_alongside
  timeout 240 python3 benchmarks/probes/cudnn_precision.py --out "$OUT" 2>&1 | tee "$OUT/precision.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
has bench && wait_alongside
if has bench && [ -z "$bg_pid" ]; then
  run_bench || rc=1
  tail -n 40 "$OUT/bench.log"
fi
if has ncu; then
  wait_alongside
  # Nsight Compute, full set, on the first launch of one of our kernels (regex $NCU_KERNEL; cuDNN's kernels in the
  # check do not match) for each plan in $NCU_PLANS ("<family name>@<layer>:<N> ...", a TF32-mode-only family's
  # plan as a TF32 problem): $OUT/ncu_<k>.log per plan (k counts from 1: a device call does not return files
  # whose names hold ':' or '@'), and the headline metrics here.
  k=0
  for plan in ${NCU_PLANS:-}; do
    k=$((k + 1))
    echo "# $plan" > "$OUT/ncu_$k.log"
    # shellcheck disable=SC2086  # NCU_ARGS: more ncu arguments (e.g. "--print-details all": the sections' bodies,
    # such as the stall reasons behind Warp State Statistics, which the default text output leaves out)
    timeout ${NCU_TIMEOUT:-150} ncu --set full --import-source no --launch-count 1 ${NCU_ARGS:-} \
      --kernel-name "regex:${NCU_KERNEL:-^(bagf::)?(implicit_gemm|winograd|direct|gemm_)}" \
      python3 benchmarks/probes/ncu_plan.py --launches 1 "$plan" >> "$OUT/ncu_$k.log" 2>&1 || rc=1
    grep -E "^# |Error|Duration|Compute \(SM\) Throughput|Memory Throughput  |L2 Cache Throughput|DRAM Throughput|Waves Per SM|Issue Slots Busy|Executed Ipc Active|Achieved Occupancy|Registers Per|Stall|stall" \
      "$OUT/ncu_$k.log" | head -40
  done
fi
if has profile; then
  wait_alongside
  # shellcheck disable=SC2086  # PROFILE_ARGS is a list of arguments (e.g. "--macro BAGF_TC_SPLIT --values 0,1,2")
  { timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/probes/profile_tc.py --out "$OUT" ${PROFILE_ARGS:-}
    [ "${PROFILE_NCU:-1}" = 1 ] && timeout 150 ncu --clock-control none --kernel-name regex:implicit_gemm_tc --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 benchmarks/probes/profile_tc.py --ncu alexnet_conv3_n128; } > "$OUT/profile.log" 2>&1 || rc=1
  grep -E "passes=|split=|cuDNN" "$OUT/profile.log" | head -80
fi
if has wgprofile; then
  wait_alongside
  # shellcheck disable=SC2086  # WGPROFILE_ARGS is a list of arguments
  timeout ${WGPROFILE_TIMEOUT:-200} python3 benchmarks/probes/profile_winograd_gemm.py --out "$OUT" ${WGPROFILE_ARGS:-} \
    > "$OUT/wgprofile.log" 2>&1 || rc=1
  tail -n 25 "$OUT/wgprofile.log"
fi
if has hostfloor; then
  wait_alongside
  # shellcheck disable=SC2086  # HOSTFLOOR_ARGS is a list of arguments
  timeout ${HOSTFLOOR_TIMEOUT:-200} python3 benchmarks/host_floor.py --out "$OUT" ${HOSTFLOOR_ARGS:-} \
    > "$OUT/hostfloor.log" 2>&1 || rc=1
  tail -n 15 "$OUT/hostfloor.log"
fi
if has contexts; then
  wait_alongside
  timeout ${CONTEXTS_TIMEOUT:-240} python3 benchmarks/probes/cudnn_contexts.py --json "$OUT/cudnn_contexts_$gpu.json" \
    2>&1 | tee "$OUT/contexts.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if has overhead; then
  wait_alongside
  # overhead = benchmarks/bench_overhead.py: TunedConv2d against stock nn.Conv2d for every plan kind (tuned kernel,
  # cached aten plan, BAGF_TUNE=0 miss, bf16 / channels_last), eager and CUDA graph, N=1,8,32,128 by default;
  # $OVERHEAD_ARGS (e.g. "--batch 1,8 --kinds kernel,miss"). Results: $OUT/bench_overhead_<gpu>.{json,md} (top level);
  # its log goes into out.tgz with the rest.
  # shellcheck disable=SC2086  # OVERHEAD_ARGS is a list of arguments
  timeout ${OVERHEAD_TIMEOUT:-420} python3 benchmarks/bench_overhead.py --out "$OUT" ${OVERHEAD_ARGS:-} \
    > "$OUT/overhead.log" 2>&1 || rc=1
  tail -n 48 "$OUT/overhead.log"
fi
if has compare; then
  wait_alongside
  # compare = benchmarks/compare_versions.py: the same plans under an older checkout ($COMPARE_OLD, e.g. a carried
  # `git archive <commit>` folder) and this one, alternating; $COMPARE_ARGS (default: the AlexNet winners of
  # benchmarks/results/first_call_alexnet_h200_25s.json). Results: $OUT/compare_versions_<gpu>.{json,md} (h200, h100).
  # shellcheck disable=SC2086  # COMPARE_ARGS is a list of arguments
  timeout ${COMPARE_TIMEOUT:-420} python3 benchmarks/compare_versions.py --old "${COMPARE_OLD:-.old_main}" --out "$OUT" \
    ${COMPARE_ARGS:---plans-from benchmarks/results/first_call_alexnet_h200_25s.json} > "$OUT/compare.log" 2>&1 || rc=1
  tail -n 30 "$OUT/compare.log"
fi
if has firstcall; then
  wait_alongside
  # firstcall = benchmarks/first_call.py: the whole first call per grad context against the time budget, the plans
  # re-timed against cuDNN at the end; $FIRSTCALL_ARGS (e.g. "--seconds 10"); FIRSTCALL_ONLY_ALEXNET=1 skips it.
  # Then, with FIRSTCALL_ALEXNET="5 25" (seconds per problem), its --alexnet mode once per value: the tune command's
  # per-problem seconds (FIRSTCALL_ALEXNET_TIMEOUT: seconds per value, default 15 x (1.1 s + 9) + 120;
  # FIRSTCALL_ALEXNET_ARGS: more arguments for it, e.g. "--overshoot-frac 0.2").
  # Then, with FIRSTCALL_MODELS="torchvision:resnet18@32 torchvision:resnet50@32" (model@batches), its --model mode
  # for each, once per value of FIRSTCALL_MODEL_SECONDS (default "default": the library's budget);
  # FIRSTCALL_MODEL_TIMEOUT as above (default 25 x (1.1 s + 9) + 120 per batch size).
  # Results: $OUT/first_call_<gpu>[_<S>s].{json,md} (top level); the --alexnet/--model results and the tune command's
  # output go into $OUT/first_call_models.tgz (a device call returns at most 8 files); the logs with the rest into out.tgz.
  if [ -z "${FIRSTCALL_ONLY_ALEXNET:-}" ]; then
    # shellcheck disable=SC2086  # FIRSTCALL_ARGS is a list of arguments
    timeout ${FIRSTCALL_TIMEOUT:-540} python3 benchmarks/first_call.py --out "$OUT" ${FIRSTCALL_ARGS:-} \
      > "$OUT/firstcall.log" 2>&1 || rc=1
    tail -n 16 "$OUT/firstcall.log"
  fi
  # one model at one budget: model, batches, seconds per problem, problems it has (for the default timeout),
  # the timeout ("" for that default), more arguments
  # A value "default" is the library's budget (no --seconds); a value ending in "even", e.g. "25even", adds --even
  # (every problem the full budget, not by its share of the forward).
  firstcall_model() {
    local m=$1 b=$2 s=$3 problems=$4 ta=$5 log extra=()
    log="$OUT/firstcall_$(echo "${m##*:}_${b}" | tr ',' '_')_$3.log"
    shift 5
    case "$s" in *even) s=${s%even}; extra+=(--even) ;; esac
    [ "$s" = default ] || extra+=(--seconds "$s")
    local sec=$s
    [ "$s" = default ] && sec=$(python3 -c "from bagf_torch import settings; print(settings.budget_seconds())")
    ta=${ta:-$(awk -v s="$sec" -v p="$problems" 'BEGIN { printf "%d", p * (1.1 * s + 9) + 120 }')}
    mkdir -p "$OUT/first_call_models"
    timeout $((ta + 30)) python3 benchmarks/first_call.py --model "$m" --model-batch "$b" ${extra[@]+"${extra[@]}"} \
      --model-timeout "$ta" --out "$OUT/first_call_models" "$@" > "$log" 2>&1 || rc=1
    tail -n 24 "$log"
  }
  for s in ${FIRSTCALL_ALEXNET:-}; do
    # shellcheck disable=SC2086  # FIRSTCALL_ALEXNET_ARGS is a list of arguments
    firstcall_model alexnet 1,32,128 "$s" 15 "${FIRSTCALL_ALEXNET_TIMEOUT:-}" ${FIRSTCALL_ALEXNET_ARGS:-}
  done
  for spec in ${FIRSTCALL_MODELS:-}; do
    b=${spec#*@}
    for s in ${FIRSTCALL_MODEL_SECONDS:-default}; do
      firstcall_model "${spec%@*}" "$b" "$s" $((25 * $(echo "$b" | tr ',' '\n' | wc -l))) "${FIRSTCALL_MODEL_TIMEOUT:-}"
    done
  done
fi
if has budgets; then
  wait_alongside
  # budgets = benchmarks/budgets.py: the plans of a fast and a slow pre-tuning re-timed side by side. BUDGETS_PAIRS,
  # "FAST.json=SLOW.json=TAG ..." (paths as the call sees them; a first_call.py --model result or a tune --json
  # report each), one run per pair; without it, one pair: BUDGETS_FAST (default: this call's `firstcall` --alexnet
  # result of the first value in $FIRSTCALL_ALEXNET) against BUDGETS_SLOW (default
  # benchmarks/results/first_call_alexnet_h200_25s.json), tag alexnet_<gpu>. BUDGETS_ARGS: more arguments for each run.
  # Results: $OUT/budgets_<tag>.{json,md} (top level).
  pairs=${BUDGETS_PAIRS:-}
  if [ -z "$pairs" ]; then
    fast_s=$(echo "${FIRSTCALL_ALEXNET:-}" | awk '{print $1}')
    if [ -n "${BUDGETS_FAST:-}" ] || [ -n "$fast_s" ]; then
      # first_call.py's file name: _<S>s only where S is not the library's default, _even after it
      sfx=""; s=${fast_s%even}
      lib=$(python3 -c "from bagf_torch import settings; print(settings.DEFAULT_TIME_BUDGET)")
      if [ "$s" != default ] && ! awk -v a="$s" -v b="$lib" 'BEGIN { exit !(a == b) }'; then
        sfx="_$(awk -v a="$s" 'BEGIN { printf "%g", a }')s"  # as first_call.py writes it (25.0 -> _25s)
      fi
      [ "$s" != "$fast_s" ] && sfx="${sfx}_even"
      pairs="${BUDGETS_FAST:-$OUT/first_call_models/first_call_alexnet_${gpu}${sfx}.json}=${BUDGETS_SLOW:-benchmarks/results/first_call_alexnet_h200_25s.json}=alexnet_${gpu}"
    fi
  fi
  if [ -z "$pairs" ]; then
    echo "budgets: set BUDGETS_PAIRS or BUDGETS_FAST, or FIRSTCALL_ALEXNET with the firstcall stage" \
      | tee "$OUT/budgets.log"; rc=1
  fi
  for pair in $pairs; do
    IFS== read -r fast slow tag <<< "$pair"
    tag=${tag:-$(basename "${fast%.json}")}
    # shellcheck disable=SC2086  # BUDGETS_ARGS is a list of arguments
    timeout ${BUDGETS_TIMEOUT:-300} python3 benchmarks/budgets.py --fast "$fast" --slow "$slow" --tag "$tag" \
      --out "$OUT" ${BUDGETS_ARGS:-} > "$OUT/budgets_$tag.log" 2>&1 || rc=1
    tail -n 30 "$OUT/budgets_$tag.log"
  done
fi
if [ -d "$OUT/first_call_models" ]; then
  ( cd "$OUT" && tar czf first_call_models.tgz first_call_models && rm -rf first_call_models )
fi
if [ -n "$bg_pid" ]; then
  wait "$bg_pid" || rc=1
  if has faults; then tail -n 22 "$OUT/faults.log"; fi
  if has bench; then tail -n 40 "$OUT/bench.log"; fi
fi
if has sanitize; then
  timeout ${SANITIZE_TIMEOUT:-300} python3 scripts/sanitize_space.py --count ${SANITIZE_COUNT:-64} \
    ${SANITIZE_FAMILIES:+--families "$SANITIZE_FAMILIES"} ${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"} \
    --out "$OUT/sanitize.json" 2>&1 | tail -n 30 | tee "$OUT/sanitize.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
pkill -TERM -P "$watchdog" 2>/dev/null; kill "$watchdog" 2>/dev/null  # (its sleep too: nothing outlives the call)
exit $rc  # (the EXIT trap packs $OUT into out.tgz)

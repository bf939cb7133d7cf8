// bagf_torch host extension: the bagf::conv2d op (CUDA, CPU and Autograd kernels), NVRTC compilation of
// kernel template instantiations, cubin loading and the launch of tuned kernels on the current stream.
//
// The op takes a plan handle (an index into the table of loaded kernels below). The Python side chooses the
// handle once per problem; each call then costs one dispatcher call and one cuLaunchKernel, no Python.
#include <torch/extension.h>
#include <torch/version.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <string>
#include <vector>

#include "cublaslt_plan.h"
#include "kernels/conv_params.h"
#include "nvrtc_compile.h"

namespace {

constexpr int kMaxPlans = 8192;
// A TMA plan's split-K slices launched as one thread block cluster per tile hand their sums over through distributed
// shared memory (kernels/implicit_gemm_tma_h16.cuh, wgt::cluster_reduce): at most 8 slices, the portable cluster
// size.
constexpr int kMaxClusterSplit = 8;
// A polyphase plan's weight kernel (kernels/implicit_gemm_tma_h16.cuh polyphase_weight): at most this many threads
// (1024 blocks of 256), its grid-stride step; the form's weight must stay this far below 2^31 values.
constexpr int64_t kPolyphaseWeightStep = int64_t{1} << 18;

// The launch fields of a plan, as its family's launch(config) gives them: bagf_torch/kernels/geometry.py's
// LaunchGeometry (same names, same defaults) says what this file does with each. Bound to Python below; load_plan
// takes one and checks it.
struct LaunchGeometry {
  int bm = 0;
  int bn = 0;
  int threads = 0;
  int smem = 0;
  int split = 1;
  int tile = 1;
  int tile_w = 0;
  int smem_patch = 0;
  int smem_taps = 0;
  int gemm = 0;
  int layout = 0;
  int fix_s = 0;
  int fix_u = 0;
  int gemm_bm = 0;
  int gemm_bn = 0;
  int gemm_threads = 0;
  int gemm_smem = 0;
  int dtype = 0;  // 0 float32, 1 float16, 2 bfloat16
  int nhwc = 0;   // 1: channels_last input and output, KRSC weight
  int tma = 0;    // 1: the kernel takes TMA maps of x and w (encoded per call) in place of their pointers (16-bit, or
                  // fp32 with TF32 products)
  int stream_k = 0;  // 1: a TMA plan's stream-K launch (one-dimensional grid of resident blocks, launch_plan);
                     // 2: persistent blocks (the same grid, whole tiles per block, no workspace)
  int blas = 0;       // 1: a cuBLASLt plan computing in fp32 (cublaslt_plan.h); 2: in fp32 with TF32 products
  int blas_algo = 0;  // a cuBLASLt plan's entry of the heuristic's list for the call's shape (0-7)
  int blas_ws = 0;    // a cuBLASLt plan's workspace limit in MiB (0-256)
  int split_cluster = 0;  // 1: a TMA plan's split-K slices launched as one cluster per tile (launch_plan)
  int tf32 = 0;  // 1: fp32 with TF32 products; conv2d_cuda sends a call made while cuDNN's TF32 is off to ATen
  int polyphase = 0;  // 1: a TMA plan run on the polyphase form of the call (conv_params.h PolyphaseParams): the
                      // cubin's second and third kernels make the form's input and weight per call (launch_plan)
};

static_assert(sizeof(LaunchGeometry) == 27 * sizeof(int), "LaunchGeometry is its int fields only (no padding)");

// Whether a cuBLASLt plan's geometry leaves every kernel field at its default (it sets only blas, blas_algo, blas_ws,
// dtype, nhwc and tf32).
bool kernel_fields_unset(LaunchGeometry geo) {
  geo.blas = geo.blas_algo = geo.blas_ws = geo.dtype = geo.nhwc = geo.tf32 = 0;
  const LaunchGeometry defaults;
  return std::memcmp(&geo, &defaults, sizeof(LaunchGeometry)) == 0;
}

at::ScalarType plan_dtype(const LaunchGeometry& geo) {
  return geo.dtype == 1 ? at::kHalf : geo.dtype == 2 ? at::kBFloat16 : at::kFloat;
}

at::MemoryFormat plan_format(const LaunchGeometry& geo) {
  return geo.nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

struct Plan {
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  CUfunction gemm_fn = nullptr;  // gemm plans: our own batched GEMM, the cubin's second kernel (nullptr: at::bmm_out)
  // NCHW TMA plans: the input's copy to channels_last, the cubin's second kernel (nullptr, a cubin compiled before
  // it: ATen's copy)
  CUfunction transpose_fn = nullptr;
  // polyphase plans: the form's input (polyphase_gather) and weight (polyphase_weight), the cubin's second and third
  // kernels
  CUfunction gather_fn = nullptr;
  CUfunction weight_fn = nullptr;
  int device = -1;
  LaunchGeometry geo;
  int smem_max = 0;  // the most dynamic shared memory a launch of fn may ask for (the load-time attribute)
  int64_t resident = 0;  // stream-K and persistent plans: blocks the device holds at once (occupancy x SMs, at load)
  bagf_lt::State* blas = nullptr;  // cuBLASLt plans: their GEMMs per shape (no module, no fn); freed by unload_plan
  // non-fused Winograd plans without their own GEMM: the products through cuBLASLt in strict fp32 when torch's flags
  // would make at::bmm_out multiply in TF32 (launch_gemm_plan); freed by unload_plan
  bagf_lt::SgemmCache* sgemm = nullptr;
};

// Fixed table: readers index it without a lock (a slot is published by the release store of g_count after
// it is written, and never changes until unload, which only the tuner calls for its own losers).
std::array<Plan, kMaxPlans> g_plans;
std::atomic<int> g_count{0};
std::mutex g_write_mutex;

// Error messages are built by string concatenation, never with iostreams: on the H200 image (torch 2.11,
// 2026-11-30) any std::ostream formatting inside this extension -- including TORCH_CHECK's and TORCH_WARN's
// multi-argument messages, which go through c10::str -> std::ostringstream -- segfaulted in
// std::basic_ostream::_M_insert<long> (cuda-gdb backtrace, scripts/debug_load.py). So a failed check took
// the whole process down instead of raising. BAGF_CHECK throws std::runtime_error (RuntimeError in Python).
inline void str_append(std::string& s, const std::string& v) { s += v; }
inline void str_append(std::string& s, const char* v) { s += (v ? v : "(null)"); }
inline void str_append(std::string& s, char v) { s += v; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline void str_append(std::string& s, T v) { s += std::to_string(v); }

template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (str_append(s, args), ...);
  return s;
}

#define BAGF_CHECK(cond, ...)                                  \
  do {                                                         \
    if (!(cond)) throw std::runtime_error(cat(__VA_ARGS__));   \
  } while (0)

std::string cu_error(CUresult r) {
  const char* name = nullptr;
  const char* msg = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &msg);
  return std::string(name ? name : "CUDA_ERROR_?") + ": " + (msg ? msg : "unknown");
}

#define BAGF_CU_CHECK(expr)                                                              \
  do {                                                                                   \
    CUresult _r = (expr);                                                                \
    BAGF_CHECK(_r == CUDA_SUCCESS, "bagf_torch: ", #expr, " failed with ", cu_error(_r)); \
  } while (0)

// Make the device's primary context current on this thread: cuModuleLoadData fails with "invalid device
// context" on a thread where the runtime has not touched the device yet.
void make_context_current(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaError_t e = cudaFree(nullptr);
  BAGF_CHECK(e == cudaSuccess, "bagf_torch: cannot initialise CUDA on device ", device, ": ",
              cudaGetErrorString(e));
}

// ---------------------------------------------------------------------------------------------- NVRTC

using bagf_host::split_names;  // (csrc/nvrtc_compile.h: NVRTC itself)

py::dict versions() {
  py::dict d;
  int major = 0, minor = 0;
  nvrtcResult r = nvrtcVersion(&major, &minor);
  d["nvrtc"] = r == NVRTC_SUCCESS ? std::to_string(major) + "." + std::to_string(minor) : std::string("?");
  int drv = 0, rt = 0;
  d["driver"] = cuDriverGetVersion(&drv) == CUDA_SUCCESS ? drv : -1;
  d["runtime"] = cudaRuntimeGetVersion(&rt) == cudaSuccess ? rt : -1;
  return d;
}

py::dict device_limits(int device) {
  make_context_current(device);
  int optin = 0, sms = 0, regs = 0, max_threads = 0;
  CUdevice dev;
  BAGF_CU_CHECK(cuDeviceGet(&dev, device));
  BAGF_CU_CHECK(cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev));
  BAGF_CU_CHECK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
  BAGF_CU_CHECK(cuDeviceGetAttribute(&regs, CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, dev));
  BAGF_CU_CHECK(cuDeviceGetAttribute(&max_threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, dev));
  py::dict d;
  d["shared_memory_per_block_optin"] = optin;
  d["multiprocessors"] = sms;
  d["registers_per_block"] = regs;
  d["max_threads_per_block"] = max_threads;
  return d;
}

// ------------------------------------------------------------------------------------------- loading

// The launch of a split-K cluster plan (LaunchGeometry.split_cluster): grid (gx, gy, split) in clusters of
// (1, 1, split) blocks, the slices of one tile.
CUlaunchConfig cluster_launch(const LaunchGeometry& geo, unsigned gx, unsigned gy, unsigned smem, CUstream stream,
                              CUlaunchAttribute* attr) {
  attr->id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attr->value.clusterDim.x = 1;
  attr->value.clusterDim.y = 1;
  attr->value.clusterDim.z = static_cast<unsigned>(geo.split);
  CUlaunchConfig cfg{};
  cfg.gridDimX = gx;
  cfg.gridDimY = gy;
  cfg.gridDimZ = static_cast<unsigned>(geo.split);
  cfg.blockDimX = static_cast<unsigned>(geo.threads);
  cfg.blockDimY = 1;
  cfg.blockDimZ = 1;
  cfg.sharedMemBytes = smem;
  cfg.hStream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// How many clusters of a split-K cluster plan the device holds at once (0: none fits, so no launch could run).
CUresult max_active_clusters(CUfunction fn, const LaunchGeometry& geo, int smem, int* clusters) {
  CUlaunchAttribute attr;
  const CUlaunchConfig cfg = cluster_launch(geo, 1, 1, static_cast<unsigned>(smem), nullptr, &attr);
  return cuOccupancyMaxActiveClusters(clusters, fn, &cfg);
}

// Load a cubin and register it as a plan. A candidate that cannot be loaded (too many threads for its
// registers, too much shared memory, a bad cubin, the plan table full) is not an exception: the result has
// "error" set and no "handle", and the caller records a typed "resources" failure. (A C++ exception thrown
// from here took the whole process down on the H200 image, 2026-11-30: a 4096-thread candidate segfaulted
// the fault-matrix test instead of raising.)
py::dict load_plan(py::bytes cubin_bytes, const std::string& lowered_name, int device, const LaunchGeometry& geo) {
  std::string cubin = cubin_bytes;
  py::dict d;
  std::string err;
  {
    make_context_current(device);
    std::lock_guard<std::mutex> lock(g_write_mutex);
    const int idx = g_count.load(std::memory_order_relaxed);
    Plan plan;
    plan.device = device;
    plan.geo = geo;
    plan.smem_max = geo.smem;
    const std::vector<std::string> kernels = split_names(lowered_name);
    // a second kernel: an NCHW TMA plan's input copy to channels_last, else a non-fused Winograd plan's GEMM
    const bool own_transpose = kernels.size() == 2 && geo.tma == 1 && geo.nhwc == 0 && geo.gemm == 0 &&
                               geo.polyphase == 0;
    const bool own_gemm = kernels.size() == 2 && !own_transpose;
    const bool per_call_smem = geo.smem_patch > 0 || geo.smem_taps > 0;
    int max_threads = 0, regs = 0, local = 0, static_smem = 0;
    CUresult r = CUDA_SUCCESS;
    if (geo.tf32 < 0 || geo.tf32 > 1 || (geo.tf32 && geo.dtype != 0) ||
        (geo.blas != 0 && geo.tf32 != (geo.blas == 2))) {
      err = cat("tf32=", geo.tf32, " is out of range: 0 or 1, 1 only in a float32 plan (a cuBLASLt plan's is 1 exactly "
                "with blas=2)");
    } else if (geo.blas != 0) {  // no cubin: cuBLASLt's GEMMs, resolved per shape at the first call of each
      std::string why;
      if (geo.blas < 0 || geo.blas > 2 || geo.blas_algo < 0 || geo.blas_algo > 7 || geo.blas_ws < 0 ||
          geo.blas_ws > 256 || geo.dtype < 0 || geo.dtype > 2 || geo.nhwc < 0 || geo.nhwc > 1 ||
          (geo.blas == 2 && geo.dtype != 0) || !kernel_fields_unset(geo) || !cubin.empty()) {
        err = cat("cuBLASLt plan with blas=", geo.blas, ", blas_algo=", geo.blas_algo, ", blas_ws=", geo.blas_ws,
                  ", dtype ", geo.dtype, " is out of range or has kernel fields or a cubin");
      } else if (idx >= kMaxPlans) {
        err = cat("more than ", kMaxPlans,
                  " kernels loaded in one process; set a smaller tuning budget or restart the process");
      } else if (bagf_lt::handle(device, why) == nullptr) {
        err = cat("cuBLASLt plan: ", why);
      } else {
        plan.blas = new bagf_lt::State();
        plan.blas->dtype = geo.dtype;
        plan.blas->nhwc = geo.nhwc != 0;
        plan.blas->tf32 = geo.blas == 2;
        plan.blas->algo = geo.blas_algo;
        plan.blas->max_workspace = static_cast<size_t>(geo.blas_ws) << 20;
        const char* filled = std::getenv("BAGF_TEST_CUBLASLT_FILLED_BIAS");  // (tests: run the filled-D path)
        plan.blas->filled_bias_only = filled != nullptr && std::string(filled) == "1";
        d["registers"] = 0;
        d["local_bytes"] = 0;
        d["max_threads"] = 0;
        d["static_smem"] = 0;
      }
    } else if (geo.split < 1 || geo.split > 65535) {
      err = cat("split-K of ", geo.split, " slices is out of range");
    } else if (geo.tile < 1 || geo.tile > (geo.tile_w > 0 ? 64 : 8) || geo.tile_w < 0 || geo.tile_w > 256) {
      err = cat("output tile of ", geo.tile, "x", geo.tile_w, " is out of range");
    } else if (geo.gemm < 0 || geo.gemm > 1 || geo.layout < 0 || geo.layout > 15 ||
               (geo.gemm == 1 && (geo.tile < 2 || geo.tile == 3 || geo.tile > 6)) ||
               ((geo.layout & 4) && !own_gemm) || ((geo.layout & 8) && (geo.layout & 2))) {
      err = cat("non-fused Winograd plan with gemm=", geo.gemm, ", layout=", geo.layout, ", tile=", geo.tile,
                " is out of range");
    } else if (geo.fix_s < 0 || geo.fix_u < 0 || (geo.fix_s > 0) != (geo.fix_u > 0)) {
      err = cat("specialised filter width ", geo.fix_s, " and stride ", geo.fix_u, " must both be positive or both 0");
    } else if (geo.polyphase < 0 || geo.polyphase > 1 ||
               (geo.polyphase && (geo.tma != 1 || geo.dtype == 0 || geo.gemm != 0 || kernels.size() != 3))) {
      err = cat("polyphase=", geo.polyphase, " is out of range: 0, or 1 in a 16-bit TMA implicit GEMM whose cubin "
                "holds its gather and weight kernels after it (3 kernels; got ", kernels.size(), ")");
    } else if ((kernels.size() > 2 && !geo.polyphase) ||
               (own_gemm && (geo.gemm != 1 || (geo.layout & 3) != 0 || geo.gemm_bm < 16 || geo.gemm_bn < 16 ||
                             geo.gemm_threads < 32 || geo.gemm_smem < 0))) {
      err = cat("a plan's second kernel is an NCHW TMA plan's input copy or a non-fused Winograd plan's GEMM with "
                "layout 0 and a positive tile; got ",
                kernels.size(), " kernels, gemm=", geo.gemm, ", layout=", geo.layout, ", tile ", geo.gemm_bm, "x",
                geo.gemm_bn, ", ", geo.gemm_threads, " threads");
    } else if (geo.dtype < 0 || geo.dtype > 2 || geo.nhwc < 0 || geo.nhwc > 1 ||
               ((geo.dtype != 0 || geo.nhwc != 0 || geo.tma != 0) &&
                ((geo.split != 1 && ((geo.dtype == 0 && !geo.tma) || geo.gemm != 0)) || geo.tile_w != 0 || geo.smem_patch != 0 ||
                 geo.smem_taps != 0 || (geo.gemm == 0 && geo.tile != 1) || (geo.nhwc && (geo.layout & 8)))) ||
               geo.tma < 0 || geo.tma > 1 || geo.stream_k < 0 || geo.stream_k > 2 ||
               (geo.stream_k && (!geo.tma || geo.split != 1)) ||
               (geo.tma && (geo.gemm != 0 || geo.bn < 1 || geo.bn > 256 ||
                            geo.bm < 1 || geo.bm > 256)) ||
               geo.split_cluster < 0 || geo.split_cluster > 1 ||
               (geo.split_cluster && (!geo.tma || geo.stream_k || geo.split < 2 || geo.split > kMaxClusterSplit ||
                                      4ll * geo.bm * geo.bn > geo.smem - 1024ll))) {
      err = cat("dtype ", geo.dtype, " and nhwc ", geo.nhwc, " out of range, or a 16-bit or channels_last plan that is "
                "neither one implicit-GEMM launch nor a non-fused Winograd plan (split-K only in a 16-bit or TMA implicit "
                "GEMM; staged outputs NCHW only; TMA maps only in an implicit GEMM of tiles of at most 256 x 256; "
                "stream-K and persistent blocks only in a TMA plan without split-K; split-K in clusters only in a "
                "TMA plan of 2 to ",
                kMaxClusterSplit, " slices whose ring holds a tile's fp32 sums)");
    } else if (geo.smem_patch < 0 || geo.smem_taps < 0) {
      err = cat("negative shared-memory coefficients ", geo.smem_patch, ", ", geo.smem_taps);
    } else if (idx >= kMaxPlans) {
      err = cat("more than ", kMaxPlans,
                " kernels loaded in one process; set a smaller tuning budget or restart the process");
    } else if ((r = cuModuleLoadData(&plan.module, cubin.data())) != CUDA_SUCCESS) {
      plan.module = nullptr;
      err = cat("cuModuleLoadData failed for ", lowered_name, ": ", cu_error(r));
    } else if ((r = cuModuleGetFunction(&plan.fn, plan.module, kernels[0].c_str())) != CUDA_SUCCESS) {
      err = cat("kernel ", kernels[0], " not found in its cubin: ", cu_error(r));
    } else if ((own_gemm || own_transpose) &&
               (r = cuModuleGetFunction(own_gemm ? &plan.gemm_fn : &plan.transpose_fn, plan.module,
                                        kernels[1].c_str())) != CUDA_SUCCESS) {
      err = cat("kernel ", kernels[1], " not found in its cubin: ", cu_error(r));
    } else if (geo.polyphase && ((r = cuModuleGetFunction(&plan.gather_fn, plan.module, kernels[1].c_str())) !=
                                     CUDA_SUCCESS ||
                                 (r = cuModuleGetFunction(&plan.weight_fn, plan.module, kernels[2].c_str())) !=
                                     CUDA_SUCCESS)) {
      err = cat("kernel ", kernels[plan.gather_fn == nullptr ? 1 : 2], " not found in its cubin: ", cu_error(r));
    } else {
      cuFuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, plan.fn);
      cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, plan.fn);
      cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, plan.fn);
      cuFuncGetAttribute(&static_smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, plan.fn);
      if (per_call_smem) {  // the problem decides the size: allow what the device allows, check each call
        CUdevice dev;
        int optin = 0;
        if (cuDeviceGet(&dev, device) == CUDA_SUCCESS &&
            cuDeviceGetAttribute(&optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev) == CUDA_SUCCESS)
          plan.smem_max = optin - static_smem;
      }
      if (max_threads < geo.threads) {
        err = cat("out of resources: ", lowered_name, " needs ", geo.threads, " threads per block but uses ", regs,
                  " registers per thread, so at most ", max_threads,
                  " threads fit. Smaller register tiles or fewer threads may help.");
      } else if ((r = cuFuncSetAttribute(plan.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         plan.smem_max)) != CUDA_SUCCESS) {
        err = cat("out of resources: ", lowered_name, " asks for ", plan.smem_max, " bytes of dynamic shared memory: ",
                  cu_error(r), ". Smaller BM/BN/BK may help.");
      } else if (geo.stream_k) {
        // stream-K's grid: the blocks the device holds at once, with this kernel's registers and shared memory
        CUdevice dev;
        int sms = 0, per_sm = 0;
        if ((r = cuDeviceGet(&dev, device)) != CUDA_SUCCESS ||
            (r = cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)) != CUDA_SUCCESS ||
            (r = cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, plan.fn, geo.threads,
                                                             static_cast<size_t>(plan.smem_max))) != CUDA_SUCCESS) {
          err = cat("stream-K or persistent plan ", lowered_name, ": the occupancy query failed: ", cu_error(r));
        } else if (per_sm < 1) {
          err = cat("out of resources: ", lowered_name, " fits no block on an SM (", geo.threads, " threads, ",
                    plan.smem_max, " bytes of shared memory)");
        } else {
          plan.resident = static_cast<int64_t>(sms) * per_sm;
        }
      } else if (geo.split_cluster) {
        // a cluster of `split` blocks must fit the device at once (its blocks share a GPC), or every launch would fail
        int clusters = 0;
        if ((r = max_active_clusters(plan.fn, geo, plan.smem_max, &clusters)) != CUDA_SUCCESS) {
          err = cat("split-K cluster plan ", lowered_name, ": the cluster occupancy query failed: ", cu_error(r));
        } else if (clusters < 1) {
          err = cat("out of resources: ", lowered_name, " fits no cluster of ", geo.split, " blocks (", geo.threads,
                    " threads, ", plan.smem_max, " bytes of shared memory each)");
        }
      } else if (own_gemm) {
        int gemm_max_threads = 0, gemm_regs = 0;
        cuFuncGetAttribute(&gemm_max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, plan.gemm_fn);
        cuFuncGetAttribute(&gemm_regs, CU_FUNC_ATTRIBUTE_NUM_REGS, plan.gemm_fn);
        if (gemm_max_threads < geo.gemm_threads) {
          err = cat("out of resources: ", kernels[1], " needs ", geo.gemm_threads, " threads per block but uses ",
                    gemm_regs, " registers per thread, so at most ", gemm_max_threads, " threads fit.");
        } else if ((r = cuFuncSetAttribute(plan.gemm_fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           geo.gemm_smem)) != CUDA_SUCCESS) {
          err = cat("out of resources: ", kernels[1], " asks for ", geo.gemm_smem, " bytes of dynamic shared memory: ",
                    cu_error(r), ". A smaller GEMM tile may help.");
        }
        regs = std::max(regs, gemm_regs);
      }
    }
    if (!err.empty()) {
      if (plan.module != nullptr) cuModuleUnload(plan.module);
    } else {
      // (BAGF_TEST_WINOGRAD_BMM, set when the plan is loaded: no cuBLASLt GEMM, so that a GPU test runs at::bmm_out's)
      if (geo.gemm == 1 && plan.gemm_fn == nullptr && std::getenv("BAGF_TEST_WINOGRAD_BMM") == nullptr)
        plan.sgemm = new bagf_lt::SgemmCache();
      g_plans[idx] = plan;
      g_count.store(idx + 1, std::memory_order_release);
    }
    if (err.empty()) d["handle"] = idx;
    if (max_threads > 0) {
      d["registers"] = regs;
      d["local_bytes"] = local;
      d["max_threads"] = max_threads;
      d["static_smem"] = static_smem;
    }
  }
  if (!err.empty()) d["error"] = "bagf_torch: " + err;
  return d;
}

void unload_plan(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_write_mutex);
  BAGF_CHECK(handle >= 0 && handle < g_count.load(), "bagf_torch: no plan with handle ", handle);
  Plan& p = g_plans[handle];
  if (p.module != nullptr) {
    make_context_current(p.device);
    cuModuleUnload(p.module);
  }
  delete p.blas;
  delete p.sgemm;
  p = Plan();
}

// -------------------------------------------------------------------------------------------- the op

int64_t out_extent(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
  return (in + 2 * pad - dil * (k - 1) - 1) / stride + 1;
}

// Strides and dilations of at least 1, paddings of at least 0, each an int (the kernels' Conv2dParams): what
// out_extent (a division by the stride) and every plan assume; anything else is ATen's to take or refuse.
bool valid_geometry(at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  for (int i = 0; i < 2; ++i)
    if (stride[i] < 1 || dilation[i] < 1 || padding[i] < 0 || stride[i] > INT_MAX || dilation[i] > INT_MAX ||
        padding[i] > INT_MAX)
      return false;
  return true;
}

// Dynamic shared memory of one launch: the plan's fixed size, or for a direct plan the size its tile's input
// patch and filters need on this call's geometry (the kernel lays its buffers out with the same halo_patch).
int64_t launch_smem(const Plan& plan, int64_t R, int64_t S, at::IntArrayRef stride, at::IntArrayRef dilation) {
  const LaunchGeometry& geo = plan.geo;
  if (geo.smem_patch == 0 && geo.smem_taps == 0) return geo.smem;
  bagf::Conv2dParams g{};
  g.R = static_cast<int>(R);
  g.S = static_cast<int>(S);
  g.stride_h = static_cast<int>(stride[0]);
  g.stride_w = static_cast<int>(stride[1]);
  g.dil_h = static_cast<int>(dilation[0]);
  g.dil_w = static_cast<int>(dilation[1]);
  const bagf::HaloPatch h = bagf::halo_patch(geo.tile, geo.tile_w, g);
  return static_cast<int64_t>(geo.smem_patch) * h.rows * h.pitch + static_cast<int64_t>(geo.smem_taps) * R * S;
}

// Whether cuDNN may compute fp32 convolutions in TF32 now: bagf_torch.problem.cudnn_tf32 read in C++ (the legacy
// torch.backends.cudnn.allow_tf32 or cudnn.conv.fp32_precision; the same answer in every state:
// tests/test_extension_source.py compiles this function against the installed torch and compares). Asked without
// the op, torch 2.9 and later raise where the conv's and the RNN's settings differ.
inline bool cudnn_conv_tf32() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  return at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
#elif TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 9
  return at::globalContext().allowTF32CuDNN("conv");
#else
  return at::globalContext().allowTF32CuDNN();  // (one cuDNN flag before torch 2.9)
#endif
}

// ATen's answer in the op's memory format (bagf_torch/ops.py's fake says the same): channels_last for a channels_last
// input that is not also contiguous, else contiguous -- what the kernels write. at::conv2d may pick the other one
// (a channels_last weight with a contiguous input): then a copy, on fallback paths only.
at::Tensor aten_conv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                     at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  at::Tensor y = at::conv2d(x, w, b, stride, padding, dilation, 1);
  const at::MemoryFormat fmt = x.dim() == 4 && y.dim() == 4 && !x.is_contiguous() &&
                                       x.is_contiguous(at::MemoryFormat::ChannelsLast)
                                   ? at::MemoryFormat::ChannelsLast
                                   : at::MemoryFormat::Contiguous;
  return y.is_contiguous(fmt) ? y : y.contiguous(fmt);
}

// Whether torch's flags make its fp32 matmuls (at::bmm_out) use TF32 products.
bool matmul_tf32() {
  return at::globalContext().allowTF32CuBLAS() ||
         at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST;
}

// A non-fused Winograd plan's batched products: E = (m + 2)^2 points of F(m x m), T tiles of m x m outputs over the N
// images' P x Q, K output channels, C = the input's channels times s^2 (its s x s polyphase components at stride s).
struct WinogradDims {
  int64_t E, T, K, C;
};

WinogradDims winograd_dims(const LaunchGeometry& geo, int64_t N, int64_t P, int64_t Q, int64_t K, int64_t C,
                           int64_t s) {
  const int64_t mt = geo.tile;
  return {(mt + 2) * (mt + 2), N * ((P + mt - 1) / mt) * ((Q + mt - 1) / mt), K, C * s * s};
}

// Those products as cuBLASLt's row-major strided batch (what launch_gemm_plan's at::bmm_out calls compute), in the
// plan's workspace layouts; aligned as the batch strides allow (the workspaces are fresh allocations: 256-byte bases).
bagf_lt::SgemmShape winograd_sgemm_shape(const LaunchGeometry& geo, const WinogradDims& d) {
  const bool v_tc = geo.layout & 1, m_tk = geo.layout & 2;
  bagf_lt::SgemmShape shape;
  shape.batch = d.E;
  shape.m = m_tk ? d.T : d.K;
  shape.n = m_tk ? d.K : d.T;
  shape.k = d.C;
  shape.ta = m_tk && !v_tc;  // op(A): V^T (V stored [C][T]) where M is [T][K], else U or V as stored
  shape.tb = m_tk || v_tc;   // op(B): U^T (U stored [K][C]) where M is [T][K], V^T (stored [T][C]) else
  shape.align = std::min({256u, bagf_lt::alignment(static_cast<uintptr_t>(4 * shape.m * shape.k)),
                          bagf_lt::alignment(static_cast<uintptr_t>(4 * shape.k * shape.n)),
                          bagf_lt::alignment(static_cast<uintptr_t>(4 * shape.m * shape.n))});
  return shape;
}

// The cuBLASLt GEMM a non-fused Winograd plan without its own GEMM runs its products with for ``dims`` on
// ``device`` (resolved at the first call of each shape), or nullptr (``why`` set) where cuBLASLt cannot be loaded or
// has no fp32 algorithm for the shape: then at::bmm_out's cuBLAS SGEMM, which follows torch's TF32 flags and costs
// ATen's dispatch and the operands' views on the host.
const bagf_lt::Sgemm* winograd_lt_gemm(const Plan& plan, const WinogradDims& dims, int device, bagf_lt::Handle& h,
                                       std::string& why) {
  h = plan.sgemm != nullptr ? bagf_lt::handle(device, why) : nullptr;
  if (h == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(plan.sgemm->mutex);
  return bagf_lt::resolve_sgemm(*plan.sgemm, h, winograd_sgemm_shape(plan.geo, dims), why);
}

// The split-K workspace of a call (launch_plan's grid) for a plan whose slices hand their sums over in order (16-bit
// and TMA plans, kernels/implicit_gemm_h16.cuh's protocol): each slice's fp32 sums of each BM x BN tile, then one
// arrival counter per tile; 0 for other plans (other fp32 split-K plans add atomically into a zeroed output; a split-K
// cluster plan's slices hand over in shared memory).
int64_t split_workspace_floats(const LaunchGeometry& geo, int64_t cols, int64_t k) {
  if (geo.split <= 1 || (geo.dtype == 0 && !geo.tma) || geo.split_cluster) return 0;  // (a cluster's: none)
  const int64_t tiles = ((cols + geo.bn - 1) / geo.bn) * ((k + geo.bm - 1) / geo.bm);
  return tiles * geo.split * geo.bm * geo.bn + tiles;
}
constexpr int64_t kMaxSplitWorkspaceFloats = int64_t{1} << 28;  // 1 GiB
// A stream-K launch gives each block at least this many k tiles (fewer blocks where a problem has few):
// bagf_torch/kernels/implicit_gemm_tma_h16.py STREAM_K_MIN_ITERS.
constexpr int64_t kStreamKMinIters = 8;

// Stream-K's work (kernels/implicit_gemm_tma_h16.cuh, SK = 1): all `tiles` output tiles' k tiles, R S blocks of 32 fp32
// or 64 16-bit channels each. unsupported_reason bounds it (the kernel counts it in 32 bits); launch_plan shares it.
int64_t stream_k_work(const LaunchGeometry& geo, int64_t tiles, int64_t R, int64_t S, int64_t C) {
  const int64_t bk = geo.dtype == 0 ? 32 : 64;
  return tiles * R * S * ((C + bk - 1) / bk);
}

// Why the tuned kernel cannot take this call, or nullptr. The Python module checks the same things first
// (and logs them); this guards direct callers of the op, who get ATen's answer instead of a wrong one.
const char* unsupported_reason(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                               at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                               const Plan& plan) {
  const LaunchGeometry& geo = plan.geo;
  if (!x.is_cuda() || !w.is_cuda() || x.device() != w.device()) return "tensors not on one CUDA device";
  if (x.get_device() != plan.device) return "plan compiled for another device";
  const at::ScalarType dt = plan_dtype(geo);
  if (x.scalar_type() != dt || w.scalar_type() != dt)
    return dt == at::kFloat  ? "dtype is not float32 (the plan's)"
           : dt == at::kHalf ? "dtype is not float16 (the plan's)"
                             : "dtype is not bfloat16 (the plan's)";
  if (x.dim() != 4 || w.dim() != 4 || x.size(1) != w.size(1)) return "not an NCHW/KCRS groups=1 conv";
  // the output's extents (both callers checked the geometry first; <= 0 when the filter is larger than the padded
  // input, which conv2d_cuda reports itself)
  const int64_t P = out_extent(x.size(2), w.size(2), stride[0], padding[0], dilation[0]);
  const int64_t Q = out_extent(x.size(3), w.size(3), stride[1], padding[1], dilation[1]);
  if (!x.is_contiguous(plan_format(geo)) || (geo.nhwc && x.is_contiguous()))
    // (an input both contiguous and channels_last, C = 1 or H = W = 1, is NCHW to every rule here: the output's
    // format, the fake's, TunedConv2d's key)
    return geo.nhwc ? "input is not channels_last only (the plan's memory format)" : "input is not contiguous NCHW";
  // fp32 and NCHW 16-bit plans read the weight contiguous (KCRS); a channels_last plan and every TMA plan read it
  // KRSC, and the host converts one in another format
  if (!w.is_contiguous() && !geo.nhwc && !geo.tma) return "weight not contiguous NCHW";
  if (x.numel() > INT_MAX || w.numel() > INT_MAX) return "tensor too large for 32-bit indexing";
  if (geo.blas) {  // one GEMM over the pixels: the weight read as [K][C]
    if (w.size(2) != 1 || w.size(3) != 1 || stride[0] != 1 || stride[1] != 1 || padding[0] != 0 || padding[1] != 0)
      return "a cuBLASLt plan takes 1x1 convolutions at stride 1 without padding";
    if (!w.is_contiguous() && !w.is_contiguous(at::MemoryFormat::ChannelsLast))
      return "weight is not a dense 1x1 filter (contiguous or channels_last)";
  }
  if (geo.tile > 1 && geo.tile_w == 0 && geo.gemm == 1) {
    // the non-fused plan also takes stride s > 1 with R, S <= 3s, as 3x3 over the s x s polyphase components
    const int64_t s = stride[0];
    if (stride[1] != s || dilation[0] != 1 || dilation[1] != 1 || s < 1 || s > 8 ||
        (s == 1 ? (w.size(2) != 3 || w.size(3) != 3) : (w.size(2) > 3 * s || w.size(3) > 3 * s)))
      return "a non-fused Winograd plan takes dilation-1 convolutions with 3x3 filters at stride 1, or equal strides "
             "s of 2 to 8 with filters of at most 3s x 3s";
  } else if (geo.tile > 1 && geo.tile_w == 0 &&
             (w.size(2) != 3 || w.size(3) != 3 || stride[0] != 1 || stride[1] != 1 || dilation[0] != 1 ||
              dilation[1] != 1)) {
    return "a Winograd plan takes only 3x3 stride-1 dilation-1 convolutions";
  }
  if (geo.dtype != 0 || geo.nhwc || geo.tma) {  // the 16-bit and TMA kernels' int32 window arithmetic
    for (int i = 0; i < 2; ++i)
      if (stride[i] > 65535 || dilation[i] > 65535 || padding[i] > 65535)
        return "stride, padding or dilation above 65535 for a 16-bit, channels_last or TMA plan";
  }
  if (geo.tma && P > 0 && Q > 0 &&
      (x.size(0) * P * Q + geo.bn > INT_MAX || (x.size(0) * P * Q + geo.bn) * w.size(0) > INT_MAX))
    return "the output's pixels pass the TMA kernel's 32-bit tile and output offsets";  // (the problem rule's bound)
  // The problem the kernel's maps describe: the call's, or a polyphase plan's form of it (launch_plan), whose input
  // and weight are fresh allocations (aligned) of Cp channels, stride 1, no padding.
  int64_t kc = x.size(1), kh = x.size(2), kw = x.size(3), kr = w.size(2), ks = w.size(3);
  int64_t kstride[2] = {stride[0], stride[1]}, kpad[2] = {padding[0], padding[1]}, kdil[2] = {dilation[0], dilation[1]};
  if (geo.polyphase) {
    if (dilation[0] != 1 || dilation[1] != 1 || stride[0] < 1 || stride[1] < 1 || stride[0] > 8 || stride[1] > 8 ||
        (stride[0] == 1 && stride[1] == 1) || kc >= 64)
      return "a polyphase plan takes dilation-1 convolutions of fewer than 64 channels at strides of 1 to 8, not "
             "both 1";
    if (P > 0 && Q > 0) {
      const int64_t rp = (kr + stride[0] - 1) / stride[0], sp = (ks + stride[1] - 1) / stride[1];
      const int64_t cp = (stride[0] * stride[1] * kc + 7) / 8 * 8;
      kh = P + rp - 1;
      kw = Q + sp - 1;
      // (the weight kernel's grid-stride index passes its last value by up to 2^18: polyphase_weight)
      if (kh > 65535 || x.size(0) * kh * kw * cp > INT_MAX ||
          w.size(0) * rp * sp * cp > INT_MAX - kPolyphaseWeightStep)
        return "the polyphase form of this call passes 65535 rows or 32-bit indexing";
      for (int i = 0; i < 4; ++i)  // (the weight kernel reads it through 32-bit strides)
        if (w.stride(i) < 0 || w.stride(i) > INT_MAX)
          return "the weight's strides pass 32 bits (a view into a larger tensor): a polyphase plan reads it by them";
      kc = cp, kr = rp, ks = sp;
      kstride[0] = kstride[1] = kdil[0] = kdil[1] = 1;
      kpad[0] = kpad[1] = 0;
    }
  }
  if (geo.tma) {  // what the TMA maps can describe (encode_tma_maps): the hardware's ranges, 16-byte strides and bases
    // (an input or weight not already channels_last is copied first: a fresh allocation, aligned; an NCHW input
    // with H = W = 1 is channels_last as it is, and read in place)
    const bool x_direct = !geo.polyphase && (geo.nhwc != 0 || x.is_contiguous(at::MemoryFormat::ChannelsLast));
    const bool w_direct = !geo.polyphase && w.is_contiguous(at::MemoryFormat::ChannelsLast);
    if (kc % (16 / x.element_size()) != 0)
      return "a TMA plan reads channels 16 bytes at a time; C is not a multiple of 8 (16-bit) or 4 (fp32)";
    if ((x_direct && (reinterpret_cast<uintptr_t>(x.const_data_ptr()) & 15) != 0) ||
        (w_direct && (reinterpret_cast<uintptr_t>(w.const_data_ptr()) & 15) != 0))
      return "input or weight is not 16-byte aligned (a TMA plan's maps need it)";
    for (int i = 0; i < 2; ++i) {
      const int64_t extent = i == 0 ? kh : kw, out = i == 0 ? P : Q;
      const int64_t upper = (out - 1) * kstride[i] + 1 - extent - kpad[i];
      if (kstride[i] > 8 || kpad[i] > 128 || upper < -128 || upper > 127 || ((i == 0 ? kr : ks) - 1) * kdil[i] > 127)
        return "stride above 8, padding above 128 or a window the TMA unit's im2col box cannot describe";
    }
  }
  if (geo.stream_k == 1) {  // the kernel counts all tiles' k tiles in 32 bits
    if (P > 0 && Q > 0 &&
        stream_k_work(geo, (x.size(0) * P * Q + geo.bn - 1) / geo.bn * ((w.size(0) + geo.bm - 1) / geo.bm), kr, ks,
                      kc) > INT_MAX)
      return "the stream-K plan's iteration count for this shape would pass 2^31 - 1 (it was tuned for a smaller one)";
  }
  if (geo.fix_s > 0 && (w.size(3) != geo.fix_s || stride[1] != geo.fix_u || dilation[1] != 1))
    return "the plan is specialised to another filter width or column stride";
  if (geo.split > 1 && (geo.dtype != 0 || geo.tma)) {
    if (P > 0 && Q > 0 && split_workspace_floats(geo, x.size(0) * P * Q, w.size(0)) > kMaxSplitWorkspaceFloats)
      return "the split-K plan's workspace for this shape would pass 1 GiB (it was tuned for a smaller grid)";
  }
  if (geo.smem_patch > 0 || geo.smem_taps > 0) {
    // int32 halo arithmetic (a larger stride or dilation would not fit a 2^31-element tensor anyway)
    for (int i = 0; i < 2; ++i)
      if (stride[i] < 1 || stride[i] > 65535 || dilation[i] < 1 || dilation[i] > 65535)
        return "stride or dilation out of range for a direct plan";
    if (launch_smem(plan, w.size(2), w.size(3), stride, dilation) > plan.smem_max)
      return "the direct plan's input patch and filters for this call do not fit the device's shared memory";
  }
  if (geo.gemm == 1 && plan.gemm_fn == nullptr && P > 0 && Q > 0) {
    // its products through cuBLASLt in fp32 (launch_gemm_plan), resolved here where torch's flags would make
    // at::bmm_out's TF32: a shape cuBLASLt cannot take is then ATen's answer (or the check's refusal), never an error
    // out of the launch (with the flags off such a shape runs at::bmm_out's fp32 SGEMM)
    std::string why;
    bagf_lt::Handle h = nullptr;
    if (matmul_tf32() && winograd_lt_gemm(plan, winograd_dims(geo, x.size(0), P, Q, w.size(0), x.size(1), stride[0]),
                                          x.get_device(), h, why) == nullptr)
      return h == nullptr ? "the non-fused Winograd plan's GEMM would run in TF32 through ATen (matmul.allow_tf32, "
                            "or torch.set_float32_matmul_precision is not 'highest'), and cuBLASLt, which would run "
                            "it in fp32, is not available"
                          : "the non-fused Winograd plan's GEMM would run in TF32 through ATen (matmul.allow_tf32, "
                            "or torch.set_float32_matmul_precision is not 'highest'), and cuBLASLt offers no fp32 "
                            "algorithm for this shape's products";
  }
  if (b.has_value() && b->defined()) {
    if (!b->is_cuda() || b->scalar_type() != dt || !b->is_contiguous() || b->numel() != w.size(0))
      return "bias is not a contiguous vector of K elements of the input's dtype on the device";
  }
  return nullptr;
}

// A non-fused Winograd plan: filter and input transforms (stages 0 and 1 of plan.fn), the E batched products
// M[e] = U[e] V[e] -- through the plan's own 3xTF32 GEMM (plan.gemm_fn) when it has one, else through cuBLASLt in
// strict fp32 (winograd_lt_gemm), else through at::bmm_out (cuBLAS SGEMM; unsupported_reason has made sure TF32 is
// off there) -- and the inverse transform with bias (stage 2). One workspace from torch's caching allocator on the
// current stream holds U, V, M and cuBLASLt's workspace, each at a 256-byte boundary (one allocation, not four:
// a batch-1 call is host-bound). At stride s > 1 the products reduce over the C s^2 polyphase
// channels (winograd_gemm.cuh).
void launch_gemm_plan(const Plan& plan, bagf::Conv2dParams& p, const at::Tensor& x, const void* xp,
                      const void* wp, const void* bp, void* yp, cudaStream_t stream) {
  const LaunchGeometry& geo = plan.geo;
  const WinogradDims dims = winograd_dims(geo, p.N, p.P, p.Q, p.K, p.C, p.stride_h);
  const int64_t E = dims.E, T = dims.T, K = dims.K, C = dims.C;
  const bool v_tc = geo.layout & 1, m_tk = geo.layout & 2, u_small = geo.layout & 4;
  bagf_lt::Handle h = nullptr;
  std::string why;
  const bagf_lt::Sgemm* g = plan.gemm_fn == nullptr ? winograd_lt_gemm(plan, dims, x.get_device(), h, why) : nullptr;
  BAGF_CHECK(g != nullptr || plan.gemm_fn != nullptr || !matmul_tf32(),
             "bagf_torch: the Winograd products in fp32 need cuBLASLt while torch's matmuls run in TF32: ", why);
  auto padded = [](int64_t floats) { return (floats + 63) / 64 * 64; };  // (256-byte boundaries)
  const int64_t u_n = (u_small ? 2 * E : E) * K * C;  // u_small: stage 0 writes U's small parts after U
  const int64_t v_n = E * C * T, m_n = E * K * T;
  const int64_t ws_n = g != nullptr ? static_cast<int64_t>((g->workspace + 3) / 4) : 0;
  // fp32 workspaces whatever the tensors' dtype (the stages widen it), from a 256-byte boundary (the GEMM was resolved
  // for operands aligned so: the caching allocator's blocks are, another allocator's may not be)
  at::Tensor buffer =
      at::empty({padded(u_n) + padded(v_n) + padded(m_n) + ws_n + 64}, x.options().dtype(at::kFloat));
  float* up = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data_ptr<float>()) + 255) & ~uintptr_t{255});
  float* vp = up + padded(u_n);
  float* mo = vp + padded(v_n);
  const float* mp = mo;
  void* wsp = ws_n > 0 ? static_cast<void*>(mo + padded(m_n)) : nullptr;
  bagf_lt::Status st = 0;
  const int64_t tb = geo.threads;
  auto blocks_for = [tb](int64_t items) { return (items + tb - 1) / tb; };
  auto stage = [&](int which, int64_t blocks) {
    BAGF_CHECK(blocks <= INT_MAX, "bagf_torch: Winograd stage ", which, " needs ", blocks, " blocks");
    void* args[] = {&xp, &wp, &bp, &yp, &p, &up, &vp, &mp, &which};
    BAGF_CU_CHECK(cuLaunchKernel(plan.fn, static_cast<unsigned>(blocks), 1, 1, geo.threads, 1, 1, 0, stream, args,
                                 nullptr));
  };
  stage(3, blocks_for(K * C) + blocks_for(C * T));  // filter and input transforms, one grid
  if (plan.gemm_fn != nullptr) {  // layout 0 (load_plan checked): M[e] (K x T) = U[e] (K x C) V[e] (C x T)
    BAGF_CHECK(K * C <= INT_MAX && C * T <= INT_MAX && K * T <= INT_MAX, "bagf_torch: Winograd GEMM operands of ",
               K, "x", C, "x", T, " exceed 32-bit indexing");
    int gm = static_cast<int>(K), gn = static_cast<int>(T), gk = static_cast<int>(C);
    long long sa = K * C, sb = C * T, sc = K * T;
    void* args[] = {&up, &vp, &mo, &gm, &gn, &gk, &sa, &sb, &sc};
    const int64_t gx = (T + geo.gemm_bn - 1) / geo.gemm_bn, gy = (K + geo.gemm_bm - 1) / geo.gemm_bm;
    BAGF_CHECK(gx <= INT_MAX && gy <= 65535 && E <= 65535, "bagf_torch: Winograd GEMM grid ", gx, "x", gy, "x", E,
               " is out of range");
    BAGF_CU_CHECK(cuLaunchKernel(plan.gemm_fn, static_cast<unsigned>(gx), static_cast<unsigned>(gy),
                                 static_cast<unsigned>(E), geo.gemm_threads, 1, 1, geo.gemm_smem, stream, args,
                                 nullptr));
  } else if (g != nullptr && (st = bagf_lt::run_sgemm(h, *g, m_tk ? vp : up, m_tk ? up : vp, mo, wsp, stream)) == 0) {
    // (done; a refusal with torch's fp32 matmuls in TF32 is an error, else at::bmm_out computes the same products)
  } else {  // (views of the one workspace, as the stages see it)
    BAGF_CHECK(!matmul_tf32(), "bagf_torch: the Winograd products through cuBLASLt failed: ",
               bagf_lt::status_text(st));
    const float* base = buffer.data_ptr<float>();
    auto part = [&](const float* from, int64_t floats) { return buffer.narrow(0, from - base, floats); };
    at::Tensor U = part(up, E * K * C).view({E, K, C});
    at::Tensor V = part(vp, v_n).view(v_tc ? at::IntArrayRef{E, T, C} : at::IntArrayRef{E, C, T});
    at::Tensor M = part(mo, m_n).view(m_tk ? at::IntArrayRef{E, T, K} : at::IntArrayRef{E, K, T});
    if (m_tk) {  // M^T[e] = V^T[e] U^T[e]
      at::bmm_out(M, v_tc ? V : V.transpose(1, 2), U.transpose(1, 2));
    } else {
      at::bmm_out(M, U, v_tc ? V.transpose(1, 2) : V);
    }
  }
  // inverse transform with bias; staged (layout bit 3, the kernel's SO): K * ceil(N / G) blocks of G whole images
  // each, G = threads / tiles per image, when an image's tiles fit in a block (else per tile, as unstaged)
  const int64_t tiles_img = T / p.N;  // (T is N images' tiles; a call with no image never launches)
  const int64_t g_imgs = tb / tiles_img;
  stage(2, (geo.layout & 8) && g_imgs > 0 ? K * ((p.N + g_imgs - 1) / g_imgs) : blocks_for(K * T));
}

// The TMA maps of an implicit-GEMM TMA plan (implicit_gemm_tma_h16.cuh), encoded per call from the channels_last
// input and KRSC weight (unsupported_reason has checked every range): the input as an im2col map over (C, W, H, N)
// whose box walks the output pixels' window corners (one 128-byte row of channels -- 64 16-bit or 32 fp32 values --
// x geo.bn pixels per copy), the weight as a tiled map over (C, R*S, K) (the same channels x geo.bm output channels
// per copy), both at the 128-byte swizzle. fp32 tensors are mapped as TF32 (the plan's products are TF32).
void encode_tma_maps(const LaunchGeometry& geo, const bagf::Conv2dParams& p, const void* xp, const void* wp,
                     CUtensorMap& xm, CUtensorMap& wm) {
  const CUtensorMapDataType type = geo.dtype == 2   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : geo.dtype == 1 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                    : CU_TENSOR_MAP_DATA_TYPE_TFLOAT32;
  const cuuint64_t bytes = geo.dtype == 0 ? 4 : 2;   // per element
  const cuuint32_t row = static_cast<cuuint32_t>(128 / bytes);  // channels per 128-byte row
  const cuuint64_t C = static_cast<cuuint64_t>(p.C);
  const cuuint64_t xdim[4] = {C, static_cast<cuuint64_t>(p.W), static_cast<cuuint64_t>(p.H),
                              static_cast<cuuint64_t>(p.N)};
  const cuuint64_t xstride[3] = {C * bytes, C * bytes * p.W, C * bytes * p.W * p.H};
  const int lower[2] = {-p.pad_w, -p.pad_h};
  const int upper[2] = {(p.Q - 1) * p.stride_w + 1 - p.W - p.pad_w, (p.P - 1) * p.stride_h + 1 - p.H - p.pad_h};
  const cuuint32_t xsteps[4] = {1, static_cast<cuuint32_t>(p.stride_w), static_cast<cuuint32_t>(p.stride_h), 1};
  BAGF_CU_CHECK(cuTensorMapEncodeIm2col(&xm, type, 4, const_cast<void*>(xp), xdim, xstride, lower, upper, row,
                                        static_cast<cuuint32_t>(geo.bn), xsteps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  const cuuint64_t RS = static_cast<cuuint64_t>(p.R) * p.S;
  const cuuint64_t wdim[3] = {C, RS, static_cast<cuuint64_t>(p.K)};
  const cuuint64_t wstride[2] = {C * bytes, C * bytes * RS};
  const cuuint32_t box[3] = {row, 1, static_cast<cuuint32_t>(geo.bm)};
  const cuuint32_t wsteps[3] = {1, 1, 1};
  BAGF_CU_CHECK(cuTensorMapEncodeTiled(&wm, type, 3, const_cast<void*>(wp), wdim, wstride, box, wsteps,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

// A cuBLASLt plan's call (cublaslt_plan.h): the GEMM for this call's shape and alignments (resolved at the first such
// call), a workspace from torch's caching allocator, the bias as the GEMM needs it, one cublasLtMatmul on the current
// stream. False, with ``why``, when the shape has no GEMM of the plan's entry or cuBLASLt refuses the call: nothing
// launched, except that a Bias::kFilledD GEMM has written the bias into ``y`` first. A refused broadcast-C GEMM is
// demoted to a filled D and tried once more; a refusal after that is remembered (later calls fail at once).
bool launch_blas_plan(const Plan& plan, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                      at::Tensor& y, std::string& why) {
  bagf_lt::State& st = *plan.blas;
  const int device = x.get_device();
  bagf_lt::Handle h = bagf_lt::handle(device, why);
  if (h == nullptr) return false;
  const bool has_bias = b.has_value() && b->defined();
  bagf_lt::Shape shape;
  shape.n = x.size(0);
  shape.c = x.size(1);
  shape.hw = x.size(2) * x.size(3);
  shape.k = w.size(0);
  shape.bias = has_bias;
  // an NCHW plan's batch of images: each image's matrix is as aligned as the base and the stride both are
  const bool batched = !plan.geo.nhwc && shape.n > 1;
  const int64_t bytes = x.element_size();
  auto aligned = [&](const void* p, int64_t stride) {
    const uint32_t a = bagf_lt::alignment(reinterpret_cast<uintptr_t>(p));
    return batched ? std::min(a, bagf_lt::alignment(static_cast<uintptr_t>(stride * bytes))) : a;
  };
  shape.align_x = aligned(x.const_data_ptr(), shape.c * shape.hw);
  shape.align_w = bagf_lt::alignment(reinterpret_cast<uintptr_t>(w.const_data_ptr()));
  shape.align_y = aligned(y.const_data_ptr(), shape.k * shape.hw);
  shape.align_b = has_bias ? bagf_lt::alignment(reinterpret_cast<uintptr_t>(b->const_data_ptr())) : 256;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  std::lock_guard<std::mutex> lock(st.mutex);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const void* bp = has_bias ? b->const_data_ptr() : nullptr;
    bagf_lt::Gemm* g = bagf_lt::resolve(st, h, shape, bp, why);
    if (g == nullptr) return false;
    // (freed after the launch: the caching allocator hands them out again only to later work on this stream)
    at::Tensor ws, broadcast;
    void* wsp = nullptr;
    if (g->workspace > 0) {
      ws = at::empty({static_cast<int64_t>(g->workspace)}, x.options().dtype(at::kByte));
      wsp = ws.mutable_data_ptr();
    }
    if (g->bias == bagf_lt::Bias::kBroadcastC) {  // an NCHW plan's bias as one output image of it (the GEMM's C,
                                                  // batch stride 0), in a fresh allocation, as aligned as resolve
                                                  // told cuBLASLt (contiguous() would return the bias itself at HW = 1)
      broadcast = at::empty({shape.k, shape.hw}, b->options());
      broadcast.copy_(b->view({shape.k, 1}).expand({shape.k, shape.hw}));
      bp = broadcast.const_data_ptr();
    } else if (g->bias == bagf_lt::Bias::kFilledD) {  // the whole output holds the bias first (C = D, beta = 1)
      y.view({shape.n, shape.k, shape.hw}).copy_(b->view({1, shape.k, 1}).expand({shape.n, shape.k, shape.hw}));
    }
    const bagf_lt::Status s =
        bagf_lt::run(h, *g, x.const_data_ptr(), w.const_data_ptr(), bp, y.mutable_data_ptr(), wsp, stream);
    if (s == 0) return true;
    why = "cublasLtMatmul refused the call: " + bagf_lt::status_text(s);
    if (g->bias != bagf_lt::Bias::kBroadcastC) {
      g->error = why;  // (resolve answers this shape with it from now on)
      return false;
    }
    bagf_lt::demote(st);  // a broadcast C refused: once more with the output filled
  }
  return false;
}

void launch_plan(const Plan& plan, const at::Tensor& x, const at::Tensor& w,
                 const std::optional<at::Tensor>& b, at::Tensor& y, at::IntArrayRef stride,
                 at::IntArrayRef padding, at::IntArrayRef dilation, int relu = 0) {
  const LaunchGeometry& geo = plan.geo;
  BAGF_CHECK(relu == 0 || (geo.tma && plan.blas == nullptr), "bagf_torch: only a TMA plan's epilogue runs a ReLU");
  if (plan.blas != nullptr) {
    std::string why;
    BAGF_CHECK(launch_blas_plan(plan, x, w, b, y, why), "bagf_torch: ", why);
    return;
  }
  bagf::Conv2dParams p;
  p.N = static_cast<int>(x.size(0));
  p.C = static_cast<int>(x.size(1));
  p.H = static_cast<int>(x.size(2));
  p.W = static_cast<int>(x.size(3));
  p.K = static_cast<int>(w.size(0));
  p.R = static_cast<int>(w.size(2));
  p.S = static_cast<int>(w.size(3));
  p.P = static_cast<int>(y.size(2));
  p.Q = static_cast<int>(y.size(3));
  p.stride_h = static_cast<int>(stride[0]);
  p.stride_w = static_cast<int>(stride[1]);
  p.pad_h = static_cast<int>(padding[0]);
  p.pad_w = static_cast<int>(padding[1]);
  p.dil_h = static_cast<int>(dilation[0]);
  p.dil_w = static_cast<int>(dilation[1]);
  const bool has_bias = b.has_value() && b->defined();
  p.has_bias = has_bias ? 1 : 0;
  p.relu = relu;  // (read by the TMA kernels' epilogue only: conv_params.h)
  // The kernels read the weight in the plan's format (KRSC for a channels_last plan and for every TMA plan): a
  // weight in another format is converted for this call (a frozen TunedConv2d passes a KRSC copy: plan_reads_krsc).
  // unsupported_reason has checked dtypes and shapes, and that fp32 and NCHW plans get a contiguous weight, so for
  // them (TMA plans aside) this is the weight itself. An NCHW TMA plan reads a channels_last copy of the input (its
  // maps view channels innermost) and writes NCHW.
  // A polyphase plan makes the form's input and weight (conv_params.h PolyphaseParams) with the cubin's second and
  // third kernels, from the input in the plan's format and the weight in any, and runs its kernel on the form.
  const at::MemoryFormat wfmt = geo.tma ? at::MemoryFormat::ChannelsLast : plan_format(geo);
  at::Tensor wf = geo.polyphase || w.is_contiguous(wfmt) ? w : w.contiguous(wfmt);
  at::Tensor xf = x;
  if (geo.polyphase) {
    bagf::PolyphaseParams q = bagf::polyphase_form(p, static_cast<int>(w.stride(0)), static_cast<int>(w.stride(1)),
                                                   static_cast<int>(w.stride(2)), static_cast<int>(w.stride(3)));
    BAGF_CHECK(q.Cp <= bagf::kPolyphaseMaxChannels, "bagf_torch: a polyphase form of ", q.Cp,
               " channels passes the gather's table (", bagf::kPolyphaseMaxChannels, ")");
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
    xf = at::empty({q.N, q.Cp, q.Hp, q.Wp}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
    wf = at::empty({q.K, q.Cp, q.Rp, q.Sp}, w.options().memory_format(at::MemoryFormat::ChannelsLast));
    const void* src = x.const_data_ptr();
    void* dst = xf.mutable_data_ptr();
    void* gargs[] = {&src, &dst, &q};
    constexpr int gt = bagf::kPolyphaseThreads;  // (two values of a form row per thread: Cp is even)
    const int64_t gblocks = (static_cast<int64_t>(q.Wp) * q.Cp / 2 + gt - 1) / gt;
    BAGF_CU_CHECK(cuLaunchKernel(plan.gather_fn, static_cast<unsigned>(gblocks), static_cast<unsigned>(q.Hp),
                                 static_cast<unsigned>(std::min(q.N, 65535)), gt, 1, 1, 0, stream, gargs, nullptr));
    const void* wsrc = w.const_data_ptr();
    void* wdst = wf.mutable_data_ptr();
    void* wargs[] = {&wsrc, &wdst, &q};
    constexpr int wt = bagf::kPolyphaseWeightThreads;
    const int64_t wblocks = std::min<int64_t>((wf.numel() + wt - 1) / wt, kPolyphaseWeightStep / wt);
    BAGF_CU_CHECK(cuLaunchKernel(plan.weight_fn, static_cast<unsigned>(wblocks), 1, 1, wt, 1, 1, 0, stream, wargs,
                                 nullptr));
    p = bagf::polyphase_inner(p, q);
  } else if (geo.tma && !geo.nhwc && !x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    if (plan.transpose_fn == nullptr || (p.C + bagf::kNchwCopyTile - 1) / bagf::kNchwCopyTile > 65535) {
      xf = x.contiguous(at::MemoryFormat::ChannelsLast);
    } else {  // the plan's own copy: 64 x 64 tiles through shared memory (ATen's permuting copy is slower)
      xf = at::empty_like(x, at::MemoryFormat::ChannelsLast);
      const void* src = x.const_data_ptr();
      void* dst = xf.mutable_data_ptr();
      int C = p.C, HW = p.H * p.W, N = p.N;
      void* targs[] = {&src, &dst, &C, &HW, &N};
      constexpr int tile = bagf::kNchwCopyTile;
      const unsigned gx = static_cast<unsigned>((HW + tile - 1) / tile);
      const unsigned gy = static_cast<unsigned>((C + tile - 1) / tile);
      BAGF_CU_CHECK(cuLaunchKernel(plan.transpose_fn, gx, gy, static_cast<unsigned>(std::min(N, 65535)), 256, 1, 1, 0,
                                   c10::cuda::getCurrentCUDAStream(x.get_device()).stream(), targs, nullptr));
    }
  }
  const void* xp = xf.const_data_ptr();
  const void* wp = wf.const_data_ptr();
  const void* bp = has_bias ? b->const_data_ptr() : nullptr;
  void* yp = y.mutable_data_ptr();
  if (geo.gemm == 1) {  // fp32 transforms and products around the plan's dtype
    launch_gemm_plan(plan, p, x, xp, wp, bp, yp, c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
    return;
  }
  // columns of the block grid: output pixels, or a Winograd plan's m x m / a direct plan's tile x tile_w tiles
  const int tile_w = geo.tile_w > 0 ? geo.tile_w : geo.tile;
  const int64_t cols = geo.tile > 1 || tile_w > 1 ? static_cast<int64_t>(p.N) * ((p.P + geo.tile - 1) / geo.tile) *
                                                        ((p.Q + tile_w - 1) / tile_w)
                                                  : static_cast<int64_t>(p.N) * p.P * p.Q;
  const int64_t smem = launch_smem(plan, p.R, p.S, stride, dilation);
  const unsigned gx = static_cast<unsigned>((cols + geo.bn - 1) / geo.bn);
  const unsigned gy = static_cast<unsigned>((p.K + geo.bm - 1) / geo.bm);
  BAGF_CHECK(geo.stream_k || gy <= 65535, "bagf_torch: K=", p.K, " needs ", gy, " blocks along grid.y (limit 65535)");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  // The grid and the workspace (the 16-bit and TMA kernels take it as a sixth argument, null when there is none; the
  // other fp32 kernels have five, and the driver reads only those), whose last `counters` floats start at zero:
  // - stream-K (SK 1): the resident blocks share the gx gy tiles' k tiles, at least kStreamKMinIters per block; two
  //   workspace tiles per block for the parts of tiles it shares, then a counter per tile;
  // - persistent blocks (SK 2): the resident blocks, at most one per tile, each taking whole tiles; none;
  // - split-K: a 16-bit or TMA plan sums its slices in a workspace with a counter per tile (a split-K cluster plan
  //   hands over in shared memory: none); another fp32 one adds them atomically into a zeroed output.
  unsigned lx = gx, ly = gy, lz = static_cast<unsigned>(geo.split);
  int64_t floats = 0, counters = 0;
  if (geo.stream_k) {
    const int64_t tiles = static_cast<int64_t>(gx) * gy;
    const int64_t most = geo.stream_k == 1 ? stream_k_work(geo, tiles, p.R, p.S, p.C) / kStreamKMinIters : tiles;
    const int64_t blocks = std::max<int64_t>(1, std::min(plan.resident, most));
    lx = static_cast<unsigned>(blocks);
    ly = lz = 1;
    if (geo.stream_k == 1) {
      floats = 2 * blocks * geo.bm * geo.bn + tiles;
      counters = tiles;
    }
  } else if ((floats = split_workspace_floats(geo, cols, p.K)) > 0) {
    counters = static_cast<int64_t>(gx) * gy;
  } else if (geo.split > 1 && geo.dtype == 0 && !geo.tma) {
    BAGF_CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(yp), 0, static_cast<size_t>(y.numel()), stream));
  }
  at::Tensor ws;
  float* wsp = nullptr;
  if (floats > 0) {
    ws = at::empty({floats}, x.options().dtype(at::kFloat));
    wsp = ws.mutable_data_ptr<float>();
    BAGF_CU_CHECK(cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(wsp + (floats - counters)), 0,
                                   static_cast<size_t>(counters), stream));
  }
  CUtensorMap xm, wm;
  void* args[] = {&xp, &wp, &bp, &yp, &p, &wsp};
  if (geo.tma) {
    encode_tma_maps(geo, p, xp, wp, xm, wm);
    args[0] = &xm;
    args[1] = &wm;
  }
  if (geo.split_cluster) {  // the slices of a tile as one cluster: no workspace, nothing to zero
    CUlaunchAttribute attr;
    const CUlaunchConfig cfg = cluster_launch(geo, gx, gy, static_cast<unsigned>(smem), stream, &attr);
    BAGF_CU_CHECK(cuLaunchKernelEx(&cfg, plan.fn, args, nullptr));
    return;
  }
  BAGF_CU_CHECK(cuLaunchKernel(plan.fn, lx, ly, lz, geo.threads, 1, 1, static_cast<unsigned>(smem), stream, args,
                               nullptr));
}

const Plan* plan_for(int64_t handle) {
  if (handle < 0 || handle >= g_count.load(std::memory_order_acquire)) return nullptr;
  const Plan& p = g_plans[handle];
  return p.fn != nullptr || p.blas != nullptr ? &p : nullptr;
}

// Whether a plan reads its weight KRSC (channels_last): every TMA plan but a polyphase one and every channels_last
// kernel of ours.
// launch_plan converts a weight in another format on every call (an extra copy kernel), so a caller that keeps a
// KRSC copy of a weight it calls with again (TunedConv2d with frozen weights) passes that copy instead.
bool plan_reads_krsc(int64_t handle) {
  const Plan* plan = plan_for(handle);
  BAGF_CHECK(plan != nullptr, "bagf_torch: no loaded plan with handle ", handle);
  // (a 1x1 filter: KCRS is KRSC; a polyphase plan reads the weight in any format, by its strides, into its form)
  return (plan->geo.tma != 0 || plan->geo.nhwc != 0) && plan->blas == nullptr && plan->geo.polyphase == 0;
}

// Whether a loaded plan's epilogue can run the ReLU after the conv (conv2d_relu_inference): the TMA plans.
bool plan_fuses_relu(int64_t handle) {
  const Plan* plan = plan_for(handle);
  BAGF_CHECK(plan != nullptr, "bagf_torch: no loaded plan with handle ", handle);
  return plan->geo.tma != 0 && plan->blas == nullptr;
}

// The output a launch of ``plan`` writes for this call: N x K x P x Q in the plan's memory format, or an error where
// the kernel is larger than the padded input. (The caller holds a CUDAGuard for x's device.)
at::Tensor plan_output(const Plan& plan, const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation) {
  const int64_t P = out_extent(x.size(2), w.size(2), stride[0], padding[0], dilation[0]);
  const int64_t Q = out_extent(x.size(3), w.size(3), stride[1], padding[1], dilation[1]);
  BAGF_CHECK(P > 0 && Q > 0, "bagf::conv2d: output would be ", P, "x", Q,
              ": the kernel is larger than the padded input");
  return at::empty({x.size(0), w.size(0), P, Q}, x.options().memory_format(plan_format(plan.geo)));
}

at::Tensor conv2d_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                       int64_t plan_handle) {
  BAGF_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
              "bagf::conv2d: stride, padding and dilation must have 2 elements each");
  const Plan* plan = plan_for(plan_handle);
  if (plan == nullptr || !valid_geometry(stride, padding, dilation)) {
    return aten_conv(x, w, b, stride, padding, dilation);  // (ATen's own error for a bad stride, padding, dilation)
  }
  if (const char* why = unsupported_reason(x, w, b, stride, padding, dilation, *plan)) {
    TORCH_WARN_ONCE(cat("bagf::conv2d: ", why, "; this call runs through ATen's conv2d instead"));
    return aten_conv(x, w, b, stride, padding, dilation);
  }
  if (plan->geo.tf32 && !cudnn_conv_tf32()) {
    // A plan of PyTorch's TF32 mode (TF32 products) called with cuDNN's TF32 off: a graph torch.compile'd before the
    // flag changed. The caller now asks for strict fp32, which ATen's conv computes. (A captured CUDA graph replays
    // its launches without this host code, as it replays cuDNN's TF32 kernels.)
    TORCH_WARN_ONCE(cat("bagf::conv2d: a plan tuned in TF32 mode was called with cuDNN's TF32 off, as a graph "
                        "compiled before the flag changed calls it: such calls run through ATen's conv2d in strict "
                        "fp32. Compile again, after torch._dynamo.reset(), to use the plans of this mode"));
    return aten_conv(x, w, b, stride, padding, dilation);
  }
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = plan_output(*plan, x, w, stride, padding, dilation);
  if (y.numel() == 0) return y;
  if (y.numel() > INT_MAX) return aten_conv(x, w, b, stride, padding, dilation);
  if (plan->blas != nullptr) {
    std::string why;
    if (!launch_blas_plan(*plan, x, w, b, y, why)) {
      TORCH_WARN_ONCE(cat("bagf::conv2d: ", why, "; this call runs through ATen's conv2d instead"));
      return aten_conv(x, w, b, stride, padding, dilation);
    }
    return y;
  }
  launch_plan(*plan, x, w, b, y, stride, padding, dilation);
  return y;
}

at::Tensor conv2d_cpu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                      int64_t plan_handle) {
  return aten_conv(x, w, b, stride, padding, dilation);
}

// Into a caller's output, and never through ATen: the tuner's check poisons ``y`` first to catch unwritten elements,
// and a plan that cannot take the call must fail it (an ATen answer would pass).
void launch_into(const Plan& plan, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                 at::Tensor& y, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  BAGF_CHECK(valid_geometry(stride, padding, dilation), "bagf_torch: stride and dilation must be at least 1 and "
             "padding at least 0 (each below 2^31), got stride (", stride[0], ", ", stride[1], "), padding (", padding[0], ", ",
             padding[1], "), dilation (", dilation[0], ", ", dilation[1], ")");
  const char* why = unsupported_reason(x, w, b, stride, padding, dilation, plan);
  BAGF_CHECK(why == nullptr, "bagf_torch: cannot launch this plan: ", why);
  BAGF_CHECK(y.is_cuda() && y.device() == x.device() && y.is_contiguous(plan_format(plan.geo)) &&
                  y.scalar_type() == plan_dtype(plan.geo) &&
                  y.dim() == 4 &&
                  y.size(0) == x.size(0) && y.size(1) == w.size(0) &&
                  y.size(2) == out_extent(x.size(2), w.size(2), stride[0], padding[0], dilation[0]) &&
                  y.size(3) == out_extent(x.size(3), w.size(3), stride[1], padding[1], dilation[1]),
              "bagf_torch: out must be a tensor of the output's NKPQ shape on the input's device, in the plan's dtype "
              "and memory format (the input's)");
  BAGF_CHECK(y.numel() > 0 && y.numel() <= INT_MAX, "bagf_torch: out has ", y.numel(),
             " elements; a plan writes 1 to 2^31 - 1");
  c10::cuda::CUDAGuard guard(x.device());
  launch_plan(plan, x, w, b, y, stride, padding, dilation);
}

// The op's CUDA kernel called from Python without the dispatcher, the one other way into a plan: the boxed
// dispatcher call is 2.7 us of a batch-1 call's 15.4 us of host time on the H200
// (benchmarks/results/bench_layers_overhead_h200.md), so TunedConv2d takes this way for calls that need no
// gradient, outside torch.compile and tracing. The tuner times candidates through it too (the user's call), and
// with ``out`` checks them: launched into ``out``, strictly (see launch_into).
at::Tensor conv2d_inference(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                            std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                            int64_t plan_handle, std::optional<at::Tensor> out) {
  if (!out.has_value()) return conv2d_cuda(x, w, b, stride, padding, dilation, plan_handle);
  const Plan* plan = plan_for(plan_handle);
  BAGF_CHECK(plan != nullptr, "bagf_torch: no loaded plan with handle ", plan_handle);
  BAGF_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
             "bagf_torch: stride, padding and dilation must have 2 elements each");
  launch_into(*plan, x, w, b, *out, stride, padding, dilation);
  return *out;
}

// The conv and the ReLU after it as one launch (FusedSequential's conv -> ReLU pairs, eager calls that need no
// gradient): the plan's output with torch's ReLU applied in its epilogue (relu: 1, -0.0 made +0.0; 2, -0.0 kept, as
// torch's ReLU does on the device), or None wherever conv2d_cuda would not launch the plan itself (no such plan, a
// plan that is not TMA, a call the plan does not take, TF32 off for a TF32 plan, an empty or oversized output): the
// caller then runs the conv and the ReLU as before, which says why where that path does. A kernel larger than the
// padded input is conv2d_cuda's error.
std::optional<at::Tensor> conv2d_relu_inference(const at::Tensor& x, const at::Tensor& w,
                                                const std::optional<at::Tensor>& b, std::vector<int64_t> stride,
                                                std::vector<int64_t> padding, std::vector<int64_t> dilation,
                                                int64_t plan_handle, int64_t relu) {
  BAGF_CHECK(relu == 1 || relu == 2, "bagf_torch: relu must be 1 (-0.0 made +0.0) or 2 (-0.0 kept), got ", relu);
  const Plan* plan = plan_for(plan_handle);
  if (plan == nullptr || !plan->geo.tma || plan->blas != nullptr || stride.size() != 2 || padding.size() != 2 ||
      dilation.size() != 2 || !valid_geometry(stride, padding, dilation))
    return std::nullopt;
  if (unsupported_reason(x, w, b, stride, padding, dilation, *plan) != nullptr) return std::nullopt;
  if (plan->geo.tf32 && !cudnn_conv_tf32()) return std::nullopt;
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = plan_output(*plan, x, w, stride, padding, dilation);
  if (y.numel() == 0 || y.numel() > INT_MAX) return std::nullopt;
  launch_plan(*plan, x, w, b, y, stride, padding, dilation, static_cast<int>(relu));
  return y;
}

// ---------------------------------------------------------------------------------------- autograd

// The op's device kernel (CUDA or CPU), dispatched past the Autograd key.
at::Tensor call_below_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                               at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                               int64_t plan) {
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("bagf::conv2d", "").typed<decltype(conv2d_cuda)>();
  return op.call(x, w, b, stride, padding, dilation, plan);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class Conv2dFunction : public torch::autograd::Function<Conv2dFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& b, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t plan) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["has_bias"] = b.has_value() && b->defined();
    return call_below_autograd(x, w, b, stride, padding, dilation, plan);
  }

  // Training goes through ATen's convolution backward: the tuned kernel only replaces the forward.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto stride = ctx->saved_data["stride"].toIntVector();
    auto padding = ctx->saved_data["padding"].toIntVector();
    auto dilation = ctx->saved_data["dilation"].toIntVector();
    std::array<bool, 3> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                has_bias && ctx->needs_input_grad(2)};
    std::optional<at::IntArrayRef> bias_sizes;
    std::vector<int64_t> bsz = {w.size(0)};
    if (has_bias) bias_sizes = at::IntArrayRef(bsz);
    auto [gx, gw, gb] = at::convolution_backward(grads[0].contiguous(x.suggest_memory_format()), x, w, bias_sizes,
                                                 stride, padding, dilation, false, {0, 0}, 1, mask);
    return {gx, gw, has_bias ? gb : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor conv2d_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                           int64_t plan) {
  // Forward-mode AD (a dual tensor, torch.func.jvp, also inside a compiled graph, which TunedConv2d's eager check
  // does not see): the kernel has no tangent rule, and the shortcut below would drop the tangent (zeros, silently);
  // ATen's convolution has one, so such a call is ATen's (level 0: as PyTorch's own generated kernels ask).
  auto dual = [](const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); };
  if (dual(x) || dual(w) || (b.has_value() && dual(*b))) return aten_conv(x, w, b, stride, padding, dilation);
  // Inference (no_grad, or no input that needs a gradient): straight to the device kernel, without the
  // autograd node and its saved arguments; their cost is per call, and at batch 1 the call is host-bound.
  const bool bias_grad = b.has_value() && b->defined() && b->requires_grad();
  const bool needs_grad = at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || bias_grad);
  if (!needs_grad) {
    return call_below_autograd(x, w, b, stride, padding, dilation, plan);
  }
  return Conv2dFunction::apply(x, w, b, stride, padding, dilation, plan);
}

}  // namespace

#include "pool_epilogue.h"  // (after the helpers above, which it uses)

TORCH_LIBRARY(bagf, m) {
  m.def(
      "conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, int[2] dilation, "
      "int plan) -> Tensor");
}

TORCH_LIBRARY_IMPL(bagf, CUDA, m) { m.impl("conv2d", &conv2d_cuda); }
TORCH_LIBRARY_IMPL(bagf, CPU, m) { m.impl("conv2d", &conv2d_cpu); }
TORCH_LIBRARY_IMPL(bagf, Autograd, m) { m.impl("conv2d", &conv2d_autograd); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nvrtc_compile", &bagf_host::nvrtc_compile, "Compile a kernel template instantiation to a cubin with NVRTC");
  m.def("nvrtc_returned", &bagf_host::nvrtc_returned,
        "NVRTC compiles returned in this process, and of them those that returned during shutdown (parked)");
  m.def("versions", &versions, "NVRTC, driver and runtime versions");
  m.def("device_limits", &device_limits, "Shared memory, SM count and thread limits of a device");
  // LaunchGeometry(bm=..., ..., gemm_smem=...): keyword arguments only, each defaulting to the struct's default;
  // bagf_torch.kernels.geometry.LaunchGeometry.to_host builds one from the Python dataclass of the same fields.
  py::class_<LaunchGeometry>(m, "LaunchGeometry", "A plan's launch fields (bagf_torch/kernels/geometry.py)")
      .def(py::init([](int bm, int bn, int threads, int smem, int split, int tile, int tile_w, int smem_patch,
                       int smem_taps, int gemm, int layout, int fix_s, int fix_u, int gemm_bm, int gemm_bn,
                       int gemm_threads, int gemm_smem, int dtype, int nhwc, int tma, int stream_k, int blas,
                       int blas_algo, int blas_ws, int split_cluster, int tf32, int polyphase) {
             return LaunchGeometry{bm,      bn,     threads,      smem,      split, tile, tile_w,
                                   smem_patch, smem_taps, gemm, layout, fix_s, fix_u, gemm_bm,
                                   gemm_bn, gemm_threads, gemm_smem, dtype, nhwc, tma, stream_k,
                                   blas, blas_algo, blas_ws, split_cluster, tf32, polyphase};
           }),
           py::kw_only(), py::arg("bm") = 0, py::arg("bn") = 0, py::arg("threads") = 0, py::arg("smem") = 0,
           py::arg("split") = 1, py::arg("tile") = 1, py::arg("tile_w") = 0, py::arg("smem_patch") = 0,
           py::arg("smem_taps") = 0, py::arg("gemm") = 0, py::arg("layout") = 0, py::arg("fix_s") = 0,
           py::arg("fix_u") = 0, py::arg("gemm_bm") = 0, py::arg("gemm_bn") = 0, py::arg("gemm_threads") = 0,
           py::arg("gemm_smem") = 0, py::arg("dtype") = 0, py::arg("nhwc") = 0, py::arg("tma") = 0,
           py::arg("stream_k") = 0, py::arg("blas") = 0, py::arg("blas_algo") = 0, py::arg("blas_ws") = 0,
           py::arg("split_cluster") = 0, py::arg("tf32") = 0, py::arg("polyphase") = 0)
      .def_readwrite("bm", &LaunchGeometry::bm)
      .def_readwrite("bn", &LaunchGeometry::bn)
      .def_readwrite("threads", &LaunchGeometry::threads)
      .def_readwrite("smem", &LaunchGeometry::smem)
      .def_readwrite("split", &LaunchGeometry::split)
      .def_readwrite("tile", &LaunchGeometry::tile)
      .def_readwrite("tile_w", &LaunchGeometry::tile_w)
      .def_readwrite("smem_patch", &LaunchGeometry::smem_patch)
      .def_readwrite("smem_taps", &LaunchGeometry::smem_taps)
      .def_readwrite("gemm", &LaunchGeometry::gemm)
      .def_readwrite("layout", &LaunchGeometry::layout)
      .def_readwrite("fix_s", &LaunchGeometry::fix_s)
      .def_readwrite("fix_u", &LaunchGeometry::fix_u)
      .def_readwrite("gemm_bm", &LaunchGeometry::gemm_bm)
      .def_readwrite("gemm_bn", &LaunchGeometry::gemm_bn)
      .def_readwrite("gemm_threads", &LaunchGeometry::gemm_threads)
      .def_readwrite("gemm_smem", &LaunchGeometry::gemm_smem)
      .def_readwrite("dtype", &LaunchGeometry::dtype)
      .def_readwrite("nhwc", &LaunchGeometry::nhwc)
      .def_readwrite("tma", &LaunchGeometry::tma)
      .def_readwrite("stream_k", &LaunchGeometry::stream_k)
      .def_readwrite("blas", &LaunchGeometry::blas)
      .def_readwrite("blas_algo", &LaunchGeometry::blas_algo)
      .def_readwrite("blas_ws", &LaunchGeometry::blas_ws)
      .def_readwrite("split_cluster", &LaunchGeometry::split_cluster)
      .def_readwrite("tf32", &LaunchGeometry::tf32)
      .def_readwrite("polyphase", &LaunchGeometry::polyphase);
  m.def("load_plan", &load_plan, "Load a cubin and register it as a launchable plan with its launch geometry",
        py::arg("cubin"), py::arg("lowered_name"), py::arg("device"), py::arg("geometry"));
  m.def("unload_plan", &unload_plan, "Unload a plan's module");
  m.def("plan_reads_krsc", &plan_reads_krsc,
        "Whether a loaded plan reads its weight KRSC (channels_last; it converts one in another format per call)");
  m.def("plan_fuses_relu", &plan_fuses_relu,
        "Whether a loaded plan's epilogue runs the ReLU after the conv (conv2d_relu_inference): the TMA plans");
  m.def("conv2d_relu_inference", &conv2d_relu_inference,
        "A TMA plan's conv with the ReLU after it in its epilogue, without the dispatcher (no autograd); None where "
        "the plan does not take the call", py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("stride"),
        py::arg("padding"), py::arg("dilation"), py::arg("plan"), py::arg("relu"));
  m.def("conv2d_inference", &conv2d_inference,
        "bagf::conv2d's CUDA kernel without the dispatcher (no autograd); with out=, the plan launched into it or "
        "an error (never ATen)",
        py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("stride"), py::arg("padding"),
        py::arg("dilation"), py::arg("plan"), py::kw_only(), py::arg("out") = py::none());
  m.def("load_pool_epilogue", &bagf_pool::load,
        "Load the pooling epilogue's cubin on a device (its twelve kernels' lowered names, ';'-separated)",
        py::arg("cubin"), py::arg("lowered_names"), py::arg("device"));
  m.def("pool_epilogue_loaded", &bagf_pool::loaded, "Whether the pooling epilogue is loaded on a device");
  m.def("relu_max_pool2d", &bagf_pool::relu_max_pool2d,
        "max_pool2d(relu(x)) (or max_pool2d(x)) in one launch on the current stream, in x's dtype and memory format",
        py::arg("input"), py::arg("kernel_size"), py::arg("stride"), py::arg("padding"), py::arg("dilation"),
        py::arg("ceil_mode"), py::arg("relu"), py::arg("relu_keeps_negative_zero"));
}

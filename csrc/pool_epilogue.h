// Host side of the pooling epilogue (kernels/pool_epilogue.cuh): a FusedSequential (convert() makes one of an
// nn.Sequential) runs the nn.ReLU and nn.MaxPool2d after a TunedConv2d as this one launch instead of ATen's two.
// Included by bagf_ext.cpp after its helpers (cat, BAGF_CHECK, BAGF_CU_CHECK, make_context_current); the Python side
// is bagf_torch/epilogue.py, which compiles the cubin (all twelve instantiations, one NVRTC compile, cached on disk
// like a plan's) and checks every argument before it calls here, so the checks below only guard the process.
#pragma once

#include <algorithm>

namespace bagf_pool {

constexpr int kMaxDevices = 64;

// One device's kernels, indexed [dtype][nhwc][relu]; written once under the mutex, then read without it (the
// module pointer is published by the release store after the functions are written).
struct Kernels {
  CUmodule module = nullptr;
  CUfunction fn[3][2][2] = {};
  std::atomic<bool> ready{false};
};

inline std::array<Kernels, kMaxDevices> g_kernels;
inline std::mutex g_mutex;

inline int dtype_index(at::ScalarType t) {
  return t == at::kFloat ? 0 : t == at::kHalf ? 1 : t == at::kBFloat16 ? 2 : -1;
}

// ATen's pooling output extent (aten/src/ATen/native/Pool.h, pooling_output_shape), for valid arguments.
inline int64_t out_extent(int64_t in, int64_t k, int64_t pad, int64_t stride, int64_t dil, bool ceil_mode) {
  const int64_t num = in + 2 * pad - dil * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  int64_t out = (num >= 0 ? num / stride : -((-num + stride - 1) / stride)) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

// Load the cubin of the twelve kernels on ``device``; ``lowered`` holds their lowered names separated by ';' in
// the order dtype (float32, float16, bfloat16), then nhwc (0, 1), then relu (0, 1). Loading twice is a no-op.
inline void load(py::bytes cubin_bytes, const std::string& lowered, int device) {
  BAGF_CHECK(device >= 0 && device < kMaxDevices, "bagf_torch: pool epilogue: device ", device, " out of range");
  std::lock_guard<std::mutex> lock(g_mutex);
  Kernels& k = g_kernels[device];
  if (k.ready.load(std::memory_order_acquire)) return;
  const std::vector<std::string> names = bagf_host::split_names(lowered);
  BAGF_CHECK(names.size() == 12, "bagf_torch: pool epilogue: expected 12 kernel names, got ", names.size());
  const std::string cubin = cubin_bytes;
  make_context_current(device);
  // (held while the module loads: cuModuleLoadData loads into the thread's current context, this device's)
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  BAGF_CHECK(cudaFree(nullptr) == cudaSuccess, "bagf_torch: pool epilogue: cannot use device ", device);
  CUmodule module = nullptr;
  BAGF_CU_CHECK(cuModuleLoadData(&module, cubin.data()));
  for (int i = 0; i < 12; ++i) {
    CUresult r = cuModuleGetFunction(&k.fn[i / 4][(i / 2) % 2][i % 2], module, names[i].c_str());
    if (r != CUDA_SUCCESS) {
      cuModuleUnload(module);
      BAGF_CHECK(false, "bagf_torch: pool epilogue: kernel ", names[i], " not in the cubin: ", cu_error(r));
    }
  }
  k.module = module;
  k.ready.store(true, std::memory_order_release);
}

inline bool loaded(int device) {
  return device >= 0 && device < kMaxDevices && g_kernels[device].ready.load(std::memory_order_acquire);
}

// max_pool2d(relu(x)) (relu: false, max_pool2d(x)) as ATen computes it, in x's dtype and memory format, on the
// current stream. x: a CUDA float32 / float16 / bfloat16 4-d tensor of fewer than 2^31 elements, contiguous or
// channels_last (the Python side sends nothing else; anything else is refused here too).
inline at::Tensor relu_max_pool2d(const at::Tensor& x, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                                  std::vector<int64_t> padding, std::vector<int64_t> dilation, bool ceil_mode,
                                  bool relu, bool relu_keeps_negative_zero) {
  BAGF_CHECK(x.is_cuda() && x.dim() == 4, "bagf_torch: pool epilogue: needs a 4-d CUDA tensor");
  const int dt = dtype_index(x.scalar_type());
  BAGF_CHECK(dt >= 0, "bagf_torch: pool epilogue: dtype must be float32, float16 or bfloat16");
  BAGF_CHECK(x.numel() < (int64_t(1) << 31), "bagf_torch: pool epilogue: 2^31 or more elements");
  BAGF_CHECK(x.is_contiguous() || x.is_contiguous(at::MemoryFormat::ChannelsLast),
             "bagf_torch: pool epilogue: needs a contiguous or channels_last input");
  BAGF_CHECK(kernel.size() == 2 && stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
             "bagf_torch: pool epilogue: kernel, stride, padding and dilation take two values each");
  for (int i = 0; i < 2; ++i) {
    BAGF_CHECK(kernel[i] > 0 && stride[i] > 0 && dilation[i] > 0 && padding[i] >= 0 && padding[i] <= kernel[i] / 2 &&
                   kernel[i] < 65536 && stride[i] < 65536 && dilation[i] < 65536,
               "bagf_torch: pool epilogue: kernel, stride and dilation must be positive, padding at most half the "
               "kernel");
  }
  const int device = x.get_device();
  BAGF_CHECK(loaded(device), "bagf_torch: pool epilogue: not loaded on device ", device);
  const int64_t P = out_extent(x.size(2), kernel[0], padding[0], stride[0], dilation[0], ceil_mode);
  const int64_t Q = out_extent(x.size(3), kernel[1], padding[1], stride[1], dilation[1], ceil_mode);
  BAGF_CHECK(P > 0 && Q > 0, "bagf_torch: pool epilogue: output would be empty (", P, " x ", Q, ")");
  const at::MemoryFormat format = x.suggest_memory_format();
  const bool nhwc = format == at::MemoryFormat::ChannelsLast;
  at::Tensor y = at::empty({x.size(0), x.size(1), P, Q}, x.options().memory_format(format));
  const int64_t total = y.numel();
  if (total == 0) return y;
  c10::cuda::CUDAGuard guard(x.device());
  bagf::PoolParams p{};
  p.N = static_cast<int>(x.size(0));
  p.C = static_cast<int>(x.size(1));
  p.H = static_cast<int>(x.size(2));
  p.W = static_cast<int>(x.size(3));
  p.P = static_cast<int>(P);
  p.Q = static_cast<int>(Q);
  p.kh = static_cast<int>(kernel[0]);
  p.kw = static_cast<int>(kernel[1]);
  p.sh = static_cast<int>(stride[0]);
  p.sw = static_cast<int>(stride[1]);
  p.ph = static_cast<int>(padding[0]);
  p.pw = static_cast<int>(padding[1]);
  p.dh = static_cast<int>(dilation[0]);
  p.dw = static_cast<int>(dilation[1]);
  p.relu_keeps_negative_zero = relu_keeps_negative_zero ? 1 : 0;
  for (int i = 0; i < 4; ++i) {
    p.xs[i] = x.stride(i);
    p.ys[i] = y.stride(i);
  }
  const void* xp = x.data_ptr();
  void* yp = y.data_ptr();
  void* args[] = {const_cast<void**>(&xp), &yp, &p};
  constexpr int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, int64_t(1) << 20);  // (grid-stride loop)
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  BAGF_CU_CHECK(cuLaunchKernel(g_kernels[device].fn[dt][nhwc][relu ? 1 : 0], static_cast<unsigned>(blocks), 1, 1,
                               threads, 1, 1, 0, stream, args, nullptr));
  return y;
}

}  // namespace bagf_pool

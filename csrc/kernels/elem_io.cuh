// Element access of a kernel's float32 / float16 / bfloat16 tensors by dtype code DT (0, 1, 2), shared by the kernels
// that read and write any of the three through one code path (winograd_gemm.cuh, pool_epilogue.cuh). 16-bit values
// travel as unsigned short; the kernel includes nothing from torch or the CUDA headers.
#pragma once

namespace bagf {
namespace elem {

// Element i of a DT tensor, widened to fp32 (16-bit values travel as unsigned short; bf16 is fp32's upper half).
template <int DT>
__device__ __forceinline__ float load(const void* base, long long i) {
  if constexpr (DT == 0) {
    return __ldg(static_cast<const float*>(base) + i);
  } else {
    const unsigned short h = __ldg(static_cast<const unsigned short*>(base) + i);
    if constexpr (DT == 2) {
      return __uint_as_float(static_cast<unsigned>(h) << 16);
    } else {
      float f;
      asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
      return f;
    }
  }
}

// Element i of a DT tensor := v, rounded to nearest even once.
template <int DT>
__device__ __forceinline__ void store(void* base, long long i, float v) {
  if constexpr (DT == 0) {
    static_cast<float*>(base)[i] = v;
  } else {
    unsigned short h;
    if constexpr (DT == 2) {
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    } else {
      asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    }
    static_cast<unsigned short*>(base)[i] = h;
  }
}

}  // namespace elem
}  // namespace bagf

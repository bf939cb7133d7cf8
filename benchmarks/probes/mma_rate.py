"""Peak issue rate of the legacy warp-level tensor-core instruction (mma.sync) on this GPU, TF32 and FP16.

A register-only loop: each warp keeps 8 independent accumulator tiles and issues mma.sync back to back, so the
time is the tensor pipe's, not memory's. Reported as dense TFLOP/s (2 * m * n * k per instruction per warp).
It answers one question for the fp32-exact 3xTF32 GEMM: is mma.sync's TF32 rate high enough that three
products per fp32 product beat an SGEMM on the FFMA pipe (H200: ~51 TFLOP/s measured), or does it need wgmma?

    python benchmarks/probes/mma_rate.py            (needs cupy)
"""
import json
import sys

import cupy as cp

SRC = r"""
extern "C" __global__ void tf32(float* out, int iters) {
  float d[8][4] = {};
  unsigned a[4] = {threadIdx.x, threadIdx.x + 1, threadIdx.x + 2, threadIdx.x + 3}, b[2] = {threadIdx.x, 7u};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void f16(float* out, int iters) {
  float d[8][4] = {};
  unsigned a[4] = {threadIdx.x, threadIdx.x + 1, threadIdx.x + 2, threadIdx.x + 3}, b[2] = {threadIdx.x, 7u};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def main() -> int:
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90",))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "sms": sms}
    for name, k in (("tf32_m16n8k8", 8), ("f16_m16n8k16", 16)):
        fn = mod.get_function(name.split("_")[0])
        for warps in (4, 8, 16):
            blocks, threads, iters = sms * 4, 32 * warps, 4096
            out = cp.empty(blocks * threads, cp.float32)
            fn((blocks,), (threads,), (out, cp.int32(16)))
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn((blocks,), (threads,), (out, cp.int32(iters)))
            end.record()
            end.synchronize()
            ms = cp.cuda.get_elapsed_time(start, end)
            flop = 2.0 * 16 * 8 * k * 8 * iters * blocks * warps
            res[f"{name}_warps{warps}_tflops"] = flop / ms / 1e9
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

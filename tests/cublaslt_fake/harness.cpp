// CPU check of csrc/cublaslt_plan.h against tests/cublaslt_fake/fake_cublaslt.cpp (loaded as libcublasLt.so.13 from
// LD_LIBRARY_PATH): each plan formulation computes a 1x1 convolution, the preferences the heuristic gets, the entry
// and workspace the call uses, and a shape without the plan's entry is refused once and remembered. Prints one
// line per failure and "ok <n>" at the end; exit status 1 on any failure.
#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cublaslt_plan.h"

extern "C" cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
extern "C" cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
extern "C" cudaError_t cudaSetDevice(int) { return cudaSuccess; }

namespace {

int failures = 0, checks = 0;

void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

template <typename F>
F fake(const char* name) {
  void* lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_NOLOAD);
  return lib ? reinterpret_cast<F>(dlsym(lib, name)) : nullptr;
}

// One convolution through a plan of ``algo`` (workspace limit ``ws``): y against the direct sum; ``strict_c``: the
// library takes no C with a batch stride other than D's.
void conv_case(bool nhwc, bool bias, int64_t N, int algo, size_t ws, bool strict_c = false) {
  if (strict_c)
    setenv("FAKE_LT_STRICT_C", "1", 1);
  else
    unsetenv("FAKE_LT_STRICT_C");
  const int64_t C = 5, HW = 7, K = 6;
  std::mt19937 rng(static_cast<unsigned>(N * 100 + nhwc * 10 + bias));
  std::normal_distribution<float> dist;
  std::vector<float> x(N * C * HW), w(K * C), b(K), y(N * K * HW, NAN);
  for (auto* v : {&x, &w, &b})
    for (float& e : *v) e = dist(rng);
  bagf_lt::State st;
  st.nhwc = nhwc;
  st.algo = algo;
  st.max_workspace = ws;
  std::string error;
  bagf_lt::Handle h = bagf_lt::handle(0, error);
  expect(h != nullptr, "a handle: " + error);
  bagf_lt::Shape shape;
  shape.n = N;
  shape.c = C;
  shape.hw = HW;
  shape.k = K;
  shape.bias = bias;
  shape.align_x = shape.align_w = shape.align_y = shape.align_b = 256;
  const std::string label = std::string(nhwc ? "nhwc" : "nchw") + (bias ? " bias" : "") + " N=" + std::to_string(N) +
                            " algo " + std::to_string(algo) + (strict_c ? " strict C" : "");
  bagf_lt::Gemm* g = bagf_lt::resolve(st, h, shape, bias ? b.data() : nullptr, error);
  expect(g != nullptr, label + ": resolve: " + error);
  if (g == nullptr) return;
  using bagf_lt::Bias;
  const Bias want = !bias ? Bias::kNone : nhwc ? Bias::kEpilogue : strict_c && N > 1 ? Bias::kFilledD
                                                                                      : Bias::kBroadcastC;
  expect(g->bias == want, label + ": the bias mode");
  std::vector<float> broadcast;
  const void* bp = bias ? b.data() : nullptr;
  if (g->bias == Bias::kBroadcastC) {  // what bagf_ext.cpp's launch_blas_plan makes: one image's [K][HW] of the bias
    broadcast.resize(K * HW);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t p = 0; p < HW; ++p) broadcast[k * HW + p] = b[k];
    bp = broadcast.data();
  } else if (g->bias == Bias::kFilledD) {  // ... or the whole output filled with the bias first
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t p = 0; p < HW; ++p) y[(n * K + k) * HW + p] = b[k];
  }
  std::vector<char> workspace(g->workspace);
  const bagf_lt::Status s = bagf_lt::run(h, *g, x.data(), w.data(), bp, y.data(), workspace.data(), nullptr);
  expect(s == 0, label + ": run: " + bagf_lt::status_text(s));
  double worst = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t p = 0; p < HW; ++p) {
        double want = bias ? b[k] : 0.0;
        for (int64_t c = 0; c < C; ++c)
          want += static_cast<double>(w[k * C + c]) * x[nhwc ? (n * HW + p) * C + c : (n * C + c) * HW + p];
        const float got = y[nhwc ? (n * HW + p) * K + k : (n * K + k) * HW + p];
        worst = std::fmax(worst, std::fabs(got - want));
        if (std::isnan(got)) worst = INFINITY;
      }
  expect(worst < 1e-4, label + ": largest error " + std::to_string(worst));
}

}  // namespace

int main() {
  {  // the stand-in, not some real libcublasLt the loader found first
    std::string error;
    expect(bagf_lt::handle(0, error) != nullptr && fake<int (*)()>("fake_lt_heuristic_calls") != nullptr,
           "the plan loaded the stand-in library: " + error);
    if (failures) {
      std::printf("ok %d of %d\n", checks - failures, checks);
      return 1;
    }
  }
  for (bool nhwc : {false, true})
    for (bool bias : {false, true})
      for (int64_t N : {1, 3}) conv_case(nhwc, bias, N, 0, 0);
  conv_case(false, true, 3, 1, 32 << 20);  // the fake's entry 1 needs a 4 KiB workspace: the call must pass it
  conv_case(true, true, 2, 2, 0);
  conv_case(false, true, 3, 0, 0, true);  // no batch-stride-0 C: the output filled with the bias, C = D
  conv_case(false, true, 1, 0, 0, true);  // (one image: no batch, the broadcast C is taken)
  unsetenv("FAKE_LT_STRICT_C");

  auto calls = fake<int (*)()>("fake_lt_heuristic_calls");
  auto reduce = fake<uint32_t (*)()>("fake_lt_last_reduce");
  auto align = fake<uint32_t (*)(int)>("fake_lt_last_align");
  auto workspace = fake<uint64_t (*)()>("fake_lt_last_workspace");
  auto compute = fake<int (*)()>("fake_lt_last_compute");
  expect(calls && reduce && align && workspace && compute, "the fake's inspection functions");
  if (!calls || !reduce || !align || !workspace || !compute) {
    std::printf("ok %d of %d\n", checks - failures, checks);
    return 1;
  }
  std::string error;
  bagf_lt::Handle h = bagf_lt::handle(0, error);
  // preferences: the workspace limit, fp32 partial sums in 16 bits, each operand's alignment (NCHW: A is the input),
  // C's a fresh broadcast's; TF32 products in TF32 mode
  {
    bagf_lt::State st;
    st.dtype = 2;
    st.max_workspace = 1 << 20;
    bagf_lt::Shape shape{3, 8, 9, 4, true, 4, 8, 16, 2};
    const int before = calls();
    bagf_lt::resolve(st, h, shape, reinterpret_cast<const void*>(uintptr_t{2}), error);
    expect(calls() == before + 1, "one heuristic call");
    expect(reduce() == 2 && workspace() == (1 << 20) && compute() == bagf_lt::kComputeF32,
           "16-bit: fp32 partial sums, the workspace limit, fp32 compute");
    expect(align(0) == 4 && align(1) == 8 && align(2) == 256 && align(3) == 16,
           "NCHW alignments: A the input's, B the weight's, C a fresh broadcast's, D the output's");
    bagf_lt::State tf;
    tf.tf32 = true;
    tf.nhwc = true;
    bagf_lt::Shape s2{1, 8, 9, 4, false, 16, 32, 64, 256};
    bagf_lt::resolve(tf, h, s2, nullptr, error);
    expect(reduce() == 7 && compute() == bagf_lt::kComputeF32FastTF32, "fp32: any reduction; TF32 products");
    expect(align(0) == 32 && align(1) == 16 && align(2) == 64 && align(3) == 64,
           "channels_last alignments: A the weight's, B the input's, C and D the output's");
  }
  // an entry the heuristic does not list: refused with the reason, remembered (no second heuristic call)
  {
    bagf_lt::State st;
    st.algo = 5;
    bagf_lt::Shape shape{2, 8, 9, 4, false, 256, 256, 256, 256};
    std::string e1, e2;
    const int before = calls();
    expect(bagf_lt::resolve(st, h, shape, nullptr, e1) == nullptr && e1.find("offers 3") != std::string::npos,
           "entry 5 of 3: " + e1);
    expect(bagf_lt::resolve(st, h, shape, nullptr, e2) == nullptr && e2 == e1 && calls() == before + 1,
           "the refusal is remembered");
    shape.n = 3;
    st.algo = 0;
    expect(bagf_lt::resolve(st, h, shape, nullptr, e2) != nullptr, "another shape resolves: " + e2);
  }
  // a broadcast C that cublasLtMatmul refused (demote): the plan's NCHW bias GEMMs are resolved again as filled D
  {
    bagf_lt::State st;
    bagf_lt::Shape shape{3, 8, 9, 4, true, 256, 256, 256, 256};
    std::vector<float> bias(4, 1.0f);
    bagf_lt::Gemm* g = bagf_lt::resolve(st, h, shape, bias.data(), error);
    expect(g != nullptr && g->bias == bagf_lt::Bias::kBroadcastC, "a broadcast C first");
    bagf_lt::demote(st);
    expect(st.filled_bias_only && st.gemms.empty(), "demoted: broadcast-C GEMMs forgotten");
    g = bagf_lt::resolve(st, h, shape, bias.data(), error);
    expect(g != nullptr && g->bias == bagf_lt::Bias::kFilledD && g->c == nullptr, "then a filled D");
  }
  // the non-fused Winograd products in strict fp32 (resolve_sgemm / run_sgemm): each of the four row-major
  // formulations launch_gemm_plan uses equals the batched product, with fp32 compute and fp32 partial sums
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t batch = 3, m = 4, n = 5, k = 6;
      std::mt19937 rng(static_cast<unsigned>(10 * ta + tb));
      std::normal_distribution<float> dist;
      std::vector<float> A(batch * m * k), B(batch * k * n), D(batch * m * n, NAN);
      for (auto* v : {&A, &B})
        for (float& e : *v) e = dist(rng);
      bagf_lt::SgemmCache cache;
      bagf_lt::SgemmShape shape;
      shape.batch = batch;
      shape.m = m;
      shape.n = n;
      shape.k = k;
      shape.ta = ta;
      shape.tb = tb;
      shape.align = 16;
      const bagf_lt::Sgemm* g = bagf_lt::resolve_sgemm(cache, h, shape, error);
      const std::string name = std::string("sgemm ta=") + std::to_string(ta) + " tb=" + std::to_string(tb);
      expect(g != nullptr, name + " resolves: " + error);
      if (g == nullptr) continue;
      expect(compute() == bagf_lt::kComputeF32 && reduce() == 2 && workspace() == bagf_lt::kSgemmWorkspace &&
                 align(0) == 16 && align(3) == 16,
             name + ": fp32 compute and partial sums, the workspace limit, the alignment");
      expect(bagf_lt::run_sgemm(h, *g, A.data(), B.data(), D.data(), nullptr, nullptr) == 0, name + " runs");
      double worst = 0;
      for (int64_t i = 0; i < batch; ++i)
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < n; ++c) {
            double want = 0;
            for (int64_t q = 0; q < k; ++q) {
              const float a = ta ? A[i * m * k + q * m + r] : A[i * m * k + r * k + q];  // stored k x m, or m x k
              const float b = tb ? B[i * k * n + c * k + q] : B[i * k * n + q * n + c];  // stored n x k, or k x n
              want += static_cast<double>(a) * b;
            }
            worst = std::max(worst, std::fabs(want - D[i * m * n + r * n + c]));
          }
      expect(worst < 1e-4, name + ": D = op(A) op(B) per batch, row-major (worst error " + std::to_string(worst) +
                               ")");
      expect(bagf_lt::resolve_sgemm(cache, h, shape, error) == g && cache.gemms.size() == 1, name + ": kept");
    }
  std::printf("ok %d of %d\n", checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

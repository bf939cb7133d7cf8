// A stand-in for libcublasLt.so with the entry points csrc/cublaslt_plan.h binds, for a CPU test: descriptors keep
// their attributes (each attribute's size checked, as cuBLASLt checks it), the heuristic lists FAKE_LT_ALGOS
// algorithms (default 3; with FAKE_LT_STRICT_C set, none for a C whose batch stride is not D's) and records its call, and cublasLtMatmul computes D = alpha op(A) op(B) + beta C (+ the
// bias epilogue) on host memory, for float32, column- and row-major layouts, strided batches; cuBLASLt's documented
// semantics, so the plan's layouts are checked by what they compute.
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

struct Desc {
  int compute = 0, scale = 0;
  int32_t transa = 0, transb = 0;
  uint32_t epilogue = 1;
  const void* bias = nullptr;
};
struct Layout {
  int type = 0;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t order = 0, batch = 1;
  int64_t stride = 0;
};
struct Pref {
  uint64_t workspace = 0;
  uint32_t reduce = 7, align[4] = {256, 256, 256, 256};
};
struct Algo {
  uint64_t data[8];
};
struct Result {
  Algo algo;
  size_t workspace;
  int state;
  float waves;
  int reserved[4];
};

constexpr int kOk = 0, kInvalid = 7, kNotSupported = 15;
int g_handle = 0;
int g_heuristic_calls = 0;
Pref g_last_pref;
int g_last_compute = -1;

template <typename T>
int set(T& field, const void* buf, size_t size) {
  if (buf == nullptr || size != sizeof(T)) return kInvalid;
  std::memcpy(&field, buf, sizeof(T));
  return kOk;
}

// element (r, c) of one batch of a layout
float at(const Layout& l, const float* base, int64_t batch, uint64_t r, uint64_t c) {
  const int64_t off = l.order == 1 ? static_cast<int64_t>(r) * l.ld + static_cast<int64_t>(c)
                                   : static_cast<int64_t>(c) * l.ld + static_cast<int64_t>(r);
  return base[batch * l.stride + off];
}
float* at_mut(const Layout& l, float* base, int64_t batch, uint64_t r, uint64_t c) {
  const int64_t off = l.order == 1 ? static_cast<int64_t>(r) * l.ld + static_cast<int64_t>(c)
                                   : static_cast<int64_t>(c) * l.ld + static_cast<int64_t>(r);
  return base + batch * l.stride + off;
}

}  // namespace

extern "C" {

int cublasLtCreate(void** h) {
  *h = &g_handle;
  return kOk;
}
int cublasLtMatmulDescCreate(void** d, int compute, int scale) {
  Desc* desc = new Desc();
  desc->compute = compute;
  desc->scale = scale;
  *d = desc;
  return kOk;
}
int cublasLtMatmulDescSetAttribute(void* d, int attr, const void* buf, size_t size) {
  Desc* desc = static_cast<Desc*>(d);
  switch (attr) {
    case 3: return set(desc->transa, buf, size);
    case 4: return set(desc->transb, buf, size);
    case 7: return set(desc->epilogue, buf, size);
    case 8: return set(desc->bias, buf, size);
    default: return kInvalid;
  }
}
int cublasLtMatmulDescDestroy(void* d) {
  delete static_cast<Desc*>(d);
  return kOk;
}
int cublasLtMatrixLayoutCreate(void** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
  Layout* layout = new Layout();
  layout->type = type;
  layout->rows = rows;
  layout->cols = cols;
  layout->ld = ld;
  *l = layout;
  return kOk;
}
int cublasLtMatrixLayoutSetAttribute(void* l, int attr, const void* buf, size_t size) {
  Layout* layout = static_cast<Layout*>(l);
  switch (attr) {
    case 1: return set(layout->order, buf, size);
    case 5: return set(layout->batch, buf, size);
    case 6: return set(layout->stride, buf, size);
    default: return kInvalid;
  }
}
int cublasLtMatrixLayoutDestroy(void* l) {
  delete static_cast<Layout*>(l);
  return kOk;
}
int cublasLtMatmulPreferenceCreate(void** p) {
  *p = new Pref();
  return kOk;
}
int cublasLtMatmulPreferenceSetAttribute(void* p, int attr, const void* buf, size_t size) {
  Pref* pref = static_cast<Pref*>(p);
  switch (attr) {
    case 1: return set(pref->workspace, buf, size);
    case 3: return set(pref->reduce, buf, size);
    case 5: case 6: case 7: case 8: return set(pref->align[attr - 5], buf, size);
    default: return kInvalid;
  }
}
int cublasLtMatmulPreferenceDestroy(void* p) {
  delete static_cast<Pref*>(p);
  return kOk;
}
int cublasLtMatmulAlgoGetHeuristic(void*, void* d, void* a, void* b, void* c, void* dd, void* p, int requested,
                                   Result* results, int* returned) {
  ++g_heuristic_calls;
  g_last_pref = *static_cast<Pref*>(p);
  g_last_compute = static_cast<Desc*>(d)->compute;
  const Layout* ls[] = {static_cast<Layout*>(a), static_cast<Layout*>(b), static_cast<Layout*>(c),
                        static_cast<Layout*>(dd)};
  for (const Layout* l : ls)  // ld too small for the layout: cuBLASLt refuses
    if (l->ld < static_cast<int64_t>(l->order == 1 ? l->cols : l->rows)) return kInvalid;
  const Layout &lc = *ls[2], &ld = *ls[3];
  if (std::getenv("FAKE_LT_STRICT_C") && lc.batch > 1 && lc.stride != ld.stride) return kNotSupported;
  const char* env = std::getenv("FAKE_LT_ALGOS");
  const int offered = env ? std::atoi(env) : 3;
  if (offered == 0) return kNotSupported;
  const int n = offered < requested ? offered : requested;
  for (int i = 0; i < n; ++i) {
    std::memset(&results[i], 0, sizeof(Result));
    results[i].algo.data[0] = 100 + i;
    results[i].workspace = i == 1 ? 4096 : 0;
  }
  *returned = n;
  return kOk;
}
int cublasLtMatmul(void*, void* d, const void* alpha, const void* A, void* a, const void* B, void* b, const void* beta,
                   const void* C, void* c, void* D, void* dd, const Algo* algo, void*, size_t workspace, void*) {
  const Desc& desc = *static_cast<Desc*>(d);
  const Layout &la = *static_cast<Layout*>(a), &lb = *static_cast<Layout*>(b), &lc = *static_cast<Layout*>(c),
               &ld = *static_cast<Layout*>(dd);
  if (algo == nullptr || algo->data[0] < 100 || (algo->data[0] == 101 && workspace < 4096)) return kInvalid;
  if (la.type != 0 || lb.type != 0 || lc.type != 0 || ld.type != 0) return kNotSupported;  // (float32 only here)
  if (desc.epilogue == 4 && ld.order == 1) return kNotSupported;  // a bias epilogue on a row-major D, as reported
  const uint64_t m = ld.rows, n = ld.cols;
  const uint64_t k = desc.transa ? la.rows : la.cols;
  if ((desc.transa ? la.cols : la.rows) != m || (desc.transb ? lb.rows : lb.cols) != n ||
      (desc.transb ? lb.cols : lb.rows) != k || lc.rows != m || lc.cols != n || la.batch != ld.batch ||
      lb.batch != ld.batch || lc.batch != ld.batch)
    return kInvalid;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  const float* bias = static_cast<const float*>(desc.bias);
  for (int64_t i = 0; i < ld.batch; ++i)
    for (uint64_t r = 0; r < m; ++r)
      for (uint64_t col = 0; col < n; ++col) {
        double acc = 0;
        for (uint64_t q = 0; q < k; ++q) {
          const float av = desc.transa ? at(la, static_cast<const float*>(A), i, q, r)
                                       : at(la, static_cast<const float*>(A), i, r, q);
          const float bv = desc.transb ? at(lb, static_cast<const float*>(B), i, col, q)
                                       : at(lb, static_cast<const float*>(B), i, q, col);
          acc += static_cast<double>(av) * bv;
        }
        float out = static_cast<float>(al * acc);
        if (be != 0.0f) out += be * at(lc, static_cast<const float*>(C), i, r, col);
        if (desc.epilogue == 4) out += bias[r];
        *at_mut(ld, static_cast<float*>(D), i, r, col) = out;
      }
  return kOk;
}
const char* cublasLtGetStatusString(int status) { return status == 0 ? "SUCCESS" : "FAKE_ERROR"; }

// for the test harness
int fake_lt_heuristic_calls() { return g_heuristic_calls; }
uint32_t fake_lt_last_reduce() { return g_last_pref.reduce; }
uint32_t fake_lt_last_align(int i) { return g_last_pref.align[i]; }
uint64_t fake_lt_last_workspace() { return g_last_pref.workspace; }
int fake_lt_last_compute() { return g_last_compute; }
}

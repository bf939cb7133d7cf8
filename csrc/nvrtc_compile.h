// The host extension's NVRTC entry point (bagf_ext.cpp includes it), in a header of its own so that a test can build
// it on a machine without CUDA, against a stand-in NVRTC (tests/test_shutdown.py: the interpreter's shutdown while
// compiles run). Needs pybind11 (as ``py``), Python's C API and nvrtc.h. Include it in one translation unit.
#pragma once
#include <nvrtc.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // (nvrtc_compile takes a list of options)

#include <atomic>
#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace bagf_host {
namespace {  // (internal linkage: the header is included by one translation unit of a module)

// Split "a;b" into its parts (a plan's kernels: name expressions in, lowered names out).
inline std::vector<std::string> split_names(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(';', start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

// What nvrtc_run returns: ok, the cubin, the lowered names joined by ';' in the order of the name expressions, and
// NVRTC's log.
struct NvrtcResult {
  bool ok = false;
  std::string cubin, lowered, log;
};

// nvrtcDestroyProgram on every way out of nvrtc_run.
struct NvrtcProgram {
  nvrtcProgram prog = nullptr;
  ~NvrtcProgram() {
    if (prog != nullptr) nvrtcDestroyProgram(&prog);
  }
};

// Compile one template instantiation (or several, separated by ';', into one cubin) with NVRTC, touching nothing of
// Python's.
inline NvrtcResult nvrtc_run(const std::string& source, const std::vector<std::string>& names,
                             const std::vector<std::string>& options) {
  NvrtcResult out;
  NvrtcProgram holder;
  nvrtcResult r = nvrtcCreateProgram(&holder.prog, source.c_str(), "bagf_kernel.cu", 0, nullptr, nullptr);
  if (r != NVRTC_SUCCESS) {
    holder.prog = nullptr;
    out.log = std::string("nvrtcCreateProgram: ") + nvrtcGetErrorString(r);
    return out;
  }
  nvrtcProgram prog = holder.prog;
  for (const auto& n : names) nvrtcAddNameExpression(prog, n.c_str());
  std::vector<const char*> opts;
  for (const auto& o : options) opts.push_back(o.c_str());
  r = nvrtcCompileProgram(prog, static_cast<int>(opts.size()), opts.data());
  size_t log_size = 0;
  if (nvrtcGetProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    out.log.resize(log_size);
    nvrtcGetProgramLog(prog, &out.log[0]);
    out.log.resize(log_size - 1);
  }
  if (r != NVRTC_SUCCESS) {
    out.log = std::string("nvrtcCompileProgram: ") + nvrtcGetErrorString(r) + "\n" + out.log;
  } else {
    nvrtcResult rn = NVRTC_SUCCESS;
    std::string joined;
    for (size_t i = 0; i < names.size() && rn == NVRTC_SUCCESS; ++i) {
      const char* name = nullptr;
      rn = nvrtcGetLoweredName(prog, names[i].c_str(), &name);
      if (rn == NVRTC_SUCCESS) joined += (i ? ";" : "") + std::string(name);
    }
    size_t size = 0;
    nvrtcResult rs = rn == NVRTC_SUCCESS ? nvrtcGetCUBINSize(prog, &size) : rn;
    if (rs == NVRTC_SUCCESS && size > 0) {
      out.lowered = joined;
      out.cubin.resize(size);
      rs = nvrtcGetCUBIN(prog, &out.cubin[0]);
    }
    if (rs == NVRTC_SUCCESS && size > 0) {
      out.ok = true;
    } else {
      out.lowered.clear();
      out.log = std::string("nvrtcGetLoweredName/GetCUBIN: ") + nvrtcGetErrorString(rs) +
                " (is the architecture option a real sm_XX target?)\n" + out.log;
    }
  }
  return out;
}

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// NVRTC compiles that have returned in this process, and those of them that returned while the interpreter was
// finalizing (their threads parked), counted without the GIL: tests read them during shutdown.
std::atomic<long long> g_nvrtc_returned{0};
std::atomic<long long> g_nvrtc_parked{0};

inline py::tuple nvrtc_returned() { return py::make_tuple(g_nvrtc_returned.load(), g_nvrtc_parked.load()); }

// Compile with NVRTC without the GIL (NVRTC is thread-safe: candidates compile in parallel threads). Never throws for
// a bad kernel: returns (ok, cubin, lowered_names, log), so the tuner records a typed "compile" failure with the log.
//
// The compiler's threads are daemon threads, and the tuner stops waiting for a compile at its deadline, so a compile
// can still run when the interpreter shuts down. CPython before 3.14 ends a daemon thread that takes the GIL back
// during finalization with pthread_exit; unwinding out of a noexcept frame calls std::terminate, and pybind11's
// gil_scoped_release destructor (which takes the GIL back) is one: the whole process aborted. Hence the GIL is given
// away and taken back by hand in this function's body. A compile that returns while the interpreter is finalizing
// parks its thread instead of taking the GIL at all (its cubin is of no use any more); the process's end takes it.
// Should finalization begin between that check and PyEval_RestoreThread, the thread is unwound through this function
// and pybind11's dispatcher, which rethrows the forced unwind: safe as long as no RAII guard of the GIL and no
// catch (...) that swallows sits around the restore.
inline py::tuple nvrtc_compile(const std::string& source, const std::string& name_expr,
                               const std::vector<std::string>& options) {
  const std::vector<std::string> names = split_names(name_expr);
  PyThreadState* state = PyEval_SaveThread();
  NvrtcResult got;
  std::exception_ptr error;
  try {
    got = nvrtc_run(source, names, options);
  } catch (...) {  // (std::bad_alloc: nothing else here throws) rethrown below, with the GIL
    error = std::current_exception();
  }
  g_nvrtc_returned.fetch_add(1);
  if (interpreter_finalizing()) {
    g_nvrtc_parked.fetch_add(1);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(3600));
  }
  PyEval_RestoreThread(state);
  if (error) std::rethrow_exception(error);
  return py::make_tuple(got.ok, py::bytes(got.cubin), got.lowered, got.log);
}

}  // namespace
}  // namespace bagf_host

// The stand-in NVRTC of nvrtc.h beside it: every program compiles, in BAGF_STUB_COMPILE_MS milliseconds (default
// 1500), to the four bytes "cubn"; the lowered name of a name expression is the expression itself.
#include "nvrtc.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

struct _nvrtcProgram {
  int unused = 0;
};

nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char*, const char*, int, const char* const*,
                               const char* const*) {
  *prog = new _nvrtcProgram();
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcAddNameExpression(nvrtcProgram, const char*) { return NVRTC_SUCCESS; }
nvrtcResult nvrtcCompileProgram(nvrtcProgram, int, const char* const*) {
  const char* ms = std::getenv("BAGF_STUB_COMPILE_MS");
  std::this_thread::sleep_for(std::chrono::milliseconds(ms ? std::atoi(ms) : 1500));
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram, size_t* size) {
  *size = 1;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetProgramLog(nvrtcProgram, char* log) {
  log[0] = '\0';
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetLoweredName(nvrtcProgram, const char* name_expression, const char** lowered_name) {
  *lowered_name = name_expression;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram, size_t* size) {
  *size = 4;
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcGetCUBIN(nvrtcProgram, char* cubin) {
  std::memcpy(cubin, "cubn", 4);
  return NVRTC_SUCCESS;
}
nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog) {
  delete *prog;
  *prog = nullptr;
  return NVRTC_SUCCESS;
}
const char* nvrtcGetErrorString(nvrtcResult) { return "stub error"; }
nvrtcResult nvrtcVersion(int* major, int* minor) {
  *major = 0;
  *minor = 0;
  return NVRTC_SUCCESS;
}

// A stand-in for NVRTC's header: the declarations csrc/nvrtc_compile.h uses, for a test that builds it without CUDA
// (tests/test_shutdown.py). nvrtc_stub.cpp implements them: a "compile" sleeps and returns a four-byte "cubin".
#pragma once
#include <cstddef>

typedef int nvrtcResult;
typedef struct _nvrtcProgram* nvrtcProgram;
#define NVRTC_SUCCESS 0

nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char* src, const char* name, int num_headers,
                               const char* const* headers, const char* const* include_names);
nvrtcResult nvrtcAddNameExpression(nvrtcProgram prog, const char* name_expression);
nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int num_options, const char* const* options);
nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t* size);
nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char* log);
nvrtcResult nvrtcGetLoweredName(nvrtcProgram prog, const char* name_expression, const char** lowered_name);
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t* size);
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char* cubin);
nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog);
const char* nvrtcGetErrorString(nvrtcResult result);
nvrtcResult nvrtcVersion(int* major, int* minor);

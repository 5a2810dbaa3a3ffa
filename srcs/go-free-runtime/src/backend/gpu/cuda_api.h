// The few entry points of NCCL and of the CUDA runtime that kungfu uses, declared here with their
// public ABI (types, enum values, signatures) so that kungfu builds without a CUDA toolkit: the
// libraries are opened at run time (loader.h) and called through the tables of function pointers
// below. The test double (tests/gpu_double/) implements the same symbols over host memory.
//
// Why a namespace around C names: the names mirror nccl.h and cuda_runtime_api.h one for one so
// that they can be checked against NVIDIA's documentation, and the namespace keeps them from
// colliding with the real headers in a translation unit that also includes those (a framework's
// op library). Only pointers to the opaque structs cross the ABI, so their C++ names do not matter.
//
// Checked against NCCL's documented types (ncclResult_t 0..7, ncclDataType_t 0..9, ncclRedOp_t
// 0..4, NCCL_UNIQUE_ID_BYTES 128, ncclGetVersion's code major*10000 + minor*100 + patch since 2.9)
// and CUDA 12's runtime API (cudaErrorNotReady is 600 since CUDA 10.1).
#pragma once

#include <cstddef>

namespace kungfu {
namespace cuda_abi {

// ---- NCCL (nccl.h) ------------------------------------------------------------------------------

struct ncclComm;
typedef ncclComm* ncclComm_t;

constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
// Passed by value to ncclCommInitRank: the layout must be exactly NCCL's.
struct ncclUniqueId {
  char internal[kNcclUniqueIdBytes];
};
static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is 128 bytes in NCCL's ABI");

enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,  // since NCCL 2.13: a peer exited or the network failed
  ncclInProgress = 7,   // non-blocking communicators only
};

enum ncclDataType_t : int {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,  // since NCCL 2.10, built with CUDA 11 or later
};

enum ncclRedOp_t : int {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,  // since NCCL 2.10
};

// The version code ncclGetVersion reports for major.minor.patch (NCCL_VERSION in nccl.h: the
// older encoding major*1000 + minor*100 + patch holds up to 2.8).
constexpr int NcclVersionCode(int major, int minor, int patch) {
  return (major <= 2 && minor <= 8) ? major * 1000 + minor * 100 + patch
                                    : major * 10000 + minor * 100 + patch;
}

// ---- CUDA runtime (cuda_runtime_api.h, driver_types.h) ------------------------------------------

struct CUstream_st;
struct CUevent_st;
typedef CUstream_st* cudaStream_t;
typedef CUevent_st* cudaEvent_t;

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,  // cudaEventQuery: the work before the event has not completed yet
};

enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

constexpr unsigned int cudaStreamNonBlocking = 0x01;  // no implicit sync with the null stream
constexpr unsigned int cudaEventDisableTiming = 0x02;
constexpr unsigned int cudaHostAllocDefault = 0x00;

// ---- Tables of entry points ---------------------------------------------------------------------

// NCCL's entry points, each resolved by dlsym under the name in its comment.
struct NcclApi {
  ncclResult_t (*GetVersion)(int* version);       // ncclGetVersion
  ncclResult_t (*GetUniqueId)(ncclUniqueId* id);  // ncclGetUniqueId
  ncclResult_t (*CommInitRank)(ncclComm_t* comm, int nranks, ncclUniqueId id,
                               int rank);        // ncclCommInitRank
  ncclResult_t (*CommDestroy)(ncclComm_t comm);  // ncclCommDestroy
  ncclResult_t (*CommAbort)(ncclComm_t comm);    // ncclCommAbort
  ncclResult_t (*CommGetAsyncError)(ncclComm_t comm,
                                    ncclResult_t* error);  // ncclCommGetAsyncError
  const char* (*GetErrorString)(ncclResult_t result);      // ncclGetErrorString
  ncclResult_t (*AllReduce)(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                            ncclRedOp_t op, ncclComm_t comm,
                            cudaStream_t stream);  // ncclAllReduce
  ncclResult_t (*Broadcast)(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                            int root, ncclComm_t comm, cudaStream_t stream);  // ncclBroadcast
  ncclResult_t (*Reduce)(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                         ncclRedOp_t op, int root, ncclComm_t comm,
                         cudaStream_t stream);  // ncclReduce
  ncclResult_t (*AllGather)(const void* send, void* recv, size_t send_count, ncclDataType_t dtype,
                            ncclComm_t comm,
                            cudaStream_t stream);  // ncclAllGather
  ncclResult_t (*ReduceScatter)(const void* send, void* recv, size_t recv_count,
                                ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream);  // ncclReduceScatter
  ncclResult_t (*Send)(const void* send, size_t count, ncclDataType_t dtype, int peer,
                       ncclComm_t comm, cudaStream_t stream);  // ncclSend
  ncclResult_t (*Recv)(void* recv, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm,
                       cudaStream_t stream);  // ncclRecv
  ncclResult_t (*GroupStart)();               // ncclGroupStart
  ncclResult_t (*GroupEnd)();                 // ncclGroupEnd
};

// The CUDA runtime's entry points, each resolved by dlsym under the name in its comment.
struct CudartApi {
  cudaError_t (*RuntimeGetVersion)(int* version);  // cudaRuntimeGetVersion
  cudaError_t (*GetDeviceCount)(int* count);       // cudaGetDeviceCount
  cudaError_t (*GetDevice)(int* device);           // cudaGetDevice
  cudaError_t (*SetDevice)(int device);            // cudaSetDevice
  cudaError_t (*StreamCreateWithFlags)(cudaStream_t* stream,
                                       unsigned int flags);  // cudaStreamCreateWithFlags
  cudaError_t (*StreamDestroy)(cudaStream_t stream);         // cudaStreamDestroy
  cudaError_t (*StreamSynchronize)(cudaStream_t stream);     // cudaStreamSynchronize
  cudaError_t (*StreamWaitEvent)(cudaStream_t stream, cudaEvent_t event,
                                 unsigned int flags);  // cudaStreamWaitEvent
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t* event,
                                      unsigned int flags);             // cudaEventCreateWithFlags
  cudaError_t (*EventRecord)(cudaEvent_t event, cudaStream_t stream);  // cudaEventRecord
  cudaError_t (*EventQuery)(cudaEvent_t event);                        // cudaEventQuery
  cudaError_t (*EventSynchronize)(cudaEvent_t event);                  // cudaEventSynchronize
  cudaError_t (*EventDestroy)(cudaEvent_t event);                      // cudaEventDestroy
  cudaError_t (*Malloc)(void** ptr, size_t bytes);                     // cudaMalloc
  cudaError_t (*Free)(void* ptr);                                      // cudaFree
  cudaError_t (*HostAlloc)(void** ptr, size_t bytes, unsigned int flags);  // cudaHostAlloc
  cudaError_t (*FreeHost)(void* ptr);                                      // cudaFreeHost
  cudaError_t (*MemcpyAsync)(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                             cudaStream_t stream);   // cudaMemcpyAsync
  const char* (*GetErrorString)(cudaError_t error);  // cudaGetErrorString
};

}  // namespace cuda_abi
}  // namespace kungfu

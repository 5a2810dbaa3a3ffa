// The test double's arithmetic: NCCL's reductions over its data types, computed on the host.
// Written independently of the runtime's kernels (src/dtype.cc), so that a test comparing the two
// checks one against the other rather than a kernel against itself.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/gpu/cuda_api.h"

namespace kfdouble {

using namespace kungfu::cuda_abi;  // NOLINT: the ABI's C names, as the real library sees them

// Bytes per element; 0 for a code NCCL does not define.
inline size_t ElementSize(int dtype) {
  switch (dtype) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  }
  return 0;
}

inline bool ValidRedOp(int op) { return op >= ncclSum && op <= ncclAvg; }

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                            : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest, ties to even.
inline uint16_t FloatToHalfBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // 65520 and up round to infinity
  if (abs < 0x38800000u) {  // below 2^-14: a subnormal half, in units of 2^-24
    float v;
    std::memcpy(&v, &abs, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f));
  }
  uint32_t h = ((((abs >> 23) - 112) << 10) | ((abs >> 13) & 0x3ff));
  const uint32_t rest = abs & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

inline float Bf16BitsToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

template <typename T>
T Apply(T a, T b, int op) {
  switch (op) {
    case ncclProd: return static_cast<T>(a * b);
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return static_cast<T>(a + b);  // ncclSum, and ncclAvg before its division
  }
}

template <typename T>
void ReduceTyped(void* acc, const void* in, size_t n, int op) {
  T* a = static_cast<T*>(acc);
  const T* b = static_cast<const T*>(in);
  for (size_t i = 0; i < n; ++i) a[i] = Apply<T>(a[i], b[i], op);
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void Reduce16(void* acc, const void* in, size_t n, int op) {
  uint16_t* a = static_cast<uint16_t*>(acc);
  const uint16_t* b = static_cast<const uint16_t*>(in);
  for (size_t i = 0; i < n; ++i) a[i] = FromF(Apply<float>(ToF(a[i]), ToF(b[i]), op));
}

// acc[i] = acc[i] op in[i]; in the type's own precision, 16-bit floats rounded once per step.
inline void ReduceInto(void* acc, const void* in, size_t n, int dtype, int op) {
  switch (dtype) {
    case ncclInt8: return ReduceTyped<int8_t>(acc, in, n, op);
    case ncclUint8: return ReduceTyped<uint8_t>(acc, in, n, op);
    case ncclInt32: return ReduceTyped<int32_t>(acc, in, n, op);
    case ncclUint32: return ReduceTyped<uint32_t>(acc, in, n, op);
    case ncclInt64: return ReduceTyped<int64_t>(acc, in, n, op);
    case ncclUint64: return ReduceTyped<uint64_t>(acc, in, n, op);
    case ncclFloat16: return Reduce16<HalfBitsToFloat, FloatToHalfBits>(acc, in, n, op);
    case ncclBfloat16: return Reduce16<Bf16BitsToFloat, FloatToBf16Bits>(acc, in, n, op);
    case ncclFloat32: return ReduceTyped<float>(acc, in, n, op);
    case ncclFloat64: return ReduceTyped<double>(acc, in, n, op);
  }
}

template <typename T>
void DivideTyped(void* acc, size_t n, int by) {
  T* a = static_cast<T*>(acc);
  for (size_t i = 0; i < n; ++i) a[i] = static_cast<T>(a[i] / static_cast<T>(by));
}

// ncclAvg's last step: acc[i] /= by (integers truncate).
inline void DivideBy(void* acc, size_t n, int dtype, int by) {
  uint16_t* h = static_cast<uint16_t*>(acc);
  switch (dtype) {
    case ncclInt8: return DivideTyped<int8_t>(acc, n, by);
    case ncclUint8: return DivideTyped<uint8_t>(acc, n, by);
    case ncclInt32: return DivideTyped<int32_t>(acc, n, by);
    case ncclUint32: return DivideTyped<uint32_t>(acc, n, by);
    case ncclInt64: return DivideTyped<int64_t>(acc, n, by);
    case ncclUint64: return DivideTyped<uint64_t>(acc, n, by);
    case ncclFloat32: return DivideTyped<float>(acc, n, by);
    case ncclFloat64: return DivideTyped<double>(acc, n, by);
    case ncclFloat16:
      for (size_t i = 0; i < n; ++i) h[i] = FloatToHalfBits(HalfBitsToFloat(h[i]) / by);
      return;
    case ncclBfloat16:
      for (size_t i = 0; i < n; ++i) h[i] = FloatToBf16Bits(Bf16BitsToFloat(h[i]) / by);
      return;
  }
}

}  // namespace kfdouble

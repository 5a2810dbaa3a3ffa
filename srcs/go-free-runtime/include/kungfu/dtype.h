// Element types and reduction operators, and the reduce kernels over them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "kungfu/status.h"

namespace kungfu {

// Codes are part of the wire format and of the Python binding: never renumber.
enum class DType : uint8_t {
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kUInt8 = 5,
  kUInt16 = 6,
  kUInt32 = 7,
  kUInt64 = 8,
  kFloat16 = 9,
  kBFloat16 = 10,
  kFloat32 = 11,
  kFloat64 = 12,
  kBool = 13,
};

enum class ReduceOp : uint8_t { kSum = 1, kMin = 2, kMax = 3, kProd = 4 };

// Size in bytes of one element; 0 for an unknown code.
size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);
const char* ReduceOpName(ReduceOp op);
bool IsValidDType(int code);
bool IsValidReduceOp(int code);

// Whether `op` is defined on `dtype` (bool: min and max only).
Status CheckReducible(DType dtype, ReduceOp op);

// dst[i] = a[i] op b[i] for i < count. dst may alias a or b. float16 and bfloat16 are computed
// in float32 and rounded to nearest even once per element.
void Reduce(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

// The mean of 16-bit floats (float16, bfloat16), whose sum in their own type overflows where
// the mean fits (two peers' 40000.0 in float16: the sum 80000 is inf, the mean 40000 is not):
// each peer's values are widened to float32 and divided by the number of peers `n` there
// (WidenHalfPart: scaled first, since float32 has bfloat16's range and a sum of bfloat16 near
// its largest overflows float32 too), the parts summed as float32 and rounded back once per
// element (NarrowHalf). Peer::AllReduce and Reduce do that for OpOptions::average.
bool IsHalfFloat(DType dtype);
void WidenHalfPart(float* dst, const void* src, size_t count, int n, DType dtype);
void NarrowHalf(void* dst, const float* src, size_t count, DType dtype);

// Conversions used by the kernels, exposed for tests.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace kungfu

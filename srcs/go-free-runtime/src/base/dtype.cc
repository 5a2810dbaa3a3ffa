#include "kungfu/dtype.h"

#include <type_traits>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kungfu {

namespace {
const char kUnknownName[] = "unknown";
}  // namespace

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool: return 1;
    case DType::kInt16:
    case DType::kUInt16:
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt32:
    case DType::kUInt32:
    case DType::kFloat32: return 4;
    case DType::kInt64:
    case DType::kUInt64:
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kUInt16: return "uint16";
    case DType::kUInt32: return "uint32";
    case DType::kUInt64: return "uint64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBool: return "bool";
  }
  return kUnknownName;
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProd: return "prod";
  }
  return kUnknownName;
}

// Both follow the name tables above, whose switches name every code (the compiler warns of one
// left out), so a new dtype or reduce op moves no bound.
bool IsValidDType(int code) {
  return code >= 1 && code <= 0xff && DTypeName(static_cast<DType>(code)) != kUnknownName;
}
bool IsValidReduceOp(int code) {
  return code >= 1 && code <= 0xff && ReduceOpName(static_cast<ReduceOp>(code)) != kUnknownName;
}

Status CheckReducible(DType dtype, ReduceOp op) {
  if (!IsValidDType(static_cast<int>(dtype))) return InvalidArgument("unknown dtype code");
  if (!IsValidReduceOp(static_cast<int>(op))) return InvalidArgument("unknown reduce op code");
  if (dtype == DType::kBool && (op == ReduceOp::kSum || op == ReduceOp::kProd)) {
    return InvalidArgument(std::string("reduce op '") + ReduceOpName(op) +
                           "' is not defined for bool (use min or max)");
  }
  return Status::OK();
}

// IEEE 754 binary16 <-> binary32, round to nearest even.
float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | (exp + 127 - 15) << 23 | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00);  // overflow -> inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e;  // 14 + (113 - e) - 1
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs >> 13) - (112u << 10));
  uint32_t rem = abs & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return static_cast<uint16_t>(sign | half);
}

float BFloat16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
  uint32_t rounding = 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

bool IsHalfFloat(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

void WidenHalfPart(float* dst, const void* src, size_t count, int n, DType dtype) {
  const uint16_t* x = static_cast<const uint16_t*>(src);
  float (*to_float)(uint16_t) = dtype == DType::kFloat16 ? HalfToFloat : BFloat16ToFloat;
  const float size = static_cast<float>(n);
  for (size_t i = 0; i < count; ++i) dst[i] = to_float(x[i]) / size;
}

void NarrowHalf(void* dst, const float* src, size_t count, DType dtype) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  uint16_t (*from_float)(float) = dtype == DType::kFloat16 ? FloatToHalf : FloatToBFloat16;
  for (size_t i = 0; i < count; ++i) d[i] = from_float(src[i]);
}

namespace {

// Integers wrap around (two's complement), as numpy's do: computed in an unsigned type at least
// as wide as int, since signed overflow, and unsigned short * unsigned short (promoted to int),
// are undefined behaviour.
template <typename T>
using Wrap = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <typename T, ReduceOp kOp>
inline __attribute__((always_inline)) T Apply(T a, T b) {
  if constexpr (std::is_integral_v<T> && (kOp == ReduceOp::kSum || kOp == ReduceOp::kProd)) {
    const Wrap<T> x = static_cast<Wrap<T>>(a), y = static_cast<Wrap<T>>(b);
    return static_cast<T>(kOp == ReduceOp::kSum ? x + y : x * y);
  }
  if constexpr (kOp == ReduceOp::kSum) return static_cast<T>(a + b);
  if constexpr (kOp == ReduceOp::kProd) return static_cast<T>(a * b);
  // NaN wins min and max (as numpy's minimum/maximum and NCCL): b < a and a < b are both false
  // when either is NaN, so `b != b` picks a NaN b; a NaN a is kept by the comparison.
  if constexpr (kOp == ReduceOp::kMin) return (b < a || b != b) ? b : a;
  if constexpr (kOp == ReduceOp::kMax) return (a < b || b != b) ? b : a;
}

// Separate in-place and out-of-place loops, so that both vectorise without run-time alias checks
// (all four ops are commutative, so dst == b is the in-place case too).
template <typename T, ReduceOp kOp>
inline __attribute__((always_inline)) void Loop(T* dst, const T* a, const T* b, size_t n) {
  if (dst == a || dst == b) {
    T* __restrict__ d = dst;
    const T* __restrict__ y = dst == a ? b : a;
    for (size_t i = 0; i < n; ++i) d[i] = Apply<T, kOp>(d[i], y[i]);
    return;
  }
  T* __restrict__ d = dst;
  const T* __restrict__ x = a;
  const T* __restrict__ y = b;
  for (size_t i = 0; i < n; ++i) d[i] = Apply<T, kOp>(x[i], y[i]);
}

template <typename T>
inline __attribute__((always_inline)) void ReduceTyped(void* dst, const void* a, const void* b,
                                                       size_t n, ReduceOp op) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  switch (op) {
    case ReduceOp::kSum: Loop<T, ReduceOp::kSum>(d, x, y, n); break;
    case ReduceOp::kMin: Loop<T, ReduceOp::kMin>(d, x, y, n); break;
    case ReduceOp::kMax: Loop<T, ReduceOp::kMax>(d, x, y, n); break;
    case ReduceOp::kProd: Loop<T, ReduceOp::kProd>(d, x, y, n); break;
  }
}

// The hot kernels get an AVX2 clone chosen at load time; the default clone runs anywhere.
#ifdef KUNGFU_NO_CLONES  // sanitizer builds
#define KF_CLONES
#else
#define KF_CLONES __attribute__((target_clones("avx2", "default")))
#endif

KF_CLONES void ReduceF32(void* d, const void* a, const void* b, size_t n, ReduceOp op) {
  ReduceTyped<float>(d, a, b, n, op);
}
KF_CLONES void ReduceF64(void* d, const void* a, const void* b, size_t n, ReduceOp op) {
  ReduceTyped<double>(d, a, b, n, op);
}
KF_CLONES void ReduceI32(void* d, const void* a, const void* b, size_t n, ReduceOp op) {
  ReduceTyped<int32_t>(d, a, b, n, op);
}
KF_CLONES void ReduceI64(void* d, const void* a, const void* b, size_t n, ReduceOp op) {
  ReduceTyped<int64_t>(d, a, b, n, op);
}

// 16-bit floats are computed in float32 and rounded once per element. The op is a template
// argument, so the loop holds no switch.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float), ReduceOp kOp>
void HalfLoop(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = FromFloat(Apply<float, kOp>(ToFloat(x[i]), ToFloat(y[i])));
}

#if defined(__x86_64__)
// float16 with the F16C conversions, 8 elements at a time: the same float32 arithmetic and the
// same rounding (to nearest even, overflow to inf) as HalfToFloat/FloatToHalf, about 20x faster
// (25M elements at np=2: 437 ms before, see benchmarks/compression.py). d may be x or y: each
// block is loaded before it is stored.
template <ReduceOp kOp>
__attribute__((target("avx,f16c"))) void HalfLoopF16C(uint16_t* d, const uint16_t* x,
                                                      const uint16_t* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 u = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + i)));
    __m256 r;
    if constexpr (kOp == ReduceOp::kSum) {
      r = _mm256_add_ps(u, v);
    } else if constexpr (kOp == ReduceOp::kProd) {
      r = _mm256_mul_ps(u, v);
    } else {  // as Apply: v where (min: v < u, max: u < v) or v is NaN, else u
      const __m256 less =
          kOp == ReduceOp::kMin ? _mm256_cmp_ps(v, u, _CMP_LT_OQ) : _mm256_cmp_ps(u, v, _CMP_LT_OQ);
      r = _mm256_blendv_ps(u, v, _mm256_or_ps(less, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
  }
  HalfLoop<HalfToFloat, FloatToHalf, kOp>(d + i, x + i, y + i, n - i);
}

bool HasF16C() {
  // F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports knows no "f16c"; AVX
  // (whose registers the conversions use) through the builtin, which also asks the OS.
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0 &&
           __builtin_cpu_supports("avx");
  }();
  return yes;
}
#endif

template <ReduceOp kOp>
void ReduceHalf(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n) {
#if defined(__x86_64__)
  if (HasF16C()) return HalfLoopF16C<kOp>(d, x, y, n);
#endif
  HalfLoop<HalfToFloat, FloatToHalf, kOp>(d, x, y, n);
}

template <ReduceOp kOp>
void ReduceBFloat16(uint16_t* d, const uint16_t* x, const uint16_t* y, size_t n) {
  HalfLoop<BFloat16ToFloat, FloatToBFloat16, kOp>(d, x, y, n);
}

template <void (*Sum)(uint16_t*, const uint16_t*, const uint16_t*, size_t),
          void (*Min)(uint16_t*, const uint16_t*, const uint16_t*, size_t),
          void (*Max)(uint16_t*, const uint16_t*, const uint16_t*, size_t),
          void (*Prod)(uint16_t*, const uint16_t*, const uint16_t*, size_t)>
void Reduce16(void* dst, const void* a, const void* b, size_t n, ReduceOp op) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  switch (op) {
    case ReduceOp::kSum: Sum(d, x, y, n); break;
    case ReduceOp::kMin: Min(d, x, y, n); break;
    case ReduceOp::kMax: Max(d, x, y, n); break;
    case ReduceOp::kProd: Prod(d, x, y, n); break;
  }
}

}  // namespace

void Reduce(void* dst, const void* a, const void* b, size_t n, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kFloat32: ReduceF32(dst, a, b, n, op); return;
    case DType::kFloat64: ReduceF64(dst, a, b, n, op); return;
    case DType::kInt32: ReduceI32(dst, a, b, n, op); return;
    case DType::kInt64: ReduceI64(dst, a, b, n, op); return;
    case DType::kInt8: ReduceTyped<int8_t>(dst, a, b, n, op); return;
    case DType::kInt16: ReduceTyped<int16_t>(dst, a, b, n, op); return;
    case DType::kUInt8: ReduceTyped<uint8_t>(dst, a, b, n, op); return;
    case DType::kUInt16: ReduceTyped<uint16_t>(dst, a, b, n, op); return;
    case DType::kUInt32: ReduceTyped<uint32_t>(dst, a, b, n, op); return;
    case DType::kUInt64: ReduceTyped<uint64_t>(dst, a, b, n, op); return;
    case DType::kBool: ReduceTyped<uint8_t>(dst, a, b, n, op); return;  // min = and, max = or
    case DType::kFloat16:
      Reduce16<ReduceHalf<ReduceOp::kSum>, ReduceHalf<ReduceOp::kMin>, ReduceHalf<ReduceOp::kMax>,
               ReduceHalf<ReduceOp::kProd>>(dst, a, b, n, op);
      return;
    case DType::kBFloat16:
      Reduce16<ReduceBFloat16<ReduceOp::kSum>, ReduceBFloat16<ReduceOp::kMin>,
               ReduceBFloat16<ReduceOp::kMax>, ReduceBFloat16<ReduceOp::kProd>>(dst, a, b, n, op);
      return;
  }
  KF_CHECK(false && "unknown dtype");
}

}  // namespace kungfu

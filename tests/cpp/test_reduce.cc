// Reduce kernels and the float16 / bfloat16 conversions, against naive references written here
// (the references use double arithmetic, not the runtime's bit tricks).
#include <cfenv>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kungfu/dtype.h"
#include "testing.h"

using kungfu::DType;
using kungfu::ReduceOp;

namespace {

const DType kAllDTypes[] = {DType::kInt8,    DType::kInt16,    DType::kInt32,   DType::kInt64,
                            DType::kUInt8,   DType::kUInt16,   DType::kUInt32,  DType::kUInt64,
                            DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64,
                            DType::kBool};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd};

// ---- Reference float formats ------------------------------------------------------------------

// A binary format with `mant_bits` stored mantissa bits, `exp_bits` exponent bits and
// subnormals, decoded by the textbook formula.
struct Format {
  int mant_bits;
  int exp_bits;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  int emin() const { return 1 - bias(); }
  double max_finite() const {
    return std::ldexp(2.0 - std::ldexp(1.0, -mant_bits), bias());
  }
};
constexpr Format kHalf{10, 5};
constexpr Format kBF16{7, 8};

double Decode(uint16_t bits, Format f) {
  const int sign = bits >> 15;
  const int exp = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int mant = bits & ((1 << f.mant_bits) - 1);
  double v;
  if (exp == (1 << f.exp_bits) - 1) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), f.emin() - f.mant_bits);
  } else {
    v = std::ldexp(static_cast<double>(mant + (1 << f.mant_bits)), exp - f.bias() - f.mant_bits);
  }
  return sign ? -v : v;
}

// Decode through a table (the reduce references decode millions of elements).
double DecodeCached(uint16_t bits, Format f) {
  static const std::vector<double> half = [] {
    std::vector<double> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = Decode(static_cast<uint16_t>(i), kHalf);
    return t;
  }();
  static const std::vector<double> bf16 = [] {
    std::vector<double> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = Decode(static_cast<uint16_t>(i), kBF16);
    return t;
  }();
  return f.exp_bits == kHalf.exp_bits ? half[bits] : bf16[bits];
}

bool IsNaNBits(uint16_t bits, Format f) {
  const int exp = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int mant = bits & ((1 << f.mant_bits) - 1);
  return exp == (1 << f.exp_bits) - 1 && mant != 0;
}

// x rounded to the format, to nearest with ties to even, overflowing to infinity.
double RoundTo(double x, Format f) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  const double a = std::fabs(x);
  int e2;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  const int e = std::max(e2 - 1, f.emin());
  const double quantum = std::ldexp(1.0, e - f.mant_bits);
  const double n = std::nearbyint(a / quantum);  // exact division; ties to even
  double r = n * quantum;
  if (r > f.max_finite()) r = std::numeric_limits<double>::infinity();
  return x < 0 ? -r : r;
}

float BitsToFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
uint32_t FloatToBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Same value, NaN matching NaN. +0 and -0 compare equal unless `strict_zero`.
bool SameValue(double got, double want, bool strict_zero = true) {
  if (std::isnan(want)) return std::isnan(got);
  if (got != want) return false;
  return !strict_zero || want != 0 || std::signbit(got) == std::signbit(want);
}

// ---- Naive reference reduction -----------------------------------------------------------------

template <typename T>
T RefApplyInt(T a, T b, ReduceOp op) {
  // Wrap-around arithmetic, computed without signed overflow.
  using U = std::make_unsigned_t<T>;
  switch (op) {
    case ReduceOp::kSum: return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    case ReduceOp::kProd: {
      // Promote narrow types so the multiplication itself cannot overflow int.
      using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
      return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
    }
    case ReduceOp::kMin: return a < b ? a : b;
    case ReduceOp::kMax: return a < b ? b : a;
  }
  return 0;
}

template <typename F>
F RefApplyFloat(F a, F b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMin: return std::fmin(a, b);
    case ReduceOp::kMax: return std::fmax(a, b);
  }
  return 0;
}

// Random elements of a dtype, as raw bytes. Floats are finite and not NaN (min/max of NaN is not
// specified); bools are 0 or 1.
std::vector<uint8_t> RandomData(DType dt, size_t n, std::mt19937_64& rng) {
  const size_t es = kungfu::DTypeSize(dt);
  std::vector<uint8_t> v(n * es);
  for (size_t i = 0; i < n; ++i) {
    uint8_t* p = v.data() + i * es;
    uint64_t r = rng();
    switch (dt) {
      case DType::kBool: p[0] = r & 1; break;
      case DType::kFloat16: {
        uint16_t h;
        do {
          h = static_cast<uint16_t>(r);
          r = rng();
        } while (((h >> 10) & 0x1f) == 0x1f);
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::kBFloat16: {
        // Mostly moderate exponents so sums and products stay interesting, some anywhere.
        uint16_t b = static_cast<uint16_t>(r);
        if ((r >> 16) % 4 != 0) b = static_cast<uint16_t>((b & 0x807f) | ((0x70 + (r >> 20) % 32) << 7));
        if (((b >> 7) & 0xff) == 0xff) b &= 0xbfff;
        std::memcpy(p, &b, 2);
        break;
      }
      case DType::kFloat32: {
        float f = (r & 1) ? static_cast<float>(static_cast<int64_t>(r >> 40) - (1 << 23)) / 1024.0f
                          : BitsToFloat(static_cast<uint32_t>(r >> 8));
        if (std::isnan(f) || std::isinf(f)) f = 1.5f;
        std::memcpy(p, &f, 4);
        break;
      }
      case DType::kFloat64: {
        double d;
        if (r & 1) {
          d = static_cast<double>(static_cast<int64_t>(r >> 20) - (int64_t(1) << 43)) / 4096.0;
        } else {
          uint64_t bits = rng();
          std::memcpy(&d, &bits, 8);
          if (std::isnan(d) || std::isinf(d)) d = -2.25;
        }
        std::memcpy(p, &d, 8);
        break;
      }
      default:
        // Integers: full range, with some small values so products do not always wrap to 0.
        if ((r & 3) == 0) r = (r >> 8) % 17 - 8;
        std::memcpy(p, &r, es);
        break;
    }
  }
  return v;
}

// Expected out[i] = a[i] op b[i] for one element, compared against `got`. On a mismatch returns
// false and describes it in *why.
bool ElementMatches(DType dt, ReduceOp op, const uint8_t* a, const uint8_t* b, const uint8_t* got,
                    std::string* why) {
  auto show = [](auto x) { return kftest::Show(x); };
  switch (dt) {
#define KF_INT_CASE(D, T)                                                                  \
  case D: {                                                                                \
    T x, y, g;                                                                             \
    std::memcpy(&x, a, sizeof(T));                                                         \
    std::memcpy(&y, b, sizeof(T));                                                         \
    std::memcpy(&g, got, sizeof(T));                                                      \
    T want = RefApplyInt<T>(x, y, op);                                                     \
    if (g == want) return true;                                                            \
    *why = show(x) + " op " + show(y) + " = " + show(g) + ", want " + show(want);          \
    return false;                                                                          \
  }
    KF_INT_CASE(DType::kInt8, int8_t)
    KF_INT_CASE(DType::kInt16, int16_t)
    KF_INT_CASE(DType::kInt32, int32_t)
    KF_INT_CASE(DType::kInt64, int64_t)
    KF_INT_CASE(DType::kUInt8, uint8_t)
    KF_INT_CASE(DType::kUInt16, uint16_t)
    KF_INT_CASE(DType::kUInt32, uint32_t)
    KF_INT_CASE(DType::kUInt64, uint64_t)
#undef KF_INT_CASE
    case DType::kBool: {
      bool want = op == ReduceOp::kMin ? (a[0] && b[0]) : (a[0] || b[0]);
      if (got[0] == static_cast<uint8_t>(want)) return true;
      *why = show(a[0]) + " op " + show(b[0]) + " = " + show(got[0]) + ", want " + show(want);
      return false;
    }
    case DType::kFloat32: {
      float x, y, g;
      std::memcpy(&x, a, 4);
      std::memcpy(&y, b, 4);
      std::memcpy(&g, got, 4);
      float want = RefApplyFloat<float>(x, y, op);
      // min/max of +0 and -0 may return either zero.
      if (SameValue(g, want, op == ReduceOp::kSum || op == ReduceOp::kProd)) return true;
      *why = show(x) + " op " + show(y) + " = " + show(g) + ", want " + show(want);
      return false;
    }
    case DType::kFloat64: {
      double x, y, g;
      std::memcpy(&x, a, 8);
      std::memcpy(&y, b, 8);
      std::memcpy(&g, got, 8);
      double want = RefApplyFloat<double>(x, y, op);
      if (SameValue(g, want, op == ReduceOp::kSum || op == ReduceOp::kProd)) return true;
      *why = show(x) + " op " + show(y) + " = " + show(g) + ", want " + show(want);
      return false;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      const Format f = dt == DType::kFloat16 ? kHalf : kBF16;
      uint16_t x, y, g;
      std::memcpy(&x, a, 2);
      std::memcpy(&y, b, 2);
      std::memcpy(&g, got, 2);
      // Documented: computed in float32, rounded once to the narrow type.
      float fx = static_cast<float>(DecodeCached(x, f)), fy = static_cast<float>(DecodeCached(y, f));
      float r = RefApplyFloat<float>(fx, fy, op);
      double want = RoundTo(r, f);
      if (SameValue(DecodeCached(g, f), want, op == ReduceOp::kSum || op == ReduceOp::kProd)) return true;
      *why = show(Decode(x, f)) + " op " + show(Decode(y, f)) + " = " + show(Decode(g, f)) +
             ", want " + show(want);
      return false;
    }
  }
  *why = "unknown dtype";
  return false;
}

enum class Alias { kNone, kDstIsA, kDstIsB };

constexpr size_t kPad = 64;  // elements after the reduced range that must stay untouched

// Runs Reduce on n elements in one aliasing mode, at an element offset (to test unaligned
// pointers), and checks every element and that nothing outside the range was written. The inputs
// hold at least n + offset + kPad elements.
void CheckReduce(DType dt, ReduceOp op, size_t n, Alias alias, size_t offset,
                 const std::vector<uint8_t>& a0, const std::vector<uint8_t>& b0) {
  const size_t es = kungfu::DTypeSize(dt);
  const size_t pad = kPad;
  std::vector<uint8_t> a = a0, b = b0;
  std::vector<uint8_t> out(a.size(), 0xA5);
  const std::vector<uint8_t> out0 = out;
  uint8_t* pa = a.data() + offset * es;
  uint8_t* pb = b.data() + offset * es;
  uint8_t* dst = alias == Alias::kDstIsA ? pa : alias == Alias::kDstIsB ? pb : out.data() + offset * es;
  kungfu::Reduce(dst, pa, pb, n, dt, op);
  const char* mode = alias == Alias::kNone ? "out-of-place" : alias == Alias::kDstIsA ? "dst==a" : "dst==b";
  std::string where = std::string(kungfu::DTypeName(dt)) + " " + kungfu::ReduceOpName(op) + " n=" +
                      std::to_string(n) + " " + mode + " offset=" + std::to_string(offset);
  int reported = 0;
  for (size_t i = 0; i < n; ++i) {
    std::string m;
    if (!ElementMatches(dt, op, a0.data() + (offset + i) * es, b0.data() + (offset + i) * es,
                        dst + i * es, &m) &&
        reported++ < 3) {
      kftest::ReportFailure(__FILE__, __LINE__, where + " element " + std::to_string(i) + ": " + m);
    }
  }
  // Bytes outside [dst, dst + n) untouched; inputs not aliased by dst unchanged.
  const std::vector<uint8_t>& dst_orig = alias == Alias::kDstIsA ? a0 : alias == Alias::kDstIsB ? b0 : out0;
  CHECK(a.size() >= (offset + n + pad) * es);
  const std::vector<uint8_t>& dst_vec = alias == Alias::kDstIsA ? a : alias == Alias::kDstIsB ? b : out;
  CHECK_MSG(std::memcmp(dst_vec.data(), dst_orig.data(), offset * es) == 0, where + ": wrote before dst");
  CHECK_MSG(std::memcmp(dst_vec.data() + (offset + n) * es, dst_orig.data() + (offset + n) * es,
                        pad * es) == 0,
            where + ": wrote past the end");
  if (alias != Alias::kDstIsA) CHECK_MSG(a == a0, where + ": input a modified");
  if (alias != Alias::kDstIsB) CHECK_MSG(b == b0, where + ": input b modified");
}

bool Reducible(DType dt, ReduceOp op) {
  return !(dt == DType::kBool && (op == ReduceOp::kSum || op == ReduceOp::kProd));
}

}  // namespace

// ---- Reduce kernels ----------------------------------------------------------------------------

TEST(ReduceEveryDTypeAndOpSmallLengths) {
  std::mt19937_64 rng(1);
  const size_t lengths[] = {0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 1001};
  for (DType dt : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      if (!Reducible(dt, op)) continue;
      for (size_t n : lengths) {
        const std::vector<uint8_t> a = RandomData(dt, n + 1 + kPad, rng);
        const std::vector<uint8_t> b = RandomData(dt, n + 1 + kPad, rng);
        for (Alias alias : {Alias::kNone, Alias::kDstIsA, Alias::kDstIsB}) {
          CheckReduce(dt, op, n, alias, 0, a, b);
          CheckReduce(dt, op, n, alias, 1, a, b);  // unaligned
        }
      }
    }
  }
}

TEST(ReduceEveryDTypeAndOpLarge) {
  std::mt19937_64 rng(2);
  const size_t n = 1000003;
  for (DType dt : kAllDTypes) {
    const std::vector<uint8_t> a = RandomData(dt, n + kPad, rng);
    const std::vector<uint8_t> b = RandomData(dt, n + kPad, rng);
    for (ReduceOp op : kAllOps) {
      if (!Reducible(dt, op)) continue;
      for (Alias alias : {Alias::kNone, Alias::kDstIsA, Alias::kDstIsB}) {
        CheckReduce(dt, op, n, alias, 0, a, b);
      }
    }
  }
}

TEST(ReduceZeroLengthTouchesNothing) {
  for (DType dt : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      if (!Reducible(dt, op)) continue;
      kungfu::Reduce(nullptr, nullptr, nullptr, 0, dt, op);  // must not dereference
      uint64_t a = 1, b = 2, d = 3;
      kungfu::Reduce(&d, &a, &b, 0, dt, op);
      CHECK_EQ(d, uint64_t(3));
    }
  }
}

TEST(ReduceSpecificValues) {
  // A few hand-computed results, independent of the reference code above.
  {
    int8_t a[3] = {100, -128, 5}, b[3] = {100, -1, -7}, d[3];
    kungfu::Reduce(d, a, b, 3, DType::kInt8, ReduceOp::kSum);
    CHECK_EQ(d[0], int8_t(-56));  // wraps
    CHECK_EQ(d[1], int8_t(127));
    CHECK_EQ(d[2], int8_t(-2));
    kungfu::Reduce(d, a, b, 3, DType::kInt8, ReduceOp::kMin);
    CHECK_EQ(d[0], int8_t(100));
    CHECK_EQ(d[1], int8_t(-128));
    CHECK_EQ(d[2], int8_t(-7));
  }
  {
    uint32_t a[2] = {0xffffffffu, 3}, b[2] = {2, 0x80000000u}, d[2];
    kungfu::Reduce(d, a, b, 2, DType::kUInt32, ReduceOp::kSum);
    CHECK_EQ(d[0], 1u);
    CHECK_EQ(d[1], 0x80000003u);
    kungfu::Reduce(d, a, b, 2, DType::kUInt32, ReduceOp::kMax);  // unsigned compare
    CHECK_EQ(d[0], 0xffffffffu);
    CHECK_EQ(d[1], 0x80000000u);
  }
  {
    int64_t a[2] = {-5, int64_t(1) << 40}, b[2] = {3, -(int64_t(1) << 41)}, d[2];
    kungfu::Reduce(d, a, b, 2, DType::kInt64, ReduceOp::kProd);
    CHECK_EQ(d[0], int64_t(-15));
    kungfu::Reduce(d, a, b, 2, DType::kInt64, ReduceOp::kMin);
    CHECK_EQ(d[1], -(int64_t(1) << 41));
  }
  {
    uint8_t a[4] = {0, 0, 1, 1}, b[4] = {0, 1, 0, 1}, d[4];
    kungfu::Reduce(d, a, b, 4, DType::kBool, ReduceOp::kMin);
    CHECK(d[0] == 0 && d[1] == 0 && d[2] == 0 && d[3] == 1);
    kungfu::Reduce(d, a, b, 4, DType::kBool, ReduceOp::kMax);
    CHECK(d[0] == 0 && d[1] == 1 && d[2] == 1 && d[3] == 1);
  }
  {
    // float16: 1 + 2^-11 is a tie between 1 and 1 + 2^-10: rounds to even (1).
    uint16_t a[3] = {0x3c00, 0x7bff, 0x3c01}, b[3] = {0x1000 /* 2^-11 */, 0x7bff, 0x1000}, d[3];
    kungfu::Reduce(d, a, b, 3, DType::kFloat16, ReduceOp::kSum);
    CHECK_EQ(d[0], uint16_t(0x3c00));
    CHECK_EQ(d[1], uint16_t(0x7c00));  // 65504 + 65504 overflows to inf
    CHECK_EQ(d[2], uint16_t(0x3c02));  // (1 + 2^-10) + 2^-11: tie, rounds up to even
  }
  {
    // bfloat16: 1 + 1 = 2, 3 * -2 = -6.
    uint16_t a[2] = {0x3f80, 0x4040}, b[2] = {0x3f80, 0xc000}, d[2];
    kungfu::Reduce(d, a, b, 1, DType::kBFloat16, ReduceOp::kSum);
    CHECK_EQ(d[0], uint16_t(0x4000));
    kungfu::Reduce(d + 1, a + 1, b + 1, 1, DType::kBFloat16, ReduceOp::kProd);
    CHECK_EQ(d[1], uint16_t(0xc0c0));
  }
}

TEST(CheckReducible) {
  for (DType dt : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      kungfu::Status s = kungfu::CheckReducible(dt, op);
      if (Reducible(dt, op)) {
        CHECK_OK(s);
      } else {
        CHECK_CODE(s, kungfu::Code::kInvalidArgument);
        CHECK_CONTAINS(s.message(), "bool");
        CHECK_CONTAINS(s.message(), kungfu::ReduceOpName(op));
      }
    }
  }
  CHECK_CODE(kungfu::CheckReducible(static_cast<DType>(0), ReduceOp::kSum), kungfu::Code::kInvalidArgument);
  CHECK_CODE(kungfu::CheckReducible(static_cast<DType>(14), ReduceOp::kSum), kungfu::Code::kInvalidArgument);
  CHECK_CODE(kungfu::CheckReducible(DType::kFloat32, static_cast<ReduceOp>(0)), kungfu::Code::kInvalidArgument);
  CHECK_CODE(kungfu::CheckReducible(DType::kFloat32, static_cast<ReduceOp>(5)), kungfu::Code::kInvalidArgument);
}

TEST(DTypeSizesAndNames) {
  const size_t sizes[] = {1, 2, 4, 8, 1, 2, 4, 8, 2, 2, 4, 8, 1};
  const char* names[] = {"int8",    "int16",    "int32",   "int64",   "uint8", "uint16", "uint32",
                         "uint64",  "float16",  "bfloat16", "float32", "float64", "bool"};
  for (int code = 1; code <= 13; ++code) {
    CHECK(kungfu::IsValidDType(code));
    CHECK_EQ(kungfu::DTypeSize(static_cast<DType>(code)), sizes[code - 1]);
    CHECK_EQ(std::string(kungfu::DTypeName(static_cast<DType>(code))), std::string(names[code - 1]));
  }
  CHECK(!kungfu::IsValidDType(0));
  CHECK(!kungfu::IsValidDType(14));
  CHECK(!kungfu::IsValidReduceOp(0));
  CHECK(!kungfu::IsValidReduceOp(5));
  CHECK_EQ(kungfu::DTypeSize(static_cast<DType>(99)), size_t(0));
}

// ---- float16 -----------------------------------------------------------------------------------

TEST(HalfToFloatAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float got = kungfu::HalfToFloat(bits);
    const double want = Decode(bits, kHalf);
    if (!SameValue(got, want)) {
      kftest::ReportFailure(__FILE__, __LINE__, "HalfToFloat(" + std::to_string(h) + ") = " +
                                                    kftest::Show(got) + ", want " + kftest::Show(want));
    }
  }
}

TEST(HalfRoundTripAllPatterns) {
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const uint16_t back = kungfu::FloatToHalf(kungfu::HalfToFloat(bits));
    const bool ok = IsNaNBits(bits, kHalf) ? IsNaNBits(back, kHalf) : back == bits;
    if (!ok && bad++ < 5) {
      kftest::ReportFailure(__FILE__, __LINE__, "half round trip of " + std::to_string(h) +
                                                    " gave " + std::to_string(back));
    }
  }
}

TEST(HalfRoundsTiesToEven) {
  // Every pair of adjacent non-negative finite halves, including subnormals and the step from the
  // largest finite half to infinity: the midpoint goes to the even neighbour, points just beside
  // it to the nearer one.
  int bad = 0;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double lo = Decode(static_cast<uint16_t>(h), kHalf);
    const double hi = h + 1 < 0x7c00 ? Decode(static_cast<uint16_t>(h + 1), kHalf) : 65536.0;
    const uint16_t hi_bits = static_cast<uint16_t>(h + 1);  // 0x7c00 is +inf
    const float mid = static_cast<float>((lo + hi) / 2);     // exact in float
    CHECK(static_cast<double>(mid) == (lo + hi) / 2);
    const uint16_t even = (h & 1) ? hi_bits : static_cast<uint16_t>(h);
    const uint16_t got_mid = kungfu::FloatToHalf(mid);
    const uint16_t got_below = kungfu::FloatToHalf(std::nextafter(mid, 0.0f));
    const uint16_t got_above = kungfu::FloatToHalf(std::nextafter(mid, 1e9f));
    const uint16_t got_neg = kungfu::FloatToHalf(-mid);
    if ((got_mid != even || got_below != h || got_above != hi_bits ||
         got_neg != (even | 0x8000)) && bad++ < 5) {
      kftest::ReportFailure(__FILE__, __LINE__,
                            "ties between halves " + std::to_string(h) + " and " +
                                std::to_string(h + 1) + ": mid->" + std::to_string(got_mid) +
                                " below->" + std::to_string(got_below) + " above->" +
                                std::to_string(got_above) + " -mid->" + std::to_string(got_neg));
    }
  }
}

TEST(HalfOverflowUnderflowAndSpecials) {
  using kungfu::FloatToHalf;
  CHECK_EQ(FloatToHalf(65504.0f), uint16_t(0x7bff));
  CHECK_EQ(FloatToHalf(65519.996f), uint16_t(0x7bff));  // just below the midpoint to 65536
  CHECK_EQ(FloatToHalf(65520.0f), uint16_t(0x7c00));    // the midpoint: even is 2^16 -> inf
  CHECK_EQ(FloatToHalf(1e10f), uint16_t(0x7c00));
  CHECK_EQ(FloatToHalf(-1e10f), uint16_t(0xfc00));
  CHECK_EQ(FloatToHalf(std::numeric_limits<float>::max()), uint16_t(0x7c00));
  CHECK_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), uint16_t(0x7c00));
  CHECK_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), uint16_t(0xfc00));
  CHECK_EQ(FloatToHalf(0.0f), uint16_t(0x0000));
  CHECK_EQ(FloatToHalf(-0.0f), uint16_t(0x8000));
  // Subnormals: the smallest is 2^-24.
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -24)), uint16_t(0x0001));
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -25)), uint16_t(0x0000));  // tie with 0: even is 0
  CHECK_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), uint16_t(0x0001));
  CHECK_EQ(FloatToHalf(-std::ldexp(1.0f, -25)), uint16_t(0x8000));
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -30)), uint16_t(0x0000));
  CHECK_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), uint16_t(0x0000));
  CHECK_EQ(FloatToHalf(std::ldexp(3.0f, -25)), uint16_t(0x0002));  // 1.5 * 2^-24: tie -> 2
  CHECK_EQ(FloatToHalf(std::ldexp(5.0f, -25)), uint16_t(0x0002));  // 2.5 * 2^-24: tie -> 2
  CHECK_EQ(FloatToHalf(std::ldexp(1023.0f, -24)), uint16_t(0x03ff));  // largest subnormal
  CHECK_EQ(FloatToHalf(std::ldexp(1023.5f, -24)), uint16_t(0x0400));  // tie -> smallest normal
  CHECK_EQ(FloatToHalf(std::ldexp(1.0f, -14)), uint16_t(0x0400));
  CHECK_EQ(kungfu::HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  CHECK_EQ(kungfu::HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));
  CHECK_EQ(kungfu::HalfToFloat(0x8000), -0.0f);
  CHECK(std::signbit(kungfu::HalfToFloat(0x8000)));
  // NaN in, NaN out (payload not specified), for quiet and signalling float NaNs.
  for (uint32_t nan_bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fa00000u, 0xff800001u}) {
    uint16_t h = FloatToHalf(BitsToFloat(nan_bits));
    CHECK_MSG(IsNaNBits(h, kHalf), "float NaN " + std::to_string(nan_bits) + " -> half " + std::to_string(h));
  }
  CHECK(std::isnan(kungfu::HalfToFloat(0x7e00)));
  CHECK(std::isnan(kungfu::HalfToFloat(0x7c01)));
  CHECK(std::isnan(kungfu::HalfToFloat(0xfc01)));
  CHECK(std::isinf(kungfu::HalfToFloat(0x7c00)));
}

TEST(FloatToHalfMatchesReferenceOnRandomFloats) {
  std::mt19937 rng(7);
  int bad = 0;
  auto check = [&](uint32_t bits) {
    const float f = BitsToFloat(bits);
    const uint16_t h = kungfu::FloatToHalf(f);
    if (std::isnan(f)) {
      if (!IsNaNBits(h, kHalf) && bad++ < 5) {
        kftest::ReportFailure(__FILE__, __LINE__, "NaN " + std::to_string(bits) + " not NaN");
      }
      return;
    }
    const double want = RoundTo(f, kHalf);
    if (!SameValue(Decode(h, kHalf), want) && bad++ < 5) {
      kftest::ReportFailure(__FILE__, __LINE__, "FloatToHalf(" + kftest::Show(f) + ") = " +
                                                    kftest::Show(Decode(h, kHalf)) + ", want " +
                                                    kftest::Show(want));
    }
  };
  for (int i = 0; i < 2000000; ++i) check(rng());
  // Dense in the range where halves live (|x| in [2^-26, 2^17]).
  for (uint32_t bits = 0x32800000u; bits < 0x48000000u; bits += 97) {
    check(bits);
    check(bits | 0x80000000u);
  }
}

// ---- bfloat16 ----------------------------------------------------------------------------------

TEST(BFloat16ToFloatAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const float got = kungfu::BFloat16ToFloat(bits);
    if (!SameValue(got, Decode(bits, kBF16))) {
      kftest::ReportFailure(__FILE__, __LINE__, "BFloat16ToFloat(" + std::to_string(b) + ")");
    }
    if (!IsNaNBits(bits, kBF16)) CHECK_EQ(FloatToBits(got), b << 16);  // exact widening
    const uint16_t back = kungfu::FloatToBFloat16(got);
    const bool ok = IsNaNBits(bits, kBF16) ? IsNaNBits(back, kBF16) : back == bits;
    if (!ok) {
      kftest::ReportFailure(__FILE__, __LINE__, "bfloat16 round trip of " + std::to_string(b) +
                                                    " gave " + std::to_string(back));
    }
  }
}

TEST(BFloat16Rounding) {
  using kungfu::FloatToBFloat16;
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x3f808000u)), uint16_t(0x3f80));  // tie, even below
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x3f818000u)), uint16_t(0x3f82));  // tie, even above
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x3f808001u)), uint16_t(0x3f81));  // above the tie
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x3f807fffu)), uint16_t(0x3f80));  // below the tie
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0xbf818000u)), uint16_t(0xbf82));  // negative tie
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x7f7f7fffu)), uint16_t(0x7f7f));  // largest finite
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x7f7f8000u)), uint16_t(0x7f80));  // tie -> inf (even)
  CHECK_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), uint16_t(0x7f80));
  CHECK_EQ(FloatToBFloat16(-std::numeric_limits<float>::max()), uint16_t(0xff80));
  CHECK_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), uint16_t(0x7f80));
  CHECK_EQ(FloatToBFloat16(-0.0f), uint16_t(0x8000));
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x00008000u)), uint16_t(0x0000));  // subnormal tie -> 0
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x00018000u)), uint16_t(0x0002));  // subnormal tie -> even
  CHECK_EQ(FloatToBFloat16(BitsToFloat(0x007fffffu)), uint16_t(0x0080));  // up to smallest normal
  // NaNs whose payload sits only in the low 16 bits must stay NaN (not turn into infinity).
  for (uint32_t nan_bits : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7f80ffffu, 0x7fffffffu}) {
    uint16_t b = FloatToBFloat16(BitsToFloat(nan_bits));
    CHECK_MSG(IsNaNBits(b, kBF16), "float NaN " + std::to_string(nan_bits) + " -> bf16 " + std::to_string(b));
    CHECK_EQ(b & 0x8000, static_cast<int>((nan_bits >> 16) & 0x8000));
  }
  // Random floats against the reference.
  std::mt19937 rng(11);
  int bad = 0;
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t bits = rng();
    const float f = BitsToFloat(bits);
    if (std::isnan(f)) continue;
    const uint16_t b = FloatToBFloat16(f);
    const double want = RoundTo(f, kBF16);
    if (!SameValue(Decode(b, kBF16), want) && bad++ < 5) {
      kftest::ReportFailure(__FILE__, __LINE__, "FloatToBFloat16(" + kftest::Show(f) + ")");
    }
  }
}

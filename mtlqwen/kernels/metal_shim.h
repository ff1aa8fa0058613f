// The Metal built-ins our kernels use, defined in plain C++ so that g++ can type-check a rendered Metal
// kernel (`python -m mtlqwen.kernels.check_metal`) and, with metal_emu.h's scheduler, run it on the CPU
// (`--run`). It stands in for <metal_stdlib> and MLX's Metal utils header.
// Address spaces become empty macros (g++ cannot check them; the emulator rewrites threadgroup
// declarations before compiling); [[...]] attributes are accepted with -Wno-attributes.
// No libc header that declares ::abs / ::exp may be included here: `using namespace metal` would make
// unqualified calls ambiguous, as they are not on Metal.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

// 16-bit floats: storage types that convert to and from float, as MLX's bfloat16_t / half do; arithmetic
// goes through float (the kernels' convention), rounding happens on conversion
struct half {
  _Float16 v;
  half() = default;
  half(float f) : v((_Float16)f) {}
  operator float() const { return (float)v; }
};
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {  // round to nearest even, NaN kept quiet (as Metal's bfloat conversion)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = (uint16_t)((u >> 16) | 0x40u);
    } else {
      bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};
typedef half float16_t;

template <typename T>
struct vec2 {
  T x, y;
  vec2() = default;
  vec2(T a, T b) : x(a), y(b) {}
  explicit vec2(T a) : x(a), y(a) {}
  template <typename U> explicit vec2(vec2<U> o) : x(T(o.x)), y(T(o.y)) {}
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct vec3 {
  T x, y, z;
  vec3() = default;
  vec3(T a, T b, T c) : x(a), y(b), z(c) {}
  explicit vec3(T a) : x(a), y(a), z(a) {}
  template <typename U> explicit vec3(vec3<U> o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct vec4 {
  T x, y, z, w;
  vec4() = default;
  vec4(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  explicit vec4(T a) : x(a), y(a), z(a), w(a) {}
  template <typename U> explicit vec4(vec4<U> o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <typename T> constexpr int pl_width(vec2<T>*) { return 2; }
template <typename T> constexpr int pl_width(vec3<T>*) { return 3; }
template <typename T> constexpr int pl_width(vec4<T>*) { return 4; }
#define PL_VEC_OP(V, op)                                                                   \
  template <typename T> V<T> operator op(V<T> a, V<T> b) {                                 \
    V<T> r;                                                                                \
    for (int i = 0; i < pl_width((V<T>*)nullptr); ++i) r[i] = T(a[i] op b[i]);             \
    return r;                                                                              \
  }                                                                                        \
  template <typename T> V<T> operator op(V<T> a, T b) { return a op V<T>(b); }             \
  template <typename T> V<T> operator op(T a, V<T> b) { return V<T>(a) op b; }             \
  template <typename T> V<T>& operator op##=(V<T>& a, V<T> b) { return a = a op b; }       \
  template <typename T> V<T>& operator op##=(V<T>& a, T b) { return a = a op V<T>(b); }
#define PL_VEC_OPS(V) PL_VEC_OP(V, +) PL_VEC_OP(V, -) PL_VEC_OP(V, *) PL_VEC_OP(V, /)
PL_VEC_OPS(vec2)
PL_VEC_OPS(vec3)
PL_VEC_OPS(vec4)
typedef vec2<float> float2;
typedef vec3<float> float3;
typedef vec4<float> float4;
typedef vec2<half> half2;
typedef vec4<half> half4;
typedef vec2<int> int2;
typedef vec4<int> int4;
typedef vec2<uint> uint2;
typedef vec4<uint> uint4;
typedef vec2<bfloat16_t> bfloat2;
typedef vec4<bfloat16_t> bfloat4;
struct uint3 {
  uint x, y, z;
};

namespace pl {
// the emulator's SIMD-group collective (metal_emu.h): every active lane of the simdgroup deposits `size`
// bytes and an argument, `combine` computes all lanes' results at once, each lane gets its own back
typedef void (*Combine)(const unsigned char* in, unsigned char* out, const int* args, const bool* active,
                        int size);
void collective(const void* in, void* out, int size, int arg, Combine combine);
void barrier(int line);
void simd_barrier();
void tg_note(void* p, size_t bytes);

template <typename T> inline const T& at(const unsigned char* p, int l) { return ((const T*)p)[l]; }
template <typename T> inline T& at(unsigned char* p, int l) { return ((T*)p)[l]; }
// a lane reading an inactive lane gets poison (0xFF bytes: NaN for floats), as undefined on the GPU
template <typename T> inline void from_lane(const unsigned char* in, unsigned char* out, const bool* act, int l,
                                            int src) {
  if (src >= 0 && src < 32 && act[src]) {
    at<T>(out, l) = at<T>(in, src);
  } else {
    memset(&at<T>(out, l), 0xff, sizeof(T));
  }
}
template <typename T> void c_sum(const unsigned char* in, unsigned char* out, const int*, const bool* act, int) {
  T s{};
  bool first = true;
  for (int l = 0; l < 32; ++l) {
    if (act[l]) {
      s = first ? at<T>(in, l) : T(s + at<T>(in, l));
      first = false;
    }
  }
  for (int l = 0; l < 32; ++l) if (act[l]) at<T>(out, l) = s;
}
template <typename T> void c_prod(const unsigned char* in, unsigned char* out, const int*, const bool* act, int) {
  T s{};
  bool first = true;
  for (int l = 0; l < 32; ++l) {
    if (act[l]) {
      s = first ? at<T>(in, l) : T(s * at<T>(in, l));
      first = false;
    }
  }
  for (int l = 0; l < 32; ++l) if (act[l]) at<T>(out, l) = s;
}
template <typename T, bool MAX> void c_ext(const unsigned char* in, unsigned char* out, const int*, const bool* act,
                                           int) {
  T s{};
  bool first = true;
  for (int l = 0; l < 32; ++l) {
    if (act[l]) {
      const T v = at<T>(in, l);
      if (first || (MAX ? (v > s) : (v < s))) s = v;
      first = false;
    }
  }
  for (int l = 0; l < 32; ++l) if (act[l]) at<T>(out, l) = s;
}
template <typename T, bool INCL> void c_prefix(const unsigned char* in, unsigned char* out, const int*,
                                               const bool* act, int) {
  T s{};
  bool first = true;
  for (int l = 0; l < 32; ++l) {
    if (!act[l]) continue;
    if (INCL) s = first ? at<T>(in, l) : T(s + at<T>(in, l));
    at<T>(out, l) = (!INCL && first) ? T(0) : s;
    if (!INCL) s = first ? at<T>(in, l) : T(s + at<T>(in, l));
    first = false;
  }
}
// 0: simd_shuffle (absolute lane), 1: xor, 2: down, 3: up
template <typename T, int MODE> void c_shuffle(const unsigned char* in, unsigned char* out, const int* args,
                                               const bool* act, int) {
  for (int l = 0; l < 32; ++l) {
    if (!act[l]) continue;
    const int a = args[l];
    int src = MODE == 0 ? a : MODE == 1 ? (l ^ a) : MODE == 2 ? l + a : l - a;
    if ((MODE == 2 || MODE == 3) && (src < 0 || src >= 32)) src = l;  // no wrap: the lane keeps its value
    from_lane<T>(in, out, act, l, src);
  }
}
template <typename T> void c_broadcast(const unsigned char* in, unsigned char* out, const int* args, const bool* act,
                                       int) {
  for (int l = 0; l < 32; ++l) if (act[l]) from_lane<T>(in, out, act, l, args[l]);
}
inline void c_all(const unsigned char* in, unsigned char* out, const int*, const bool* act, int) {
  bool r = true;
  for (int l = 0; l < 32; ++l) if (act[l]) r = r && at<bool>(in, l);
  for (int l = 0; l < 32; ++l) if (act[l]) at<bool>(out, l) = r;
}
inline void c_any(const unsigned char* in, unsigned char* out, const int*, const bool* act, int) {
  bool r = false;
  for (int l = 0; l < 32; ++l) if (act[l]) r = r || at<bool>(in, l);
  for (int l = 0; l < 32; ++l) if (act[l]) at<bool>(out, l) = r;
}
template <typename T> inline T run(T x, int arg, Combine c) {
  T r;
  collective(&x, &r, (int)sizeof(T), arg, c);
  return r;
}
}  // namespace pl

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
// a macro: the source line tells different barriers apart (code addresses do not: the compiler may
// duplicate a call on two paths)
inline void threadgroup_barrier_at(mem_flags, int line) { pl::barrier(line); }
#define threadgroup_barrier(flags) threadgroup_barrier_at(flags, __LINE__)
inline void simdgroup_barrier(mem_flags) { pl::simd_barrier(); }

template <typename T> T simd_sum(T x) { return pl::run(x, 0, &pl::c_sum<T>); }
template <typename T> T simd_max(T x) { return pl::run(x, 0, &pl::c_ext<T, true>); }
template <typename T> T simd_min(T x) { return pl::run(x, 0, &pl::c_ext<T, false>); }
template <typename T> T simd_prod(T x) { return pl::run(x, 0, &pl::c_prod<T>); }
template <typename T> T simd_prefix_inclusive_sum(T x) { return pl::run(x, 0, &pl::c_prefix<T, true>); }
template <typename T> T simd_prefix_exclusive_sum(T x) { return pl::run(x, 0, &pl::c_prefix<T, false>); }
template <typename T> T simd_shuffle(T x, ushort l) { return pl::run(x, l, &pl::c_shuffle<T, 0>); }
template <typename T> T simd_shuffle_xor(T x, ushort m) { return pl::run(x, m, &pl::c_shuffle<T, 1>); }
template <typename T> T simd_shuffle_down(T x, ushort d) { return pl::run(x, d, &pl::c_shuffle<T, 2>); }
template <typename T> T simd_shuffle_up(T x, ushort d) { return pl::run(x, d, &pl::c_shuffle<T, 3>); }
template <typename T> T simd_broadcast(T x, ushort l) { return pl::run(x, l, &pl::c_broadcast<T>); }
inline bool simd_all(bool x) { return pl::run(x, 0, &pl::c_all); }
inline bool simd_any(bool x) { return pl::run(x, 0, &pl::c_any); }

template <typename T, typename U> T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
  T t;
  memcpy(&t, &u, sizeof(T));
  return t;
}
template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T> T select(T a, T b, bool c) { return c ? b : a; }
inline int abs(int x) { return x < 0 ? -x : x; }
inline float dot(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
inline float dot(float2 a, float2 b) { return a.x * b.x + a.y * b.y; }

#define PL_MATH1(f, impl) \
  inline float f(float x) { return impl; } \
  inline half f(half h) { const float x = h; return half(impl); }
#define PL_MATH2(f, impl) \
  inline float f(float x, float y) { return impl; } \
  inline half f(half hx, half hy) { const float x = hx, y = hy; return half(impl); }
#define PL_MATH_ALL                                                                                  \
  PL_MATH1(exp, __builtin_expf(x)) PL_MATH1(exp2, __builtin_exp2f(x)) PL_MATH1(log, __builtin_logf(x)) \
  PL_MATH1(log2, __builtin_log2f(x)) PL_MATH1(log1p, __builtin_log1pf(x))                            \
  PL_MATH1(sqrt, __builtin_sqrtf(x)) PL_MATH1(rsqrt, 1.0f / __builtin_sqrtf(x))                      \
  PL_MATH1(tanh, __builtin_tanhf(x)) PL_MATH1(sin, __builtin_sinf(x)) PL_MATH1(cos, __builtin_cosf(x)) \
  PL_MATH1(fabs, __builtin_fabsf(x)) PL_MATH1(abs, __builtin_fabsf(x))                               \
  PL_MATH1(floor, __builtin_floorf(x)) PL_MATH1(ceil, __builtin_ceilf(x))                            \
  PL_MATH1(round, __builtin_roundf(x)) PL_MATH1(trunc, __builtin_truncf(x))                          \
  PL_MATH2(pow, __builtin_powf(x, y)) PL_MATH2(fmax, __builtin_fmaxf(x, y))                          \
  PL_MATH2(fmin, __builtin_fminf(x, y)) PL_MATH2(fmod, __builtin_fmodf(x, y))
PL_MATH_ALL
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
namespace precise {
PL_MATH_ALL
}
namespace fast {
PL_MATH_ALL
}

enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
// one OS thread runs every GPU thread of a launch (metal_emu.h): plain loads and stores are atomic
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope) {}
template <typename T>
struct atomic {
  T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <typename T> T atomic_fetch_add_explicit(device atomic<T>* p, T v, memory_order) {
  const T old = p->v;
  p->v = old + v;
  return old;
}
template <typename T> T atomic_load_explicit(device atomic<T>* p, memory_order) { return p->v; }
template <typename T> void atomic_store_explicit(device atomic<T>* p, T v, memory_order) { p->v = v; }
}  // namespace metal

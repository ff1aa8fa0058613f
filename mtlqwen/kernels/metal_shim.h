// Declarations of the Metal built-ins our kernels use, so that g++ can syntax- and type-check a
// rendered Metal kernel (`python -m mtlqwen.kernels.check_metal`). Only declarations that matter for
// type checking: nothing here runs. It stands in for <metal_stdlib> and MLX's Metal utils header.
// Address spaces become empty macros (g++ cannot check them); [[...]] attributes are accepted with
// -Wno-attributes.
#pragma once
#include <cstddef>
#include <cstdint>

#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

// 16-bit floats: storage types that convert to and from float, as MLX's bfloat16_t / half do
struct half {
  half() = default;
  half(float);
  operator float() const;
};
struct bfloat16_t {
  bfloat16_t() = default;
  bfloat16_t(float);
  operator float() const;
};
typedef half float16_t;

template <typename T>
struct vec2 {
  T x, y;
  vec2() = default;
  vec2(T a, T b);
  explicit vec2(T a);
  T& operator[](int);
  T operator[](int) const;
};
template <typename T>
struct vec3 {
  T x, y, z;
  vec3() = default;
  vec3(T a, T b, T c);
  explicit vec3(T a);
  T& operator[](int);
  T operator[](int) const;
};
template <typename T>
struct vec4 {
  T x, y, z, w;
  vec4() = default;
  vec4(T a, T b, T c, T d);
  explicit vec4(T a);
  T& operator[](int);
  T operator[](int) const;
};
#define PL_VEC_OPS(V)                                        \
  template <typename T> V<T> operator+(V<T>, V<T>);          \
  template <typename T> V<T> operator-(V<T>, V<T>);          \
  template <typename T> V<T> operator*(V<T>, V<T>);          \
  template <typename T> V<T> operator/(V<T>, V<T>);          \
  template <typename T> V<T> operator*(V<T>, T);             \
  template <typename T> V<T> operator*(T, V<T>);             \
  template <typename T> V<T>& operator+=(V<T>&, V<T>);       \
  template <typename T> V<T>& operator*=(V<T>&, T);
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

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
mem_flags operator|(mem_flags, mem_flags);
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);

template <typename T> T simd_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_min(T);
template <typename T> T simd_prod(T);
template <typename T> T simd_prefix_inclusive_sum(T);
template <typename T> T simd_prefix_exclusive_sum(T);
template <typename T> T simd_shuffle(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T> T simd_shuffle_up(T, ushort);
template <typename T> T simd_shuffle_down(T, ushort);
template <typename T> T simd_broadcast(T, ushort);
bool simd_all(bool);
bool simd_any(bool);

template <typename T, typename U> T as_type(U);
template <typename T> T max(T, T);
template <typename T> T min(T, T);
template <typename T> T clamp(T, T, T);
template <typename T> T select(T, T, bool);
int abs(int);
float dot(float4, float4);
float dot(float2, float2);

#define PL_MATH1(f) float f(float); half f(half);
#define PL_MATH2(f) float f(float, float); half f(half, half);
#define PL_MATH_ALL                                                                       \
  PL_MATH1(exp) PL_MATH1(exp2) PL_MATH1(log) PL_MATH1(log2) PL_MATH1(log1p) PL_MATH1(sqrt) \
  PL_MATH1(rsqrt) PL_MATH1(tanh) PL_MATH1(sin) PL_MATH1(cos) PL_MATH1(fabs) PL_MATH1(abs)  \
  PL_MATH1(floor) PL_MATH1(ceil) PL_MATH1(round) PL_MATH1(trunc)                           \
  PL_MATH2(pow) PL_MATH2(fmax) PL_MATH2(fmin) PL_MATH2(fmod)
PL_MATH_ALL
float fma(float, float, float);
bool isnan(float);
bool isinf(float);
namespace precise {
PL_MATH_ALL
}
namespace fast {
PL_MATH_ALL
}

enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
void atomic_thread_fence(mem_flags, memory_order, thread_scope);
template <typename T>
struct atomic {
  T v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <typename T> T atomic_fetch_add_explicit(device atomic<T>*, T, memory_order);
template <typename T> T atomic_load_explicit(device atomic<T>*, memory_order);
template <typename T> void atomic_store_explicit(device atomic<T>*, T, memory_order);
}  // namespace metal

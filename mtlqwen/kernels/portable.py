"""The portability layer: kernel bodies written once, rendered for `mx.fast.metal_kernel` or
`mx.fast.cuda_kernel`.

A body uses the portable tokens below; `render(body, backend)` substitutes them textually. The
substitution is textual (not `#define`) because MLX decides which thread-position attributes to put in
a Metal signature by searching the *body* for their names.

Conventions every kernel keeps so the two back-ends agree:
- threadgroups are 1-D in lanes, or their x extent is a multiple of 32, so `LANE` / `SIMD_ID` match
  Metal's simdgroup numbering (32-wide on Apple GPUs) and CUDA's warps;
- reductions across a SIMD group use SIMD_SUM / SIMD_MAX (Metal simd_sum / CUDA xor-shuffles);
- arithmetic is float; `TO_FLOAT` / `FROM_FLOAT` convert the storage types (float, half, bfloat).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import mlx.core as mx

# token -> (metal, cuda)
TOKENS: dict[str, tuple[str, str]] = {
    "TID_X": ("thread_position_in_threadgroup.x", "threadIdx.x"),
    "TID_Y": ("thread_position_in_threadgroup.y", "threadIdx.y"),
    "TID_Z": ("thread_position_in_threadgroup.z", "threadIdx.z"),
    "TGID_X": ("threadgroup_position_in_grid.x", "blockIdx.x"),
    "TGID_Y": ("threadgroup_position_in_grid.y", "blockIdx.y"),
    "TGID_Z": ("threadgroup_position_in_grid.z", "blockIdx.z"),
    "TG_SIZE_X": ("threads_per_threadgroup.x", "blockDim.x"),
    "TG_SIZE_Y": ("threads_per_threadgroup.y", "blockDim.y"),
    "GID_X": ("thread_position_in_grid.x", "(blockIdx.x * blockDim.x + threadIdx.x)"),
    "GID_Y": ("thread_position_in_grid.y", "(blockIdx.y * blockDim.y + threadIdx.y)"),
    "GID_Z": ("thread_position_in_grid.z", "(blockIdx.z * blockDim.z + threadIdx.z)"),
    "LANE": ("thread_index_in_simdgroup", "(threadIdx.x & 31u)"),
    "SIMD_ID": (
        "simdgroup_index_in_threadgroup",
        "((threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) >> 5)",
    ),
    "SIMD_SUM": ("simd_sum", "pl_simd_sum"),
    "SIMD_MAX": ("simd_max", "pl_simd_max"),
    "SIMD_SHUFFLE_XOR": ("simd_shuffle_xor", "pl_shuffle_xor"),
    "SIMD_BROADCAST": ("simd_broadcast", "pl_broadcast"),
    "SHARED": ("threadgroup", "__shared__"),
    "BARRIER": ("threadgroup_barrier(mem_flags::mem_threadgroup)", "__syncthreads()"),
    "DEVICE_PTR": ("device", ""),
    "CONST_PTR": ("const device", "const"),
    "INLINE": ("inline", "__device__ __forceinline__"),
    "TO_FLOAT": ("static_cast<float>", "pl_to_float"),
    "RSQRT": ("metal::precise::rsqrt", "rsqrtf"),
    "EXP": ("metal::precise::exp", "expf"),
    "LOG1P": ("metal::precise::log1p", "log1pf"),
    "SQRT": ("metal::precise::sqrt", "sqrtf"),
    "bf16_t": ("bfloat16_t", "__nv_bfloat16"),
    "f16_t": ("half", "__half"),
    "uint32_t": ("uint32_t", "uint32_t"),
    # added for the GDN / conv / norm kernels
    "FABS": ("metal::fabs", "fabsf"),
    "FMAX": ("metal::fmax", "fmaxf"),
    "FMIN": ("metal::fmin", "fminf"),
    "LOG": ("metal::precise::log", "logf"),
    "MAKE_FLOAT4": ("float4", "make_float4"),
    # address space of a pointer cast to threadgroup / shared memory (CUDA pointers are generic)
    "TG_PTR": ("threadgroup", ""),
    # across threadgroups of one launch (qmatmul/residual.py's "last threadgroup finishes" epilogue): a device-
    # scope fence, a uint32 counter in an input buffer (relaxed atomics), and a load past the non-coherent
    # per-SM cache of data other threadgroups wrote during the launch
    "DEVICE_FENCE": ("atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device)",
                     "__threadfence()"),
    "ATOMIC_ADD_U32": ("pl_atomic_add_u32", "pl_atomic_add_u32"),
    "ATOMIC_STORE_U32": ("pl_atomic_store_u32", "pl_atomic_store_u32"),
    "LOAD_L2": ("pl_load_l2", "__ldcg"),
}

# Helpers a CUDA body may call (they are what the SIMD tokens render to). Metal has them built in.
CUDA_HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ float pl_simd_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float pl_simd_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float pl_shuffle_xor(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
__device__ __forceinline__ float pl_broadcast(float x, int lane) { return __shfl_sync(0xffffffffu, x, lane); }
__device__ __forceinline__ float pl_to_float(float x) { return x; }
__device__ __forceinline__ float pl_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float pl_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T pl_from_float(float x);
template <> __device__ __forceinline__ float pl_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half pl_from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 pl_from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ unsigned int pl_atomic_add_u32(const uint32_t* p, unsigned int v) {
  return atomicAdd((unsigned int*)p, v);
}
__device__ __forceinline__ void pl_atomic_store_u32(const uint32_t* p, unsigned int v) { atomicExch((unsigned int*)p, v); }
"""

METAL_HEADER = r"""
#include <metal_stdlib>
using namespace metal;
inline uint pl_atomic_add_u32(const device uint32_t* p, uint v) {
  return atomic_fetch_add_explicit((device atomic_uint*)p, v, memory_order_relaxed);
}
inline void pl_atomic_store_u32(const device uint32_t* p, uint v) {
  atomic_store_explicit((device atomic_uint*)p, v, memory_order_relaxed);
}
template <typename T> inline T pl_load_l2(const device T* p) { return *p; }
"""

_FROM_FLOAT = re.compile(r"FROM_FLOAT\(\s*(\w+)\s*,")
_TOKEN_RE = re.compile(r"\b(" + "|".join(sorted(TOKENS, key=len, reverse=True)) + r")\b")


# a string or char literal (kept as is), or a comment (dropped)
_LEXEME = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def compact(src: str) -> str:
    """A rendered source without comments, indentation, runs of blanks or empty lines (lines, and so the
    preprocessor's view, unchanged). Why: MLX hashes a custom kernel's whole source at every launch, about
    0.35 us of host time per KB on the H200's host (benchmarks/decode_profile.md)."""
    out, pos = [], 0
    for m in _LEXEME.finditer(src):
        out.append(re.sub(r"[ \t]+", " ", src[pos:m.start()]))
        tok = m.group(0)
        out.append(tok if tok[0] in "\"'" else ("\n" if "\n" in tok else " "))
        pos = m.end()
    out.append(re.sub(r"[ \t]+", " ", src[pos:]))
    lines = (line.strip() for line in "".join(out).split("\n"))
    return "".join(line + "\n" for line in lines if line)


def render(body: str, backend: str) -> str:
    """Portable body -> Metal or CUDA body."""
    col = {"metal": 0, "cuda": 1}[backend]
    if backend == "metal":
        body = _FROM_FLOAT.sub(lambda m: f"static_cast<{m.group(1)}>(", body)
    else:
        body = _FROM_FLOAT.sub(lambda m: f"pl_from_float<{m.group(1)}>(", body)
    return _TOKEN_RE.sub(lambda m: TOKENS[m.group(1)][col], body)


def render_header(header: str, backend: str) -> str:
    base = METAL_HEADER if backend == "metal" else CUDA_HEADER
    return compact(base + render(header, backend))


# One list per op call in progress (dispatch.py pushes and pops them): the instantiations it launched.
LAUNCHES: list[list[tuple]] = []


@dataclass
class KernelExample:
    """One concrete call of a kernel, enough to write the signature MLX would generate for it:
    inputs as (dtype, shape) (Metal passes arrays of < 8 elements in `constant` memory, 0-d ones by
    reference), output dtypes, and the template arguments in the order the kernel passes them."""

    inputs: list  # [(mx.Dtype, shape tuple)], in input_names order
    outputs: list  # [mx.Dtype], in output_names order
    template: list = field(default_factory=list)  # [(name, int | bool | mx.Dtype)]


@dataclass
class PortableKernel:
    """One kernel source and its two renderings. Built once per (op, quant type, shape class)."""

    name: str
    input_names: list[str]
    output_names: list[str]
    body: str
    header: str = ""
    # CUDA-only variant (e.g. tensor-core MMA); the portable body stays the Metal path and fallback
    cuda_body: str | None = None
    shared_memory: int = 0
    # concrete instantiations `check_metal` compiles the Metal rendering with (see KernelExample)
    examples: list = field(default_factory=list)
    # instantiations of `cuda_body` for `check_cuda` when its template differs from the portable body's
    cuda_examples: list = field(default_factory=list)
    _built: dict = field(default_factory=dict, repr=False)

    def unique_name(self, backend: str) -> str:
        # MLX before #4273 cached CUDA modules by name only: the name must change with the source
        src = (self.cuda_body if backend == "cuda" and self.cuda_body else self.body) + self.header
        return f"{self.name}_{hashlib.sha1(src.encode()).hexdigest()[:10]}"

    def source(self, backend: str) -> str:
        body = self.cuda_body if backend == "cuda" and self.cuda_body is not None else self.body
        return compact(render(body, backend))

    def build(self, backend: str):
        if backend not in self._built:
            kw = dict(
                name=self.unique_name(backend),
                input_names=self.input_names,
                output_names=self.output_names,
                source=self.source(backend),
                header=render_header(self.header, backend),
            )
            if backend == "metal":
                self._built[backend] = mx.fast.metal_kernel(**kw)
            else:
                self._built[backend] = mx.fast.cuda_kernel(**kw, shared_memory=self.shared_memory)
        return self._built[backend]

    def instance_key(self, template) -> tuple:
        """(name, template values): one compiled instantiation (what a self-check verifies once)."""
        return (self.name, tuple(template or ()))

    def __call__(self, backend: str, **kwargs):
        if LAUNCHES:  # the dispatcher is collecting the instantiations one op call launches
            LAUNCHES[-1].append(self.instance_key(kwargs.get("template")))
        return self.build(backend)(**kwargs)


REGISTRY: dict[str, PortableKernel] = {}


def portable_kernel(**kw) -> PortableKernel:
    """Declare a kernel; every declared kernel is compile-checked for Metal (`check_metal`)."""
    k = PortableKernel(**kw)
    REGISTRY[k.name] = k
    return k

"""The source MLX's `metal_kernel` generates for one call of a portable kernel: the `[[kernel]]` signature
with `[[buffer(i)]]` parameters and only the thread attributes the body names, the template instantiation.
Shared by the compile check (check_metal.py) and the CPU emulator (metal_emulator.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .portable import KernelExample, PortableKernel, render_header

SHIM = Path(__file__).with_name("metal_shim.h")
CONSTANT_MAX = 8  # MLX passes inputs with fewer elements in the `constant` address space

# the attribute names MLX looks for in a body, with their types (mlx/backend/common/metal_kernel.cpp)
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]

_TYPE = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.int32: "int32_t",
    mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint8: "uint8_t", mx.int8: "int8_t", mx.uint16: "uint16_t",
    mx.int16: "int16_t", mx.uint64: "uint64_t", mx.bool_: "bool",
}


def _tmpl_value(v) -> str:
    if isinstance(v, bool):  # MLX streams a bool without boolalpha
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return _TYPE[v]


def kernel_name(kern: PortableKernel, ex: KernelExample) -> str:
    """The host name MLX gives this instantiation (template values, then input and output dtypes)."""
    name = "custom_kernel_" + kern.unique_name("metal")
    if ex.template:
        name += "__" + "_".join(_tmpl_value(v) for _, v in ex.template)
    for dt, shape in ex.inputs:
        size = 1
        for d in shape:
            size *= d
        name += "_" + _TYPE[dt] + ("s" if len(shape) == 0 else "c" if size < CONSTANT_MAX else "")
    name += "".join("_" + _TYPE[dt] for dt in ex.outputs)
    return name


def signature(kern: PortableKernel, ex: KernelExample) -> list[tuple[str, str, int, str]]:
    """The kernel's parameters as MLX writes them: [(kind, name, array index, declaration)], kind one of
    input / scalar / shape / strides / ndim / output / attr (array index -1 for attributes)."""
    body = kern.source("metal")
    params = []
    index = 0
    for i, (iname, (dt, shape)) in enumerate(zip(kern.input_names, ex.inputs)):
        size = 1
        for d in shape:
            size *= d
        loc = "constant" if size < CONSTANT_MAX else "device"
        ref = "&" if len(shape) == 0 else "*"
        params.append(("scalar" if len(shape) == 0 else "input", iname, i,
                       f"  const {loc} {_TYPE[dt]}{ref} {iname} [[buffer({index})]]"))
        index += 1
        if len(shape) > 0:
            for suffix, decl in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                                 ("_ndim", "const constant int&")):
                if iname + suffix in body:
                    params.append((suffix[1:], iname + suffix, i, f"  {decl} {iname}{suffix} [[buffer({index})]]"))
                    index += 1
    for j, (oname, dt) in enumerate(zip(kern.output_names, ex.outputs)):
        params.append(("output", oname, len(ex.inputs) + j, f"  device {_TYPE[dt]}* {oname} [[buffer({index})]]"))
        index += 1
    params += [("attr", a, -1, f"  {t} {a} [[{a}]]") for a, t in METAL_ATTRIBUTES if a in body]
    return params


def metal_source(kern: PortableKernel, ex: KernelExample, body: str | None = None) -> str:
    """The full Metal source MLX's metal_kernel generates for this call (see write_signature); `body`
    replaces the rendered body (the emulator's rewrite of its threadgroup declarations)."""
    body = kern.source("metal") if body is None else body
    header = render_header(kern.header, "metal")
    name = kernel_name(kern, ex)
    src = header
    if ex.template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in ex.template]
        src += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, ex.template)) + ">\n"
    params = [decl for _, _, _, decl in signature(kern, ex)]
    src += f"[[kernel]] void {name}(\n" + ",\n".join(params) + ") {\n" + body + "\n}\n"
    if ex.template:
        inst = name + "<" + ", ".join(_tmpl_value(v) for _, v in ex.template) + ">"
        src += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
    return src

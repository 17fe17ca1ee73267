"""Compile the Triton kernels for a GPU that is not there: the launch a launcher makes, caught
before it reaches the device, specialized as Triton's JIT specializes it and compiled for an
explicit ``GPUTarget`` (what Triton's own compiler tests do without a device).

The launchers run unchanged on CPU tensors (``TRITON_INTERPRET=1`` only lets their device
check pass; the kernels stay JIT functions), and the kernel they would launch is replaced by a
recorder of its arguments. The arguments go through the JIT's own binder for the CUDA backend
(``create_function_from_signature``: the same code ``JITFunction.run`` calls, which types an
int by its value, makes 1 a constexpr and marks pointers and ints divisible by 16), so the
compiled variant and its cache key are the ones the GPU run would get. These are Triton
internals, read from the pinned release (pyproject's test extra: torch's own pin).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)


@dataclass
class Launch:
    """One launch a launcher made: the kernel, its grid, its arguments."""

    kernel: JITFunction
    grid: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` records the launch."""

    def __init__(self, kernel: JITFunction, launches: list[Launch]) -> None:
        if not isinstance(kernel, JITFunction):
            raise TypeError(
                f"{kernel!r} is not a JITFunction (was its module imported under "
                "TRITON_INTERPRET=1?): nothing to compile"
            )
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, grid, args, kwargs))

        return launch


@dataclass
class Compiled:
    """A compiled variant and what the test checks of it."""

    key: str  # the JIT's cache key: two launches with one key share one compiled kernel
    signature: dict[str, str]
    registers: int
    local_bytes: int  # spills and stack (cuobjdump's LOCAL + STACK)
    global_loads: dict[str, int]  # PTX ld.global width in bits -> count
    global_stores: dict[str, int]
    seconds: float


def _bin(tool: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _resources(cubin: bytes, name: str) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [_bin("cuobjdump"), "--dump-resource-usage", path],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(re.findall(r"(\w+):(\d+)", line))
    return int(fields["REG"]), int(fields["LOCAL"]) + int(fields["STACK"])


_WIDTHS = {"b8": 8, "b16": 16, "b32": 32, "b64": 64, "u16": 16, "u32": 32, "f32": 32}


def _widths(ptx: str, op: str) -> dict[str, int]:
    """The streaming ``op`` (ld/st) .global instructions (the kernels mark every element
    stream evict-first; tables and scalars are not) by access width in bits ("128" for
    v4.b32)."""
    counts: dict[str, int] = {}
    for match in re.finditer(rf"\b{op}\.global((?:\.[\w:]+)*)\s", ptx):
        parts = match.group(1).split(".")
        if "L1::evict_first" not in parts:
            continue
        lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        width = next((_WIDTHS[p] for p in parts if p in _WIDTHS), 0)
        bits = str(lanes * width)
        counts[bits] = counts.get(bits, 0) + 1
    return counts


def specialize(launch: Launch, target: GPUTarget = SM90) -> tuple[str, Any]:
    """The JIT's cache key of ``launch`` on ``target`` and what it compiles from."""
    backend = make_backend(target)
    kernel = launch.kernel
    kwargs = {"debug": False, **launch.kwargs}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    packed = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return key, packed


def compile_launch(launch: Launch, target: GPUTarget = SM90) -> Compiled:
    """Compile ``launch`` for ``target`` as the JIT would; raises Triton's CompilationError."""
    import time

    key, (options, signature, constexprs, attrs) = specialize(launch, target)
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(launch.kernel, signature, constexprs, attrs),
        target=target,
        options=options.__dict__,
    )
    seconds = time.perf_counter() - start
    registers, local = _resources(compiled.asm["cubin"], compiled.name)
    ptx = compiled.asm["ptx"]
    return Compiled(
        key, signature, registers, local, _widths(ptx, "ld"), _widths(ptx, "st"), seconds
    )

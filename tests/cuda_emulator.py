"""Run a `mx.fast.cuda_kernel` source on the CPU: its 32 lanes as coroutines, shuffles as warp barriers.

For kernels that sync only within a warp (`__syncwarp`, `__shfl_*_sync`) and return early only
whole warps at a time: warps then run one after another, so `__shared__` can be a function
static, and a warp's lanes are coroutines (ucontext) on one thread. Built with g++ against the
CUDA toolkit's headers (their host code of `__half` and `__nv_bfloat16`). The test suite uses it
where no GPU is: the kernel's text, its launch and the merge around it run for real; only the
hardware is emulated (no memory-model or timing effects).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t"}


def available() -> bool:
    return shutil.which("g++") is not None and (CUDA_INCLUDE / "cuda_bf16.h").exists()


PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <ucontext.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
using std::max;
using std::min;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__
struct EmuDim { unsigned x, y, z; };
EmuDim threadIdx, blockIdx, gridDim, blockDim;
// The 32 lanes of a warp are coroutines on one thread: each runs to the warp's next sync point,
// then the next lane runs; after lane 31 the round starts again at lane 0. A sync point is a
// barrier of the whole warp, as __syncwarp and each shuffle are.
ucontext_t emu_main, emu_ctx[32];
int emu_lane, emu_done, emu_warp;
float emu_f[32];
int emu_i[32];
using Shape = std::array<int32_t, 10>;
inline void emu_switch_to(int lane) { emu_lane = lane; threadIdx = {unsigned(emu_warp * 32 + lane), 0, 0}; }
inline void emu_sync() {
  int l = emu_lane;
  if (l == 31) { swapcontext(&emu_ctx[l], &emu_main); }
  else { emu_switch_to(l + 1); swapcontext(&emu_ctx[l], &emu_ctx[l + 1]); }
  emu_switch_to(l);
}
inline void __syncwarp() { emu_sync(); }
inline float emu_shfl(float x, int src) { emu_f[emu_lane] = x; emu_sync(); float r = emu_f[src & 31]; emu_sync(); return r; }
inline int emu_shfl(int x, int src) { emu_i[emu_lane] = x; emu_sync(); int r = emu_i[src & 31]; emu_sync(); return r; }
inline float __shfl_xor_sync(unsigned, float x, int o) { return emu_shfl(x, emu_lane ^ o); }
inline float __shfl_sync(unsigned, float x, int s) { return emu_shfl(x, s); }
inline int __shfl_sync(unsigned, int x, int s) { return emu_shfl(x, s); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }

// Runs one warp: `body` on 32 lanes until every lane has returned (they return together: the
// kernels this serves return early only whole warps at a time).
template <typename F> void emu_run_warp(int warp, F& body) {
  static std::vector<char> stacks(32 * (1 << 18));
  static F* current;
  current = &body;
  emu_warp = warp;
  emu_done = 0;
  for (int l = 0; l < 32; ++l) {
    getcontext(&emu_ctx[l]);
    emu_ctx[l].uc_stack.ss_sp = stacks.data() + l * (1 << 18);
    emu_ctx[l].uc_stack.ss_size = 1 << 18;
    emu_ctx[l].uc_link = nullptr;
    makecontext(&emu_ctx[l], (void (*)()) + [] { (*current)(); ++emu_done; for (;;) emu_sync(); }, 0);
  }
  while (emu_done < 32) { emu_switch_to(0); swapcontext(&emu_main, &emu_ctx[0]); }
}

template <typename T> std::vector<T> emu_read(const std::string& path, size_t n) {
  std::vector<T> v(n);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) { std::fprintf(stderr, "bad %s\n", path.c_str()); std::exit(2); }
  std::fclose(f);
  return v;
}
"""


def _signature(input_names, input_types, output_names, source) -> str:
    args = []
    for name, ty in zip(input_names, input_types):
        args.append(f"const {ty}* {name}")
        if name + "_shape" in source:
            args.append(f"Shape {name}_shape")
    args += [f"float* {name}" for name in output_names]
    return ", ".join(args)


class EmulatedKernel:
    """Stands in for what `mx.fast.cuda_kernel(...)` returns, for the template instances given.

    Inputs are float/half/bfloat16 arrays named like the kernel's, and int32 ones; outputs are computed as
    float and returned in their dtypes.
    """

    def __init__(self, input_names, output_names, source, header, instances, input_dtypes):
        self.input_names, self.output_names = list(input_names), list(output_names)
        self._dir = tempfile.TemporaryDirectory(prefix="cuda-emu-")  # removed with this object
        self.workdir = Path(self._dir.name)
        code = [PRELUDE, header]
        dispatch = []
        for n, template in enumerate(instances):
            consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in template if not isinstance(v, mx.Dtype))
            types = "".join(f"  using {k} = {CUDA_TYPES[v]};\n" for k, v in template if isinstance(v, mx.Dtype))
            in_types = [CUDA_TYPES[t] if not isinstance(t, str) else CUDA_TYPES[dict(template)[t]]
                        for t in input_dtypes]
            code.append(f"void kernel{n}({_signature(input_names, in_types, output_names, source)}) {{\n"
                        f"{types}{consts}{source}\n}}\n")
            dispatch.append((template, n, in_types))
        self.dispatch = {self._key(t): (n, tys) for t, n, tys in dispatch}
        code.append(self._main(dispatch, source))
        (self.workdir / "k.cpp").write_text("\n".join(code))
        self.binary = self.workdir / "k"
        out = subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{CUDA_INCLUDE}", "-o", str(self.binary),
                              str(self.workdir / "k.cpp")], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"g++ failed:\n{out.stderr[-5000:]}")

    @staticmethod
    def _key(template):
        return tuple((k, str(v)) for k, v in template)

    def _main(self, dispatch, source) -> str:
        """main(argv): instance, grid and block sizes, then each input's element count and shape
        (4 ints), then each output's element count; files in0.. and out0.. in the cwd."""
        lines = ["int main(int argc, char** argv) {", "  int a = 1; int inst = std::atoi(argv[a++]);",
                 "  gridDim = {unsigned(std::atoi(argv[a])), unsigned(std::atoi(argv[a+1])), "
                 "unsigned(std::atoi(argv[a+2]))}; a += 3;",
                 "  blockDim = {unsigned(std::atoi(argv[a])), 1, 1}; a += 1;"]
        n_in = len(self.input_names)
        lines.append(f"  size_t in_n[{n_in}]; Shape in_shape[{n_in}] = {{}};")
        lines.append(f"  for (int i = 0; i < {n_in}; ++i) {{ in_n[i] = std::atoll(argv[a++]); "
                     "for (int d = 0; d < 4; ++d) in_shape[i][d] = std::atoi(argv[a++]); }")
        n_out = len(self.output_names)
        lines.append(f"  std::vector<float> outs[{n_out}];")
        lines.append(f"  for (int i = 0; i < {n_out}; ++i) outs[i].assign(std::atoll(argv[a++]), -12345.f);")
        for template, n, in_types in dispatch:
            lines.append(f"  if (inst == {n}) {{")
            for i, ty in enumerate(in_types):
                lines.append(f"    auto in{i} = emu_read<{ty}>(\"in{i}\", in_n[{i}]);")
            args = []
            for i, name in enumerate(self.input_names):
                args.append(f"in{i}.data()")
                if name + "_shape" in source:
                    args.append(f"in_shape[{i}]")
            args += [f"outs[{i}].data()" for i in range(n_out)]
            lines += [
                "    for (unsigned z = 0; z < gridDim.z; ++z) for (unsigned y = 0; y < gridDim.y; ++y)",
                "    for (unsigned x = 0; x < gridDim.x; ++x) for (unsigned w = 0; w < blockDim.x / 32; ++w) {",
                "      blockIdx = {x, y, z};",
                f"      auto body = [&] {{ kernel{n}({', '.join(args)}); }};",
                "      emu_run_warp(w, body);",
                "    }",
                "  }",
            ]
        lines.append(f"  for (int i = 0; i < {n_out}; ++i) {{ FILE* f = std::fopen((\"out\" + std::to_string(i)).c_str(), "
                     "\"wb\"); std::fwrite(outs[i].data(), 4, outs[i].size(), f); std::fclose(f); }")
        lines.append("  return 0;\n}")
        return "\n".join(lines)

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        n, _types = self.dispatch[self._key(template)]
        tx = threadgroup[0]
        blocks = [-(-grid[0] // tx), grid[1], grid[2]]
        args = [str(n), *map(str, blocks), str(tx)]
        run = Path(tempfile.mkdtemp(dir=self.workdir))
        for i, x in enumerate(inputs):
            x = mx.contiguous(x)
            raw = np.array(x.view(mx.uint16)) if x.dtype in (mx.float16, mx.bfloat16) else np.array(x)
            raw.tofile(run / f"in{i}")
            shape = list(x.shape) + [0] * (4 - x.ndim)
            args += [str(x.size), *map(str, shape)]
        args += [str(int(np.prod(s))) for s in output_shapes]
        subprocess.run([str(self.binary), *args], cwd=run, check=True, timeout=120)
        # Written as float; a T output was rounded to T first, so the cast back is exact.
        outs = [mx.array(np.fromfile(run / f"out{i}", dtype=np.float32).reshape(s)).astype(dtype)
                for i, (s, dtype) in enumerate(zip(output_shapes, output_dtypes))]
        shutil.rmtree(run)
        return outs

"""Compile every Triton kernel an op launches for a GPU target, on a machine without one.

    python scripts/compile_check.py [--arch 90] [--shape 1x256x4x128] [--dtype bf16]
                                    [--configs default|all] [--resources]
                                    [--only NAME[,NAME]] [--keep-cache] [--varlen]
                                    [--ops gated_delta_rule,simple_gla,...,mamba2]

Runs the chunk and fused recurrent ops of the chosen families (``--ops``) forward +
backward on CPU tensors, but every launch of a tuned kernel is replaced by an offline
compilation with ``triton.compile`` for ``cuda:<arch>`` (nothing is executed: outputs
stay uninitialised), specialised as Triton's JIT would on a GPU. For each kernel and
config it prints the compile time and, with ``--resources``, the registers and spills
cuobjdump reports, the (dynamic) shared memory, how many programs fit an SM and what
limits them, the static count of local-memory loads/stores (LDL/STL) in the code, and the
scalar 16-bit global loads in the PTX (a tile whose mask cuts its contiguous dimension
loads element by element). A kernel that fails to compile on the installed Triton is
reported with the compiler's message.

Why: the CPU interpreter accepts code that the compiler refuses (a module-level global
inside ``@jit`` is one such case on Triton 3.6), and the cold-start budget (first call
at a new shape in ≤ 10 s) is mostly compile time. This checks both without a GPU.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
if "--keep-cache" not in sys.argv:
    # Compile times are only meaningful without Triton's on-disk cache.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fla-compile-check-")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fla.utils.backend as backend  # noqa: E402
import fla.ops.utils.tiles as tiles  # noqa: E402
from fla.utils.tuning import Config, TunedKernel  # noqa: E402

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
               torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


def signature_of(fn, named: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ``triton.compile`` from the launch's named
    values, specialised as Triton's JIT would on a GPU: pointers 16-byte aligned (every
    torch allocation is), integers divisible by 16 marked so and integers equal to 1
    made constants, except parameters the kernel exempts (``do_not_specialize``).
    Without the alignment facts every tile load compiles to scalar 2-byte loads, and
    the registers and spills reported are not those of the GPU's kernel."""
    sig, constexprs, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for i, param in enumerate(fn.params):
        name = param.name
        value = named.get(name, param.default if param.has_default else None)
        if param.is_constexpr or value is None:
            sig[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + DTYPE_NAMES[value.dtype]
            if not param.do_not_specialize_on_alignment:
                attrs[(i,)] = divisible
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                sig[name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            sig[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
            if value % 16 == 0 and not (param.do_not_specialize
                                        or param.do_not_specialize_on_alignment):
                attrs[(i,)] = divisible
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name} = {value!r}")
    return sig, constexprs, attrs


# sm_90 (H100, H200) per SM: 64K registers (allocated per warp in units of 256), 228 KB
# of shared memory with 1 KB reserved for each resident block, 64 warps.
SM_REGISTERS, SM_SHARED, BLOCK_RESERVED, SM_WARPS = 65536, 233472, 1024, 64


def programs_per_sm(regs: int, shared: int, warps: int) -> tuple[int, str]:
    """How many programs (blocks) of a kernel fit one sm_90 SM, and what limits it."""
    per_warp = -(-regs * 32 // 256) * 256
    limits = {"registers": SM_REGISTERS // (per_warp * warps),
              "shared memory": SM_SHARED // (shared + BLOCK_RESERVED),
              "warps": SM_WARPS // warps}
    which = min(limits, key=limits.get)
    return limits[which], which


def resource_report(compiled, warps: int) -> str:
    """Registers, spills, shared memory and programs an SM of a compiled kernel
    (cuobjdump's report and Triton's metadata), and its scalar 16-bit global loads."""
    cubin = compiled.asm["cubin"]
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True,
                             text=True)
        # Static counts of local-memory loads and stores in the code: how much of the
        # stack frame is spill traffic (a frame alone may only hold a local array).
        sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True,
                              text=True).stdout
    text = out.stdout + out.stderr
    ldl, stl = len(re.findall(r"\bLDL\b", sass)), len(re.findall(r"\bSTL\b", sass))
    regs = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    spill = re.search(r"LOCAL:(\d+)", text)
    if not regs:
        return "cuobjdump: " + text[-200:]
    # Triton's shared memory is dynamic: cuobjdump sees only the static 1 KB.
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    fit, limit = programs_per_sm(int(regs.group(1)), shared, warps)
    # Element-by-element loads of 16-bit data: a tile whose mask changes along its
    # contiguous dimension (per-token scalars such as beta load this way by nature).
    scalar16 = len(re.findall(r"ld\.global(?:\.[a-z0-9_:]+)*\.b16\b", compiled.asm["ptx"]))
    return (f"regs {regs.group(1)}, stack {stack.group(1) if stack else '?'} B, "
            f"local {spill.group(1) if spill else '?'} B, shared {shared / 1024:.1f} KB, "
            f"{fit} program{'s' if fit != 1 else ''} an SM ({limit}), LDL/STL {ldl}/{stl}, "
            f"16-bit scalar loads {scalar16}")


class OfflineCompiler:
    def __init__(self, arch: int, all_configs: bool, resources: bool):
        self.target = GPUTarget("cuda", arch, 32)
        self.arch, self.all_configs, self.resources = arch, all_configs, resources
        self.seen: set = set()
        self.only = ""
        self.failures = 0
        self.total_s = 0.0
        self.jobs: list = []  # with --jobs > 1: compiles queued, run together at the end
        self.parallel = False

    def launch(self, tuned: TunedKernel, grid, args, kwargs):
        if not any(part in tuned.name for part in self.only.split(",")):
            return
        named = tuned._bind(args, kwargs)
        configs = tuned.candidates(named) if self.all_configs else [tuned.default(named)]
        for config in configs:
            self.compile(tuned, config, named)

    def compile(self, tuned: TunedKernel, config: Config, named: dict) -> None:
        fn = tuned.kernel
        launch_args = {**named, **config.meta}
        sig, constexprs, attrs = signature_of(fn, launch_args)
        key = (tuned.name, repr(sorted(sig.items())), repr(sorted(constexprs.items(), key=str)),
               repr(sorted(attrs)), config.num_warps, config.num_stages, config.maxnreg)
        if key in self.seen:
            return
        self.seen.add(key)
        # The tuning key's values name the variant (e.g. a split pass's TRANSITION).
        variant = " ".join(f"{k}={v}" for k, v in zip(tuned.key, tuned.key_of(named)))
        if self.parallel:
            self.jobs.append(lambda: self._compile(tuned, config, fn, sig, constexprs, attrs,
                                                   variant))
            return
        self._compile(tuned, config, fn, sig, constexprs, attrs, variant)

    def _compile(self, tuned, config, fn, sig, constexprs, attrs, variant="") -> None:
        label = f"{tuned.name.split('.')[-1]} [{variant}] {config}"
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=self.target,
                                      options=config.options())
        except Exception as error:  # noqa: BLE001 - report every failure
            self.failures += 1
            print(f"FAIL  {label}: {type(error).__name__}: {str(error)[:1500]}", flush=True)
            return
        seconds = time.perf_counter() - t0
        self.total_s += seconds
        extra = (f" | {resource_report(compiled, config.num_warps)}" if self.resources
                 else "")
        print(f"ok    {seconds:6.2f} s  {label}{extra}", flush=True)


def plain_gla_backward(q, k, v, gk, u, h0) -> None:
    """GLA / RWKV6's backward step given no gated operands (what a forward that kept none
    leaves it): its state passes then gate q and k themselves, other kernel variants
    than the public op's forward + backward reach."""
    from fla.ops.gla import chunk as gla_chunk

    q, k, v, gk, h0 = (t.detach() for t in (q, k, v, gk, h0))
    u = None if u is None else u.detach()
    exclusive = u is not None
    _, _, g_cum, A, _, _ = gla_chunk._forward(q, k, v, gk, u, h0, 1.0, True, False, None,
                                              None, None, None, exclusive, v.dtype)
    gla_chunk._backward(q, k, v, gk, u, g_cum, A, None, None, h0, None, None, None, None,
                        torch.zeros_like(v), torch.zeros_like(h0), 1.0, exclusive)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--shape", default="1x200x2x128", help="BxTxHxD")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--configs", default="default", choices=["default", "all"])
    p.add_argument("--keep-cache", action="store_true",
                   help="use Triton's usual cache (default: a fresh one, for compile times)")
    p.add_argument("--only", default="",
                   help="compile only kernels whose name has this (comma-separated: any)")
    p.add_argument("--split", action="store_true",
                   help="force the segment split of the forward state passes (gated "
                        "delta rule, simple GLA; GLA and RWKV6 forward and backward)")
    p.add_argument("--resources", action="store_true",
                   help="registers, stack, local (spill) and shared memory per kernel")
    p.add_argument("--jobs", type=int, default=1,
                   help="compile in this many threads once every launch is recorded (does "
                        "Triton's compiler run in parallel within one process?)")
    p.add_argument("--varlen", action="store_true",
                   help="the B sequences packed into one row with uneven lengths "
                        "(cu_seqlens), for the kernels' IS_VARLEN variants")
    p.add_argument("--ops", default="gated_delta_rule",
                   help="comma-separated families: gated_delta_rule, simple_gla, dplr, "
                        "gla, rwkv6")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    B, T, H, D = (int(x) for x in args.shape.split("x"))

    compiler = OfflineCompiler(args.arch, args.configs == "all", args.resources)
    compiler.only = args.only
    compiler.parallel = args.jobs > 1
    # The launchers run on CPU tensors as if on the GPU: Triton path chosen, kernels
    # compiled instead of launched.
    backend.is_interpreter = lambda: True
    tiles.is_interpreter = lambda: True
    TunedKernel.launch = lambda self, grid, a, kw: compiler.launch(self, grid, a, kw)

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.gated_delta_rule.gate import gated_delta_rule_gate
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    from fla.ops.generalized_delta_rule import (chunk_dplr_delta_rule,
                                                fused_recurrent_dplr_delta_rule)
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    from fla.ops.rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6
    from fla.ops.mamba2 import mamba_chunk_scan_combined
    families = {
        "gla": (chunk_gla, fused_recurrent_gla),
        "rwkv6": (chunk_rwkv6, fused_recurrent_rwkv6),
        "gated_delta_rule": (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule),
        "simple_gla": (chunk_simple_gla, fused_recurrent_simple_gla),
        "dplr": (chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule),
        # Simple GLA's kernels behind Mamba2's own: time steps, operands, skip and gate.
        "mamba2": (mamba_chunk_scan_combined,),
    }
    if args.split:
        import fla.ops.common.chunk_segments as segments
        segments.segment_chunks_for = lambda *args: 1
    print(f"triton {triton.__version__}, target sm_{args.arch}, {args.shape} {args.dtype}"
          f"{' varlen' if args.varlen else ''}", flush=True)
    N = B  # sequences
    packed = {}
    if args.varlen:  # B sequences of uneven lengths (T -+ 13) in one row of B·T tokens
        lengths = [T + (13 if i % 2 else -13) for i in range(N - 1)]
        lengths.append(N * T - sum(lengths))
        packed["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(lengths)])
        B, T = 1, N * T
    t0 = time.perf_counter()
    for family in args.ops.split(","):
        for op in families[family]:
            call = functools.partial(op, **packed)
            q, k, v = (torch.randn(B, T, H, D, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            g = torch.rand(B, T, H).neg().requires_grad_()
            h0 = torch.randn(N, H, D, D, requires_grad=True)
            if family == "dplr":  # gk, a, b: [B, T, H, K] like q
                gk = torch.rand(B, T, H, D).neg().requires_grad_()
                a, b = (torch.randn(B, T, H, D, dtype=dtype, requires_grad=True)
                        for _ in range(2))
                o, ht = call(q, k, v, a, b, gk, initial_state=h0, output_final_state=True)
            elif family in ("gla", "rwkv6"):  # vector gate [B, T, H, K] like q
                gk = torch.rand(B, T, H, D).neg().requires_grad_()
                if family == "rwkv6":
                    u = torch.randn(H, D, dtype=dtype, requires_grad=True)
                    o, ht = call(q, k, v, gk, u, initial_state=h0, output_final_state=True)
                elif op is chunk_gla:
                    o, ht = call(q, k, v, gk, initial_state=h0, output_final_state=True)
                else:  # the recurrent kernels with both gates
                    gv = torch.rand(B, T, H, D).neg().requires_grad_()
                    o, ht = call(q, k, v, gk, gv, initial_state=h0, output_final_state=True)
            elif family == "mamba2":  # x [B, T, H, P = D], one group of B, C (N = D)
                dt = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
                A, skip, dt_bias = (torch.randn(H, requires_grad=True) for _ in range(3))
                Bm, Cm = (torch.randn(B, T, 1, D, dtype=dtype, requires_grad=True)
                          for _ in range(2))
                o, ht = call(q, dt, A, Bm, Cm, 64, D=skip, z=k, dt_bias=dt_bias,
                             dt_softplus=True, initial_states=h0, return_final_states=True)
            elif family == "gated_delta_rule":
                beta = torch.rand(B, T, H, dtype=dtype, requires_grad=True)
                o, ht = call(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                if op is chunk_gated_delta_rule:  # the layer's gate kernels, fwd + bwd
                    ab = torch.randn(B, T, 2 * H, dtype=dtype, requires_grad=True)
                    a_log, dt_bias = (torch.randn(H, requires_grad=True) for _ in range(2))
                    g_gate, beta_gate = gated_delta_rule_gate(ab, a_log, dt_bias)
                    (g_gate.sum() + beta_gate.float().sum()).backward()
            else:
                o, ht = call(q, k, v, g, initial_state=h0, output_final_state=True)
                with torch.no_grad():  # simple GLA's inference forward takes other kernels
                    call(q, k, v, g, initial_state=h0, output_final_state=True)
            (o.float().sum() + ht.sum()).backward()
            if family == "gated_delta_rule":
                # No final-state gradient: with --split (or a shape that splits), the
                # reverse pass's X-only transitions.
                o, _ = call(q, k, v, g, beta, initial_state=h0)
                o.float().sum().backward()
            if op in (chunk_gla, chunk_rwkv6):
                plain_gla_backward(q, k, v, gk, u if family == "rwkv6" else None, h0[:B])
    if compiler.jobs:
        from concurrent.futures import ThreadPoolExecutor

        # The first compile runs alone: Triton's first call fills lazy process-wide state
        # (its cache key reads sysconfig, whose lazy fill is not thread-safe: on Triton
        # 3.3 a thread racing it saw EXT_SUFFIX as None and its compile failed).
        compiler.jobs[0]()
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda job: job(), compiler.jobs[1:]))
    print(f"{len(compiler.seen)} kernels compiled in {compiler.total_s:.1f} s "
          f"({time.perf_counter() - t0:.1f} s wall), {compiler.failures} failed")
    return 1 if compiler.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""W8A16 / W4A16 Triton kernels, run by the Triton interpreter on CPU tensors, against a float64 reference.

How interpreter mode is switched on (read in triton 3.9's source): `TRITON_INTERPRET` is the knob
`triton.knobs.runtime.interpret`, an `env_bool` descriptor that re-reads os.environ on every access unless a value
was assigned to the knob itself (an assignment wins over the environment and is also written back to it).
`triton.jit` consults it exactly once, when it decorates a function: interpreted -> `InterpretedFunction`,
otherwise a compiled-mode `JITFunction`. Nothing in the interpreter reads it again at call time. Consequences:
- triton's own helpers in `triton.language.standard` (`tl.zeros`, `tl.sum`, ...) are jit functions too, fixed
  when triton is first imported. Imported without the variable, they are compiled-mode, and an interpreted
  kernel calling them fails ("Cannot call @triton.jit'd outside of the scope of a kernel"). The kernels avoid
  them (module docstring). This pytest process is that case on purpose: `importorskip` imports triton before the
  knob is forced; `test_fresh_process_with_variable_set_before_import` covers the other case in a subprocess.
- `posttrain.quant.triton_kernels` may already sit in sys.modules, imported by another test without the
  variable, with compiled-mode kernels that cannot take CPU tensors.
Hence `_load_kernels` executes a private copy of the module file under its own name inside
`triton.knobs.runtime.scope()`, with the knob forced; the scope restores os.environ and the knobs afterwards, so
interpreter mode does not leak into other tests, and sys.modules is left untouched.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the W8A16/W4A16 kernel tests need it")
triton_check = importlib.import_module("posttrain.quant.triton_check")  # after the skip: it imports triton

KERNELS_FILE = Path(__file__).resolve().parents[2] / "posttrain" / "quant" / "triton_kernels.py"
# Elementwise check |y - ref| <= RTOL |ref| + ATOL max|ref|: RTOL covers rounding the output to its dtype
# (unit roundoff 2^-24 / 2^-11 / 2^-8), ATOL the fp32 accumulation over K.
RTOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def _load_kernels(interpret: bool, name: str):
    """Execute a fresh copy of triton_kernels.py with the interpreter knob forced on or off."""
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        spec = importlib.util.spec_from_file_location(name, KERNELS_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tk():
    module = _load_kernels(True, "_triton_kernels_interpreted")
    assert module.interpreter_active()
    return module


# ------------------------------------------------------------------ independent weights and float64 dequantization
def _int8_weight(N, K, gen):
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    scale = (0.5 + torch.rand(N, generator=gen)) / 100
    return q, scale, q.double() * scale.double()[:, None]


def _int4_weight(N, K, group_size, symmetric, gen):
    n_groups = K // group_size
    low, high = (-8, 8) if symmetric else (0, 16)
    q = torch.randint(low, high, (N, K), dtype=torch.int8, generator=gen)
    scale = (0.5 + torch.rand(N, n_groups, generator=gen)) / 10
    zero = None if symmetric else torch.randint(0, 16, (N, n_groups), dtype=torch.int8, generator=gen)
    w64 = torch.empty(N, K, dtype=torch.float64)
    for g in range(n_groups):  # dequantize group by group, written out plainly
        cols = slice(g * group_size, (g + 1) * group_size)
        z = 0.0 if zero is None else zero[:, g : g + 1].double()
        w64[:, cols] = (q[:, cols].double() - z) * scale[:, g : g + 1].double()
    return q, scale, zero, w64


def _assert_close(y, x, w64, what):
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w64.shape[0]), what
    ref = x.double() @ w64.T
    bound = RTOL[x.dtype] * ref.abs() + ATOL[x.dtype] * ref.abs().max()
    err = (y.double() - ref).abs()
    assert torch.all(err <= bound), f"{what}: max err {err.max():.3g}, worst err/bound {(err / bound).max():.3g}"


def _activations(M, K, dtype, gen):
    return torch.randn(M, K, generator=gen).to(dtype)


# ------------------------------------------------------------------ packing
def test_pack_int4_layout_and_roundtrip(tk):
    gen = torch.Generator().manual_seed(0)
    for low, high, signed in ((-8, 8, True), (0, 16, False)):
        q = torch.randint(low, high, (5, 12), dtype=torch.int8, generator=gen)
        packed = tk.pack_int4(q)
        assert packed.dtype == torch.uint8 and packed.shape == (5, 6)
        for n in range(5):
            for j in range(6):  # low nibble k = 2j, high nibble k = 2j + 1, each the code's low 4 bits
                expected = (int(q[n, 2 * j]) & 15) | ((int(q[n, 2 * j + 1]) & 15) << 4)
                assert int(packed[n, j]) == expected
        assert torch.equal(tk.unpack_int4(packed, signed=signed), q)


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(2, 4, dtype=torch.int32), "int8"),
    (torch.zeros(2, 5, dtype=torch.int8), "even"),
    (torch.full((2, 4), 16, dtype=torch.int8), r"\[-8, 7\]"),
    (torch.full((2, 4), -9, dtype=torch.int8), r"\[-8, 7\]"),
])
def test_pack_int4_rejects_bad_codes(tk, bad, message):
    with pytest.raises(ValueError, match=message):
        tk.pack_int4(bad)


# ------------------------------------------------------------------ correctness against float64
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8a16_matches_float64_reference(tk, M, dtype):
    gen = torch.Generator().manual_seed(M)
    for N in (5, 33, 64):
        for K in (64, 96, 160):
            q, scale, w64 = _int8_weight(N, K, gen)
            x = _activations(M, K, dtype, gen)
            _assert_close(tk.w8a16_matmul(x, q, scale), x, w64, f"w8a16 M={M} N={N} K={K} {dtype}")


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w4a16_matches_float64_reference(tk, M, symmetric, dtype):
    gen = torch.Generator().manual_seed(10 * M + symmetric)
    for N in (5, 33, 64):
        for K, group_size in ((64, 32), (64, 64), (96, 32), (160, 32), (256, 128)):
            q, scale, zero, w64 = _int4_weight(N, K, group_size, symmetric, gen)
            x = _activations(M, K, dtype, gen)
            y = tk.w4a16_matmul(x, tk.pack_int4(q), scale, zero, group_size)
            _assert_close(y, x, w64, f"w4a16 sym={symmetric} M={M} N={N} K={K} G={group_size} {dtype}")


@pytest.mark.parametrize("kernel, M", [("gemv", 17), ("gemm", 1), ("gemm", 3)])
def test_both_kernels_handle_any_m(tk, kernel, M):
    """The dispatch picks gemv for small M; forcing the other kernel must give the same correct answer."""
    gen = torch.Generator().manual_seed(7)
    q8, scale8, w8 = _int8_weight(33, 96, gen)
    x = _activations(M, 96, torch.float32, gen)
    _assert_close(tk.w8a16_matmul(x, q8, scale8, kernel=kernel), x, w8, f"w8a16 {kernel} M={M}")
    for symmetric in (True, False):
        q4, scale4, zero4, w4 = _int4_weight(33, 96, 32, symmetric, gen)
        y = tk.w4a16_matmul(x, tk.pack_int4(q4), scale4, zero4, 32, kernel=kernel)
        _assert_close(y, x, w4, f"w4a16 sym={symmetric} {kernel} M={M}")


@pytest.mark.parametrize("M", [1, 17])
def test_bfloat16_activations(tk, M):
    gen = torch.Generator().manual_seed(3)
    q8, scale8, w8 = _int8_weight(33, 96, gen)
    q4, scale4, zero4, w4 = _int4_weight(33, 96, 32, False, gen)
    x = _activations(M, 96, torch.bfloat16, gen)
    _assert_close(tk.w8a16_matmul(x, q8, scale8), x, w8, f"w8a16 bf16 M={M}")
    _assert_close(tk.w4a16_matmul(x, tk.pack_int4(q4), scale4, zero4, 32), x, w4, f"w4a16 bf16 M={M}")


def test_odd_group_size_and_leading_batch_dims(tk):
    """Group size 3 puts the two codes of a byte in different groups; x [2, 3, K] must give y [2, 3, N]."""
    gen = torch.Generator().manual_seed(5)
    for symmetric in (True, False):
        q, scale, zero, w64 = _int4_weight(9, 96, 3, symmetric, gen)
        x = torch.randn(2, 3, 96, generator=gen)
        y = tk.w4a16_matmul(x, tk.pack_int4(q), scale, zero, 3)
        _assert_close(y, x, w64, f"w4a16 G=3 sym={symmetric}")
    q8, scale8, w8 = _int8_weight(9, 96, gen)
    x = torch.randn(2, 3, 96, generator=gen)
    _assert_close(tk.w8a16_matmul(x, q8, scale8), x, w8, "w8a16 batch dims")
    vector = torch.randn(96, generator=gen)  # a bare [K] vector gives a bare [N] output
    assert tk.w8a16_matmul(vector, q8, scale8).shape == (9,)
    assert tk.w8a16_matmul(torch.randn(0, 96), q8, scale8).shape == (0, 9)  # empty batch: no launch


# ------------------------------------------------------------------ errors
def _error_cases(tk):
    q8, s8 = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    p4, s4, z4 = torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2), torch.zeros(8, 2, dtype=torch.int8)
    x = torch.randn(2, 64)
    return [
        (lambda: tk.w8a16_matmul(x.to(torch.int32), q8, s8), "x must be a float16/bfloat16/float32"),
        (lambda: tk.w8a16_matmul(torch.randn(2, 63), q8, s8), r"x must have shape \[..., K=64\]"),
        (lambda: tk.w8a16_matmul(x, q8.float(), s8), r"q must be torch.int8 \(8, 64\)"),
        (lambda: tk.w8a16_matmul(x, q8, torch.ones(8, 1)), r"scale must be torch.float32 \(8,\)"),
        (lambda: tk.w8a16_matmul(x, q8, s8.half()), "scale must be torch.float32"),
        (lambda: tk.w8a16_matmul(x, q8, None), "scale must be a torch.float32 tensor"),
        (lambda: tk.w8a16_matmul(x, q8, s8.to("meta")), "scale is on meta but x is on cpu"),
        (lambda: tk.w8a16_matmul(x, q8, s8, kernel="fast"), "kernel must be"),
        (lambda: tk.w4a16_matmul(x, p4, s4, z4, 48), "group_size=48 must be a positive int dividing K=64"),
        (lambda: tk.w4a16_matmul(x, p4, s4, z4, 0), "group_size=0"),
        (lambda: tk.w4a16_matmul(x, p4.to(torch.int8), s4, z4, 32), "packed must be torch.uint8"),
        (lambda: tk.w4a16_matmul(x, p4, torch.ones(8, 4), z4, 32), r"scale must be torch.float32 \(8, 2\)"),
        (lambda: tk.w4a16_matmul(x, p4, s4, z4.to(torch.uint8), 32), "zero must be torch.int8"),
        (lambda: tk.w4a16_matmul(x, p4.flatten(), s4, z4, 32), "packed must be a uint8 tensor"),
    ]


def test_clear_errors_for_wrong_inputs(tk):
    for call, message in _error_cases(tk):
        with pytest.raises(ValueError, match=message):
            call()


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    """The loader overrides a hostile prior state (variable set to 0), and restores it afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    interpreted = _load_kernels(True, "_triton_kernels_forced_on")
    compiled = _load_kernels(False, "_triton_kernels_compiled")
    assert interpreted.interpreter_active() and not compiled.interpreter_active()
    assert triton.knobs.runtime.interpret is False  # environment "0" is back in charge
    q, scale = torch.zeros(4, 32, dtype=torch.int8), torch.ones(4)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        compiled.w8a16_matmul(torch.randn(1, 32), q, scale)


def test_fresh_process_with_variable_set_before_import():
    """The documented usage: TRITON_INTERPRET=1 in the environment before anything imports triton (triton's own
    helpers are then interpreted too, unlike in this pytest process where triton was imported first)."""
    script = (
        "import torch, triton\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "from posttrain.quant import triton_kernels as tk\n"
        "assert isinstance(triton.language.standard.zeros, InterpretedFunction) and tk.interpreter_active()\n"
        "from posttrain.quant import triton_check\n"
        "rows = triton_check.check_kernels_against_reference('cpu', shapes=[(3, 20, 64), (17, 20, 64)],"
        " dtypes=[torch.float16])\n"
        "assert len(rows) == 6 and all(row['ok'] for row in rows), rows\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=KERNELS_FILE.parents[2], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


# ------------------------------------------------------------------ the GPU path, compiled ahead of time for sm_90
@pytest.mark.parametrize("fmt, kernel, dtype, has_zero", [
    ("int8", "gemv", "bf16", None), ("int8", "gemm", "bf16", None),
    ("int4", "gemv", "bf16", False), ("int4", "gemv", "fp16", True), ("int4", "gemm", "bf16", True),
])
def test_kernels_compile_for_hopper(tmp_path, monkeypatch, fmt, kernel, dtype, has_zero):
    """No GPU here, but triton (with its bundled ptxas) can compile for an H200 (sm_90): this catches code that
    only the interpreter accepts. Gemm must use Hopper tensor cores (wgmma); gemv must load weights vectorized."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiled = _load_kernels(False, "_triton_kernels_aot")
    name = {"int8": "_w8a16", "int4": "_w4a16"}[fmt] + f"_{kernel}_kernel"
    fn = getattr(compiled, name)
    M = 1 if kernel == "gemv" else 64
    config = compiled._launch_config(fmt, kernel, M, interpreted=False)
    options = {key: config.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion")}
    if fmt == "int4":
        config.update(GROUP_SIZE=128, HAS_ZERO=has_zero)
    if kernel == "gemm":
        config["LOW_PRECISION_DOT"] = True
    # like the runtime specialisation of contiguous tensors: unit strides become constants, the rest i32
    unit_strides = {"sxk", "sqk", "spj", "ssg", "szg", "syn"}
    pointer_types = {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "q_ptr": "*i8", "p_ptr": "*u8",
                     "scale_ptr": "*fp32", "s_ptr": "*fp32", "z_ptr": "*i8" if has_zero else "*fp32"}
    constants = {**config, **{p.name: 1 for p in fn.params if p.name in unit_strides}}
    signature = {p.name: "constexpr" if p.name in constants else pointer_types.get(p.name, "i32") for p in fn.params}
    divisible = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if signature[p.name] != "constexpr"}
    binary = triton.compile(ASTSource(fn, signature, constants, divisible), target=GPUTarget("cuda", 90, 32),
                            options=options)
    ptx = binary.asm["ptx"]
    if kernel == "gemm":
        assert "wgmma" in ptx, f"{name} {dtype}: no Hopper tensor-core instruction in the PTX"
    else:
        assert "ld.global.v" in ptx, f"{name} {dtype}: weight loads are not vectorized"


# ------------------------------------------------------------------ GPU check helpers, tiny CPU path
def test_check_kernels_against_reference_runs_in_interpreter(tk):
    rows = triton_check.check_kernels_against_reference(device="cpu", kernels=tk)
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"w8a16", "w4a16_sym", "w4a16_asym"}
    assert {row["dtype"] for row in rows} == {"float32", "float16", "bfloat16"}
    assert {row["shape"][0] for row in rows} == {1, 17}  # one decode (gemv) and one prefill (gemm) shape
    for row in rows:
        assert row["ok"] and 0 < row["max_rel_err"] < 1e-2, row


def test_time_kernels_runs_in_interpreter(tk):
    rows = triton_check.time_kernels(device="cpu", kernels=tk)
    assert [row["kernel"] for row in rows] == ["w8a16", "w4a16_sym", "w4a16_asym"]
    M, N, K = rows[0]["shape"]
    for row in rows:
        assert row["us_per_call"] > 0 and row["gb_per_s"] > 0
    # weight bytes: int8 codes + fp32 per-channel scale; int4 half a byte a code + fp32 (+ int8 zero) per group
    assert rows[0]["weight_bytes"] == N * K + 4 * N
    assert rows[1]["weight_bytes"] == N * K // 2 + 4 * N * K // 32
    assert rows[2]["weight_bytes"] == N * K // 2 + 5 * N * K // 32

"""The project's int4 asymmetric round to nearest at group 32 on SmolLM2's Q4_1 weights (`model=smollm2-135m`).

GGUF Q4_1 stores each block of 32 consecutive input columns of a linear as d * q + m, q in 0..15, d and m float16,
so the dequantized copy is a 16-level grid per block. The project's asymmetric int4 stores (q - z) * scale with an
integer zero point z: its grid always holds 0, a Q4_1 grid only when m is a multiple of d. So the round trip is
not exact: scale comes out as d, z = round(-m / d), and every value of a block comes back shifted by the same
offset m + z * d, at most d / 2 (a block whose -m / d is a half-integer rounds its codes both ways: +-d / 2).
Blocks whose m is a multiple of d come back exactly.

Measured on all 210 Q4_1 linears (float64 error of the float32 round trip, ~10 s): relative error 0.0823 overall,
0.0802 to 0.0918 per linear, exactly what the offsets predict from d and m alone; largest |error| d / 2; of the
3,317,760 blocks 8,992 (0.27%) come back exactly and 4,197 (0.13%) are ties; within every other block the error is
the predicted constant with no rounding residue at all. Broken quantizers, tried by hand once against these checks:

    symmetric g32                         rel 0.1011 (0.0981..0.1200)  |error| up to 0.98 d, 17% beyond d / 2
    asymmetric g64                        rel 0.0937 (0.0912..0.1090)  up to 6.6 d, 12% beyond d / 2
    asymmetric g32 along the output axis  rel 0.0839 (0.0806..0.0938)  up to 9.4 d, 12% beyond d / 2
    asymmetric g32 shifted half a block   rel 0.0825 (0.0807..0.0909)  up to 6.6 d, 6% beyond d / 2
    asymmetric g16                        rel 0.0703 (0.0693..0.0759)  within d / 2, 98% of blocks not one constant

The relative-error bounds alone catch only the first two (a group that straddles blocks costs little on average);
the per-block checks catch all five, and none of them comes back exact on just the 8,992 blocks it should.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.test_smollm2 import needs_smollm2

pytestmark = [pytest.mark.slow, needs_smollm2]

BLOCK = 32  # Q4_1 values per block, along each row
Q4_1_BYTES = 20  # per block: float16 d, float16 m, 16 bytes of 4-bit codes
GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}
MAX_REL_ERROR = 0.085  # over all linears (measured 0.0823)
MAX_LAYER_REL_ERROR = 0.095  # any one linear (measured at most 0.0918)
TIE = 1e-6  # -m / d this close to a half-integer counts as a tie: float32 may round its codes either way


def q4_1_blocks(tensor, heads: int | None):
    """(d, m) float64 [out, in / 32] of a Q4_1 GGUF tensor, rows in transformers' order: the GGUF converter interleaves
    the rows of q and k per head (for its rotary layout) and transformers undoes that; `heads` says by how many."""
    import numpy as np
    import torch

    raw = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, Q4_1_BYTES)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
    if heads is not None:
        d, m = (x.reshape(heads, x.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(x.shape) for x in (d, m))
    return d, m


def roundtrip_asym_g32(w):
    """The project's int4 asymmetric round to nearest at group 32, and back: [out, in] -> float64 [out, in]."""
    import torch

    from posttrain.quant.formats import dequantize_weight, quantize_weight

    return dequantize_weight(quantize_weight(w, "int4", group_size=BLOCK, symmetric=False), torch.float64)


def block_errors(w, d, m, roundtrip=roundtrip_asym_g32) -> dict:
    """Compare the round trip of weight w [out, in] with what Q4_1's blocks (d, m) [out, in / 32] predict.

    Returns the grid residual (how far w is from m + d * q with integer q in 0..15: 0 for a Q4_1 copy), the
    relative error, the largest |error| / d, and per block: exact (error 0), tie, and whether the error is the
    predicted constant offset -(m + round(-m / d) * d).
    """
    import torch

    w64 = w.double().reshape(w.shape[0], -1, BLOCK)
    codes = (w64 - m[..., None]) / d[..., None]
    grid_residual = (codes - codes.round()).abs().max().item()
    codes_in_range = bool(((codes.round() >= 0) & (codes.round() <= 15)).all())
    err = (roundtrip(w) - w.double()).reshape_as(w64)
    ratio = -m / d
    tie = (ratio - ratio.floor() - 0.5).abs() < TIE
    offset = m + ratio.round() * d  # torch rounds half to even, as the quantizer's zero point does
    as_predicted = ((err + offset[..., None]).abs().amax(-1) <= 1e-7 * d) | tie
    return {
        "grid_residual": grid_residual, "codes_in_range": codes_in_range,
        "zero_in_range": bool(((m <= 0) & (m + 15 * d >= 0)).all()),
        "rel_error": (err.norm() / w64.norm()).item(), "sq_error": err.pow(2).sum().item(),
        "sq_weight": w64.pow(2).sum().item(),
        "predicted_sq_error": torch.where(tie, d / 2, offset).pow(2).sum().item() * BLOCK,
        "max_error_of_d": (err.abs() / d[..., None]).max().item(),
        "beyond_half_d": int((err.abs() > d[..., None] * (0.5 + 1e-7)).sum()),
        "blocks": d.numel(), "exact": int((err.abs().amax(-1) == 0).sum()), "exact_expected": int((offset == 0).sum()),
        "ties": int(tie.sum()), "not_as_predicted": int((~as_predicted).sum()),
    }


@pytest.fixture(scope="module")
def q4_1_linears():
    """[(name, weight of the cached float32 copy, d, m)] for every linear the GGUF stores as Q4_1."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoConfig

    from posttrain.config import compose
    from posttrain.models import loading

    cfg = compose(["model=smollm2-135m"])
    location = loading.model_location(cfg.model, None)
    config = AutoConfig.from_pretrained(location)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    reader = gguf.GGUFReader(loading.resolve_gguf(cfg.model.name_or_path, cfg.model.gguf_file))
    found = []
    with safe_open(location / "model.safetensors", "pt") as copy:
        for tensor in reader.tensors:
            if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                continue
            _, layer, kind, _ = tensor.name.split(".")  # blk.<layer>.<kind>.weight
            name = f"model.layers.{layer}.{GGUF_NAMES[kind]}.weight"
            found.append((name, copy.get_tensor(name), *q4_1_blocks(tensor, heads.get(kind))))
    return found


def test_asymmetric_int4_g32_reproduces_q4_1_blocks_up_to_the_zero_point(q4_1_linears):
    started = time.perf_counter()
    reports = {name: block_errors(w, d, m) for name, w, d, m in q4_1_linears}
    took = time.perf_counter() - started
    assert len(reports) == 7 * 30  # q, k, v, o, gate, up, down in each of the 30 layers (the embedding is Q8_0)

    total = {key: sum(r[key] for r in reports.values()) for key in
             ("sq_error", "sq_weight", "predicted_sq_error", "blocks", "exact", "exact_expected", "ties",
              "beyond_half_d", "not_as_predicted")}
    rel = (total["sq_error"] / total["sq_weight"]) ** 0.5
    layer_rel = [r["rel_error"] for r in reports.values()]
    print(f"\nsmollm2: int4 asym g32 round trip of {len(reports)} Q4_1 linears in {took:.1f} s: relative error "
          f"{rel:.4f} (predicted {(total['predicted_sq_error'] / total['sq_weight']) ** 0.5:.4f}; per linear "
          f"{min(layer_rel):.4f}..{max(layer_rel):.4f}), largest |error| "
          f"{max(r['max_error_of_d'] for r in reports.values()):.3f} d; of {total['blocks']} blocks "
          f"{total['exact']} exact, {total['ties']} ties")

    # The premise: the copy holds Q4_1's grid, read from the GGUF's own d and m, on the right rows and axis.
    assert max(r["grid_residual"] for r in reports.values()) < 1e-4
    assert all(r["codes_in_range"] and r["zero_in_range"] for r in reports.values())
    # The integer zero point: each block is off by one constant, |offset| <= d / 2, and exact where m / d is whole.
    assert total["beyond_half_d"] == 0
    assert total["not_as_predicted"] == 0
    assert total["exact"] == total["exact_expected"] > 0
    assert total["sq_error"] == pytest.approx(total["predicted_sq_error"], rel=1e-6)
    assert rel < MAX_REL_ERROR
    assert max(layer_rel) < MAX_LAYER_REL_ERROR

"""llama.cpp's Q4_K and Q6_K encoders in numpy: the two block types a Q4_K_M GGUF file is made of.

The `gguf` package decodes every K-quant but encodes none of them, and llama.cpp's encoders are C behind its
`llama-quantize` tool, so this module is a port of its reference (no importance matrix) path, one super-block of
256 weights at a time, vectorised over all super-blocks of a tensor:

- Q4_K (144 bytes per 256 weights, 4.5 bits each): fp16 d and dmin, then eight sub-blocks of 32 with a 6-bit scale
  and a 6-bit min each (packed into 12 bytes), then 4-bit codes; w = d * sc * q - dmin * m. Each sub-block's
  scale and min come from a weighted least-squares search over 21 candidate scales (weights |x| + rms(x)).
- Q6_K (210 bytes per 256 weights, 6.5625 bits each): 4 low bits, 2 high bits, sixteen int8 sub-block scales of
  16 weights, fp16 d; w = d * sc * (q - 32). Each sub-block's scale comes from a search over 19 candidates,
  weighted by x^2.

Sums run element by element in float32, in llama.cpp's order, so that the candidate each search keeps is the one
the C code keeps; `nearest_int` is round-half-to-even, as np.rint. tests/integration/test_gguf_llamacpp.py holds
the output to llama.cpp's own quantizer, block for block and byte for byte.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BYTES = 144
Q6_K_BYTES = 210
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32


def _seq_sum(values: np.ndarray) -> np.ndarray:
    """Sum over the last axis one element at a time in float32 (the C loops' order, not numpy's pairwise sum)."""
    total = values[..., 0].copy()
    for i in range(1, values.shape[-1]):
        total += values[..., i]
    return total


def _blocks(rows: np.ndarray) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=F32)
    if rows.ndim != 2 or rows.shape[1] % QK_K:
        raise ValueError(f"K-quants need rows whose length is a multiple of {QK_K}, got shape {rows.shape}")
    return rows.reshape(-1, QK_K)


def _make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Scale, min and codes for each row of x [n, 32] (llama.cpp's make_qkx2_quants, squared error)."""
    x_min = np.minimum(x.min(axis=1), F32(0))
    x_max = x.max(axis=1)
    sum_w = _seq_sum(weights)
    sum_x = _seq_sum(weights * x)
    flat = x_max == x_min
    span = np.where(flat, F32(1), x_max - x_min)
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    codes = np.clip(np.rint(iscale[:, None] * (x - x_min[:, None])), 0, nmax).astype(F32)
    diff = scale[:, None] * codes + x_min[:, None] - x
    best_error = _seq_sum(weights * (diff * diff))
    low = x_min.copy()  # the C code's `min`: each step measures from the best min found so far, not x's min
    for step in range(nstep + 1):
        span = np.where(flat, F32(1), x_max - low)
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / span
        trial = np.clip(np.rint(iscale[:, None] * (x - low[:, None])), 0, nmax).astype(F32)
        sum_l = _seq_sum(weights * trial)
        sum_l2 = _seq_sum(weights * trial * trial)
        sum_xl = _seq_sum(weights * trial * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = this_min > 0
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, F32(1)), this_scale)
        this_min = np.where(positive, F32(0), this_min)
        diff = this_scale[:, None] * trial + this_min[:, None] - x
        cur_error = _seq_sum(weights * (diff * diff))
        better = ok & (cur_error < best_error) & ~flat
        codes[better] = trial[better]
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    scale = np.where(flat, F32(0), scale)
    codes[flat] = 0
    return scale.astype(F32), (-low).astype(F32), codes


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float rows [n, k] (k a multiple of 256) -> Q4_K blocks as uint8 [n, k // 256 * 144]."""
    n_rows = np.asarray(rows).shape[0]
    x = _blocks(rows)  # [B, 256]
    n_blocks = x.shape[0]
    sub = x.reshape(n_blocks * 8, 32)
    av_x = np.sqrt(_seq_sum(sub * sub) / F32(32))
    weights = av_x[:, None] + np.abs(sub)
    scales, mins, codes = _make_qkx2_quants(sub, weights, 15, -1.0, 0.1, 20)
    scales, mins = scales.reshape(n_blocks, 8), mins.reshape(n_blocks, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, F32(1)), F32(0))
    inv_min = np.where(max_min > 0, F32(63) / np.where(max_min > 0, max_min, F32(1)), F32(0))
    ls = np.minimum(np.rint(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    packed_scales = np.zeros((n_blocks, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = ls[:, 0:4]
    packed_scales[:, 4:8] = lm[:, 0:4]
    packed_scales[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    packed_scales[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    packed_scales[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    d16 = (max_scale / F32(63)).astype(np.float16)
    dmin16 = (max_min / F32(63)).astype(np.float16)
    # Codes again against the scales as stored (fp16 d times a 6-bit integer), as the reference does.
    d = d16.astype(F32)[:, None] * ls.astype(F32)  # [B, 8]
    dm = dmin16.astype(F32)[:, None] * lm.astype(F32)
    codes = codes.reshape(n_blocks, 8, 32)
    usable = d != 0
    requant = np.clip(np.rint((x.reshape(n_blocks, 8, 32) + dm[..., None]) / np.where(usable, d, F32(1))[..., None]),
                      0, 15)
    codes = np.where(usable[..., None], requant, codes).astype(np.uint8).reshape(n_blocks, 4, 2, 32)
    qs = (codes[:, :, 0, :] | (codes[:, :, 1, :] << 4)).reshape(n_blocks, 128)
    out = np.concatenate([d16.view(np.uint8).reshape(n_blocks, 2), dmin16.view(np.uint8).reshape(n_blocks, 2),
                          packed_scales, qs], axis=1)
    return out.reshape(n_rows, -1)


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int):
    """Scale and codes (offset by nmax) for each row of x [n, 16], weights x^2 (make_qx_quants, rmse_type 1)."""
    index = np.abs(x).argmax(axis=1)  # the first largest |x|, as the C loop's strict comparison keeps
    signed_max = x[np.arange(x.shape[0]), index]
    zero = np.abs(signed_max) < GROUP_MAX_EPS
    safe_max = np.where(zero, F32(1), signed_max)
    weights = x * x

    def trial(iscale):
        levels = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1).astype(F32)
        return levels, _seq_sum(weights * x * levels), _seq_sum(weights * levels * levels)

    levels, sumlx, suml2 = trial(F32(-nmax) / safe_max)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1)), F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        cand, sumlx, suml2 = trial(-(F32(nmax) + F32(0.1) * F32(step)) / safe_max)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels[better] = cand[better]
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, F32(1)), scale)
        best = np.where(better, scale * sumlx, best)
    scale = np.where(zero, F32(0), scale)
    codes = np.where(zero[:, None], F32(0), levels + nmax)
    return scale.astype(F32), codes


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """float rows [n, k] (k a multiple of 256) -> Q6_K blocks as uint8 [n, k // 256 * 210]."""
    n_rows = np.asarray(rows).shape[0]
    x = _blocks(rows)
    n_blocks = x.shape[0]
    scales, codes = _make_qx_quants_rmse1(x.reshape(n_blocks * 16, 16), 32)
    scales, codes = scales.reshape(n_blocks, 16), codes.reshape(n_blocks, 16, 16)
    index = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(n_blocks), index]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(empty, F32(1), max_scale)
    d16 = (F32(1) / iscale).astype(np.float16)
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)
    d = d16.astype(F32)[:, None] * sc.astype(F32)  # [B, 16]
    usable = d != 0
    requant = np.clip(np.rint(x.reshape(n_blocks, 16, 16) / np.where(usable, d, F32(1))[..., None]), -32, 31) + 32
    codes = np.where(usable[..., None], requant, codes).astype(np.uint8).reshape(n_blocks, 2, 4, 32)
    ql = np.concatenate([codes[:, :, 0] & 0xF | ((codes[:, :, 2] & 0xF) << 4),
                         codes[:, :, 1] & 0xF | ((codes[:, :, 3] & 0xF) << 4)], axis=2)  # [B, 2, 64]
    qh = (codes[:, :, 0] >> 4) | ((codes[:, :, 1] >> 4) << 2) | ((codes[:, :, 2] >> 4) << 4) | \
         ((codes[:, :, 3] >> 4) << 6)  # [B, 2, 32]
    out = np.concatenate([ql.reshape(n_blocks, 128), qh.reshape(n_blocks, 64), sc.view(np.uint8),
                          d16.view(np.uint8).reshape(n_blocks, 2)], axis=1)
    out[empty] = 0
    return out.reshape(n_rows, -1)

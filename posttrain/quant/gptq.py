"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers")
for one linear layer, on CPU, in plain PyTorch.

Written here rather than taken from gptqmodel / llm-compressor: those packages build CUDA extensions or pull a
large dependency tree, and the algorithm itself is ~100 lines once the format helpers exist.

The layer y = x W^T with W [out, in] is quantized column by column. With H = 2/n * sum x x^T [in, in] (the
Hessian of the layer's squared output error), quantizing column j makes an error e_j that the not yet quantized
columns compensate: W[:, j+1:] -= e_j / Hinv[j, j] * Hinv[j, j+1:], after which column j is eliminated from
Hinv. The upper Cholesky factor U of Hinv holds exactly those eliminated rows (U[j, j:] = row j of the
eliminated Hinv / sqrt of its pivot), so one factorisation replaces the per-column eliminations. Updates to the
columns right of the current block are batched ("lazy batch updates") into one matmul per block.
"""

from __future__ import annotations

import torch

from posttrain.quant.formats import CODE_RANGE, QuantizedWeight, choose_scale_zero, resolve_group_size

GPTQ_FORMATS = ("int4", "int8")


class HessianAccumulator:
    """Accumulates H = 2/n * sum_t x_t x_t^T over calibration inputs x [..., in] of one linear layer.

    The running sum is kept in float64: summing many fp32 outer products of activations with outlier channels
    loses the small entries otherwise. Memory is in^2 * 8 bytes (128 MiB for in = 4096).
    """

    def __init__(self, in_features: int):
        self.in_features = in_features
        self.sum_outer = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Add a batch of inputs x [..., in] (every leading dim is a token)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input last dim {x.shape[-1]} (shape {tuple(x.shape)}) != in_features {self.in_features}")
        tokens = x.detach().reshape(-1, self.in_features).to(device="cpu", dtype=torch.float64)
        self.sum_outer += tokens.T @ tokens
        self.n_tokens += tokens.shape[0]

    def hessian(self) -> torch.Tensor:
        """H [in, in] float32; all zeros if nothing was added (every input then counts as dead)."""
        if self.n_tokens == 0:
            return torch.zeros(self.in_features, self.in_features)
        return (2.0 * self.sum_outer / self.n_tokens).float()


def _effective_block_size(block_size: int, group: int) -> int:
    # A group's scale is chosen from the weights as updated so far when its first column comes up. Inside a
    # block that is only exact if the group lies wholly in the block (columns beyond the block still miss the
    # block's pending lazy updates) or starts on a block boundary (nothing pending yet). Either block divides
    # group or group divides block guarantees one of the two; otherwise fall back to block = group.
    if group % block_size == 0 or block_size % group == 0:
        return block_size
    return group


def _inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U [in, in] of (H + damp * mean(diag H) * I)^-1."""
    damped = hessian.clone()
    damped.diagonal().add_(damp * damped.diagonal().mean())
    chol, info = torch.linalg.cholesky_ex(damped)
    if info.item() != 0:
        raise ValueError(f"GPTQ: damped Hessian [{hessian.shape[0]}, {hessian.shape[0]}] is not positive definite "
                         f"(damp={damp}); raise damp or add calibration tokens")
    return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)


def _check_inputs(w: torch.Tensor, hessian: torch.Tensor, fmt: str, symmetric: bool) -> None:
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"gptq_quantize supports fmt in {GPTQ_FORMATS}, got {fmt!r}")
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(w.shape)}")
    in_features = w.shape[1]
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"hessian shape {tuple(hessian.shape)} != [in, in] = [{in_features}, {in_features}]")
    if fmt != "int4" and not symmetric:
        raise ValueError(f"{fmt} is symmetric only; symmetric=False is int4 only")


class _Columns:
    """GPTQ's column loop over one block, with the group scales (and zeros) it fills in as groups start.

    The loop runs in_features times per layer (~170k times over SmolLM2), so each step is the fewest tensor ops that
    give quantize_codes' and dequantize_codes' exact fp32 results: the codes stay floats (whole numbers in the code
    range) until the block is done, and the zero point is a float column."""

    def __init__(self, fmt: str, symmetric: bool, group: int, act_order: bool, groups: list[int],
                 scale: torch.Tensor, zero: torch.Tensor | None):
        self.fmt, self.symmetric, self.group, self.act_order, self.groups = fmt, symmetric, group, act_order, groups
        self.scale, self.zero = scale, zero
        self.low, self.high = CODE_RANGE[(fmt, symmetric)]

    def quantize_block(self, weight: torch.Tensor, upper: torch.Tensor, start: int, end: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scaled errors e_j / U[j, j] [out, b], int8 codes [out, b]) of columns start..end of `weight`."""
        scale, zero, group, groups = self.scale, self.zero, self.group, self.groups
        # The block is held transposed, [b, out], so that a column is a contiguous row and the rank-1 update of the
        # columns right of it is one contiguous slab: 2.5-3.5x faster than updating a column slice of [out, b].
        block_weight = weight[:, start:end].T.contiguous()  # [b, out], receives eager updates inside the block
        block_error = torch.zeros_like(block_weight)
        block_codes = torch.empty_like(block_weight)  # [b, out] float codes
        block_upper = upper[start:end, start:end]
        for i in range(end - start):
            column = start + i
            g = groups[column]
            starts_group = not self.act_order and column % group == 0
            if starts_group:
                # Group starts here: choose scale/zero from the current (updated) weights of the group. A group that
                # overruns the block starts at the block's first column (see _effective_block_size): nothing is pending.
                current = block_weight[i:i + group].T if i + group <= end - start else weight[:, column:column + group]
                group_scale, group_zero = choose_scale_zero(current, self.fmt, self.symmetric)
                scale[:, g] = group_scale
                if zero is not None:
                    zero[:, g] = group_zero
            if i == 0 or starts_group or groups[column - 1] != g:
                col_scale = scale[:, g].clone()  # [out]
                col_zero = None if zero is None else zero[:, g].float()
            w_col = block_weight[i]
            scaled = w_col / col_scale if col_zero is None else w_col / col_scale + col_zero
            col_codes = scaled.round_().clamp_(self.low, self.high)
            col_deq = (col_codes if col_zero is None else col_codes - col_zero) * col_scale
            error = (w_col - col_deq) / block_upper[i, i]  # [out]
            block_weight[i + 1:].addr_(block_upper[i, i + 1:], error, alpha=-1)  # in place: no [b, out] temporary
            block_error[i] = error
            block_codes[i] = col_codes
        return block_error.T, block_codes.T.to(torch.int8)


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    fmt: str = "int4",
    group_size: int | None = None,
    symmetric: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
) -> QuantizedWeight:
    """Quantize w [out, in] with GPTQ given H [in, in]; same QuantizedWeight as `formats.quantize_weight`.

    group_size None means the format default (int4: 128; int8: per output channel, one group = the whole row).
    Without act_order a group's scale/zero come from the *updated* weights when its first column is reached.
    With act_order columns are processed by decreasing diag(H), but groups stay contiguous in the original
    column order (so the result fits the canonical format, no g_idx); their scales are therefore fixed up front
    from the original weights ("static groups"). Dead inputs (diag(H) == 0, the input is always 0) get H_dd = 1:
    their column is decoupled, so it is rounded to nearest and its weights are kept (not zeroed), which keeps
    the layer sane on inputs the calibration never showed. Computation is float32.
    """
    _check_inputs(w, hessian, fmt, symmetric)
    out_features, in_features = w.shape
    group_size = resolve_group_size(fmt, group_size, in_features)
    group = group_size or in_features
    n_groups = in_features // group

    weight = w.detach().float().clone()
    hessian = hessian.detach().float().clone()
    dead = hessian.diagonal() == 0
    hessian[dead, dead] = 1.0

    scale = torch.ones(out_features, n_groups)
    zero = None if symmetric else torch.zeros(out_features, n_groups, dtype=torch.int8)
    if act_order:
        # Static groups from the original weights, in original column order: [out, n_groups].
        scale, zero = choose_scale_zero(weight.reshape(out_features, n_groups, group), fmt, symmetric)
        perm = torch.argsort(hessian.diagonal(), descending=True)
        weight, hessian = weight[:, perm], hessian[perm][:, perm]
    else:
        perm = torch.arange(in_features)
    group_of_column = perm // group  # [in]: the (original-order) group of each processed column

    upper = _inverse_hessian_factor(hessian, damp)
    codes = torch.zeros(out_features, in_features, dtype=torch.int8)  # processed (permuted) order
    block = _effective_block_size(block_size, group)
    columns = _Columns(fmt, symmetric, group, act_order, group_of_column.tolist(), scale, zero)
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        block_error, codes[:, start:end] = columns.quantize_block(weight, upper, start, end)
        # Lazy batch update of every column right of the block: one [out, b] @ [b, in - end] matmul.
        weight[:, end:] -= block_error @ upper[start:end, end:]

    codes_original_order = torch.empty_like(codes)
    codes_original_order[:, perm] = codes
    if group_size is None:  # int8 per channel: scale [out] as the contract says
        scale = scale[:, 0]
        zero = None if zero is None else zero[:, 0]
    return QuantizedWeight(fmt, codes_original_order, scale, zero, group_size, symmetric, (out_features, in_features))

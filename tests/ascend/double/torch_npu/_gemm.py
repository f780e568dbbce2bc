"""TEST DOUBLE of torch_npu's quantisation and (grouped) matmul operators, in plain torch on the CPU.

Contracts followed (op-plugin docs; the 950 quantisation modes from the aclnnQuantMatmulV5 and
aclnnGroupedMatmulV4 docs):
- ``npu_dynamic_block_quant``: returned scale = max(block amax / dtype max, min_scale), y = cast(x / scale).
- ``npu_dynamic_mx_quant``: OCP MX, 32 values per E8M0 exponent, scales laid out ``(rows, ceil(k / 64), 2)``.
- ``npu_quant_matmul``: FP8 ``G-B`` mode (group sizes [1, 128, 128], fp32 scales ``x1: (m, ceil(k/128))``,
  ``x2: (ceil(k/128), ceil(n/128))``, x2 and its scale transposed together) and MX mode ([1, 1, 32]).
- ``npu_grouped_matmul``: single x / single weight / single y, m-axis grouping with a group_list tensor.
FP8 modes are accepted only when the emulated chip is an Ascend 950.
"""

from __future__ import annotations

import torch

from ._common import FP8_MAX, ceil_div, contiguous, dtype_in, is_950, is_transposed_view, not_emulated, record, require

HALF = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn
ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 2, 29


class _NpuDtype:
    """A torch_npu dtype tag (such as ``float8_e8m0fnu``) passed next to raw uint8 storage."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"torch_npu.{self.name}"


float8_e8m0fnu = _NpuDtype("float8_e8m0fnu")
hifloat8 = _NpuDtype("hifloat8")


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    k = x.shape[-1]
    pad = (-k) % block
    xb = torch.nn.functional.pad(x.float().abs(), (0, pad)).reshape(*x.shape[:-1], (k + pad) // block, block)
    return xb.amax(dim=-1)


def _expand(scale: torch.Tensor, block: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(block, dim=-1)[..., :k]


def npu_dynamic_block_quant(
    x: torch.Tensor,
    *,
    min_scale: float = 0.0,
    round_mode: str = "rint",
    dst_type=1,
    row_block_size: int = 1,
    col_block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantisation (TEST DOUBLE): returns ``(y, scale)`` with ``scale [..., M, ceil(K / 128)]`` fp32, the
    multiplier that restores x. ``dst_type`` 1 is int8 (all chips); ``torch.float8_e4m3fn`` only on a 950."""
    op = "npu_dynamic_block_quant"
    dtype_in(x, HALF, op, "x")
    require(x.dim() in (2, 3), op, "x must be 2-D or 3-D")
    require(min_scale >= 0, op, "min_scale must be >= 0")
    require(round_mode == "rint", op, "round_mode supports only 'rint'")
    require(row_block_size == 1 and col_block_size == 128, op, "only row_block_size 1 and col_block_size 128")
    if dst_type in (1, torch.int8):
        qmax, out_dtype = 127.0, torch.int8
    else:
        require(dst_type == FP8 and is_950(), op, f"dst_type {dst_type} (FP8 output is an Ascend 950 feature)")
        qmax, out_dtype = FP8_MAX, FP8
    record(op, dst_type=out_dtype, shape=tuple(x.shape))
    scale = torch.clamp(_block_amax(x, 128) / qmax, min=min_scale)
    scaled = x.float() / _expand(scale, 128, x.shape[-1])
    if out_dtype == torch.int8:
        y = torch.round(scaled).clamp(-128, 127).to(torch.int8)
    else:
        y = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return y, scale


def npu_dynamic_mx_quant(
    x: torch.Tensor,
    *,
    axis: int = -1,
    round_mode: str = "rint",
    dst_type=FP8,
    block_size: int = 32,
    scale_alg: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantisation along the last axis (TEST DOUBLE, Ascend 950): shared exponent
    ``floor(log2(amax)) - 8`` per 32 values; returns ``(y e4m3, scale)`` with the E8M0 exponents stored as uint8 in
    the ``(..., ceil(k / 64), 2)`` layout (pairs of 32-blocks; an odd count is padded with 2^-127)."""
    op = "npu_dynamic_mx_quant"
    require(is_950(), op, "MX quantisation is an Ascend 950 feature")
    dtype_in(x, HALF, op, "x")
    require(axis in (-1, x.dim() - 1), op, "the double emulates axis=-1 only")
    require(dst_type == FP8 and block_size == 32 and scale_alg == 0, op, "emulated: e4m3, block 32, scale_alg 0")
    require(round_mode == "rint", op, "round_mode supports only 'rint'")
    record(op, shape=tuple(x.shape))
    k = x.shape[-1]
    amax = _block_amax(x, 32)
    exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 8
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    y = (x.float() / _expand(torch.exp2(exp), 32, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if exp.shape[-1] % 2:
        exp = torch.nn.functional.pad(exp, (0, 1), value=-127)
    biased = (exp + 127).to(torch.uint8)
    return y, biased.reshape(*exp.shape[:-1], exp.shape[-1] // 2, 2)


def _mx_scale_rows(scale: torch.Tensor, k: int) -> torch.Tensor:
    """(rows, ceil(k/64), 2) uint8 E8M0 -> fp32 (rows, k) multipliers."""
    exp = scale.reshape(scale.shape[0], -1).float() - 127
    return _expand(torch.exp2(exp), 32, k)


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset=None,
    pertoken_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None,
    x1_dtype=None,
    x2_dtype=None,
    pertoken_scale_dtype=None,
    scale_dtype=None,
    group_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Quantised matmul (TEST DOUBLE). Emulates the Ascend 950 FP8 modes only: ``G-B`` (group_sizes
    [1, 128, 128], fp32 scales) and ``mx`` ([1, 1, 32], E8M0 scales tagged ``torch_npu.float8_e8m0fnu``)."""
    op = "npu_quant_matmul"
    not_emulated(x1.dtype not in (FP8,), op, f"x1 dtype {x1.dtype} (int8/int4 modes)")
    require(is_950(), op, "FLOAT8_E4M3FN inputs are an Ascend 950 feature (A2/A3 docs list int8/int4)")
    require(x2.dtype == FP8, op, "x2 must have the dtype of x1")
    require(x1.dim() == 2 and x2.dim() == 2, op, "the double emulates 2-D x1 and x2")
    require(x1.numel() > 0 and x2.numel() > 0 and scale.numel() > 0, op, "x1, x2 and scale must not be empty")
    contiguous(x1, op, "x1")
    require(x2.is_contiguous() or is_transposed_view(x2), op, "x2 must be contiguous or a transposed view")
    require(offset is None, op, "offset is only for int8 output")
    require(x1_dtype is None and x2_dtype is None, op, "x1_dtype/x2_dtype are for hifloat8/fp4 inputs")
    m, k = x1.shape
    require(x2.shape[0] == k, op, f"x2 must be (k, n) with k = {k}, got {list(x2.shape)}")
    require(k <= 65535, op, "the last dim of x1 and x2 must be <= 65535")
    n = x2.shape[1]
    require(output_dtype in (torch.bfloat16, torch.float16, torch.float32), op, "FP8 output dtype bf16/fp16/fp32")
    require(pertoken_scale is not None, op, "the FP8 block and MX modes need pertoken_scale (x1 scale)")
    gs = list(group_sizes or [0, 0, 0])
    if gs == [1, 128, 128]:
        require(scale_dtype is None and pertoken_scale_dtype is None, op, "G-B scales are plain fp32 tensors")
        require(scale.dtype == torch.float32 and pertoken_scale.dtype == torch.float32, op, "G-B scales are fp32")
        require(tuple(pertoken_scale.shape) == (m, ceil_div(k, 128)), op, "G-B x1 scale must be (m, ceil(k/128))")
        require(
            tuple(scale.shape) == (ceil_div(k, 128), ceil_div(n, 128)),
            op,
            "G-B x2 scale must be (ceil(k/128), ceil(n/128))",
        )
        require(is_transposed_view(x2) == is_transposed_view(scale), op, "x2 and its scale must be transposed alike")
        require(bias is None, op, "in G-B mode bias is supported only for int8 inputs")
        record(op, mode="G-B", x2_transposed=is_transposed_view(x2), shape=(m, n, k))
        a = x1.float() * _expand(pertoken_scale, 128, k)
        w = x2.float() * scale.repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
        return (a @ w).to(output_dtype)
    if gs == [1, 1, 32]:
        require(
            scale_dtype is float8_e8m0fnu and pertoken_scale_dtype is float8_e8m0fnu,
            op,
            "MX scales must be tagged torch_npu.float8_e8m0fnu",
        )
        require(scale.dtype == torch.uint8 and pertoken_scale.dtype == torch.uint8, op, "MX scales are E8M0 bytes")
        require(tuple(pertoken_scale.shape) == (m, ceil_div(k, 64), 2), op, "MX x1 scale must be (m, ceil(k/64), 2)")
        transposed = is_transposed_view(x2)
        want = (ceil_div(k, 64), n, 2)
        require(tuple(scale.shape) == want, op, f"MX x2 scale must be {want}")
        require(transposed == (not scale.is_contiguous()), op, "x2 and its scale must be transposed alike")
        if bias is not None:
            require(bias.dtype == torch.float32 and tuple(bias.shape) in ((n,), (1, n)), op, "MX bias: fp32 (n,)")
        record(op, mode="mx", x2_transposed=transposed, shape=(m, n, k))
        a = x1.float() * _mx_scale_rows(pertoken_scale, k)
        w_rows = scale.transpose(0, 1)  # (n, ceil(k/64), 2)
        w = x2.float() * _mx_scale_rows(w_rows, k).T
        out = a @ w
        return (out if bias is None else out + bias.float().reshape(1, n)).to(output_dtype)
    not_emulated(True, op, f"group_sizes {gs}")
    raise AssertionError("unreachable")


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias=None,
    scale: list[torch.Tensor] | None = None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale: list[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    output_dtype: torch.dtype | None = None,
    tuning_config=None,
) -> list[torch.Tensor]:
    """Grouped matmul (TEST DOUBLE), emulating the single-x / single-weight / single-y m-grouped case:
    ``x [M, K]``, ``weight [E, K, N]`` (contiguous or a transposed view of ``[E, N, K]``), ``group_list [E]`` int64
    (type 0 cumsum, 1 counts; the docs refuse a count list of length 1). bf16/fp16/fp32 without quantisation; FP8
    ``G-B`` on a 950 with ``per_token_scale [M, ceil(K/128)]`` and ``scale [E, ceil(K/128), ceil(N/128)]``
    transposed like the weight."""
    op = "npu_grouped_matmul"
    unused = {
        "bias": bias,
        "offset": offset,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
        "activation_input": activation_input,
        "activation_quant_scale": activation_quant_scale,
        "activation_quant_offset": activation_quant_offset,
        "tuning_config": tuning_config,
    }
    for name, val in unused.items():
        not_emulated(val is not None, op, f"argument {name}")
    not_emulated(act_type != 0, op, "fused activations")
    require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), op, "x and weight are tensor lists")
    not_emulated(len(x) != 1 or len(weight) != 1, op, "multi-tensor x or weight")
    require(split_item in (2, 3), op, "a single output tensor needs split_item 2 or 3")
    require(group_type == 0, op, "the single-single-single case groups along m (group_type 0)")
    require(isinstance(group_list, torch.Tensor), op, "group_type 0 with a single x needs a group_list tensor")
    require(group_list_type in (0, 1, 2), op, "group_list_type must be 0, 1 or 2")
    require(not (is_950() and group_list_type == 2), op, "group_list_type 2 is not supported on Ascend 950")
    not_emulated(group_list_type == 2, op, "group_list_type 2")
    require(group_list.dtype == torch.int64 and group_list.dim() == 1, op, "group_list must be a 1-D int64 tensor")
    a, w = x[0], weight[0]
    require(a.dim() == 2 and w.dim() == 3, op, "single-single-single needs 2-D x and 3-D weight")
    contiguous(a, op, "x")
    require(w.is_contiguous() or is_transposed_view(w), op, "weight must be contiguous or transposed")
    experts, k, n = w.shape
    require(a.shape[1] == k, op, f"x must be (M, {k})")
    require(group_list.shape[0] == experts and experts <= 1024, op, "group_list needs one entry per group, <= 1024")
    require(group_list_type != 1 or experts != 1, op, "group_list_type 1 (counts) takes no group_list of length 1")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    require(bool((counts >= 0).all()), op, "group sizes must be non-negative (cumsum nondecreasing)")
    require(int(counts.sum()) == a.shape[0], op, "the group sizes must add up to the first dim of x")
    require(k < 65536 and (n < 65536 or is_transposed_view(w)), op, "inner dims must be below 65536")
    if a.dtype == FP8:
        require(is_950(), op, "FLOAT8_E4M3FN grouped matmul is an Ascend 950 feature")
        require(w.dtype == FP8, op, "x and weight must both be FP8")
        require(per_token_scale is not None and scale is not None, op, "G-B needs scale and per_token_scale")
        ps, ws = per_token_scale[0], scale[0]
        require(
            ps.dtype == torch.float32 and tuple(ps.shape) == (a.shape[0], ceil_div(k, 128)),
            op,
            "per_token_scale must be fp32 (M, ceil(K/128))",
        )
        require(
            ws.dtype == torch.float32 and tuple(ws.shape) == (experts, ceil_div(k, 128), ceil_div(n, 128)),
            op,
            "scale must be fp32 (E, ceil(K/128), ceil(N/128))",
        )
        require(is_transposed_view(w) == is_transposed_view(ws), op, "weight and scale must be transposed alike")
        require(output_dtype in (torch.bfloat16, torch.float16, torch.float32), op, "output bf16/fp16/fp32")
        af = a.float() * _expand(ps, 128, k)
        wf = w.float() * ws.repeat_interleave(128, 1)[:, :k].repeat_interleave(128, 2)[:, :, :n]
        out_dtype = output_dtype
    else:
        require(scale is None and per_token_scale is None, op, "scales are for quantised inputs")
        dtype_in(a, (torch.float16, torch.bfloat16, torch.float32), op, "x")
        require(w.dtype == a.dtype, op, "weight must have the dtype of x")
        require(output_dtype in (None, a.dtype), op, "non-quantised output_dtype must be None or the dtype of x")
        af, wf, out_dtype = a.float(), w.float(), a.dtype
    record(op, dtype=a.dtype, group_list_type=group_list_type, weight_transposed=is_transposed_view(w), E=experts)
    out = torch.empty(a.shape[0], n, dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts.tolist()):
        out[start : start + c] = af[start : start + c] @ wf[e]
        start += c
    return [out.to(out_dtype)]


def npu_format_cast(input: torch.Tensor, acl_format: int) -> torch.Tensor:
    """Returns ``input`` in another physical format (TEST DOUBLE: same values, the format is only recorded)."""
    require(acl_format in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ), "npu_format_cast", "the double knows ND (2), NZ (29)")
    out = input.clone()
    out._torch_npu_double_format = acl_format
    record("npu_format_cast", acl_format=acl_format, shape=tuple(input.shape))
    return out


def get_npu_format(input: torch.Tensor) -> int:
    return getattr(input, "_torch_npu_double_format", ACL_FORMAT_ND)

"""GGUF's block-quantized weight formats, as torch sees them: which exist, their block sizes,
and the torch reference that dequantizes them (the quantized kernels' tests check against it,
a quantized embedding reads its rows through it, and a build without the native kernels runs
on it).

A weight [N, K] is kept as a GGUF file stores it: uint8 [N, K / values * bytes], N rows of
whole blocks (ggml-common.h's `block_*` structs, little-endian, fp16 scales):

- Q8_0 (32 values, 34 bytes): d, 32 int8 q; w = q * d.
- Q4_0 (32, 18): d, 16 bytes whose low nibbles are elements 0-15 and high nibbles 16-31;
  w = (q - 8) * d.
- Q4_1 (32, 20): d, m, the nibbles as Q4_0; w = q * d + m.
- Q5_0 (32, 22): d, qh (uint32: bit j is element j's fifth bit), the low nibbles as Q4_0;
  w = (q - 16) * d.
- Q5_1 (32, 24): d, m, qh, nibbles; w = q * d + m.
- Q4_K (256, 144): d, dmin, 12 bytes of eight 6-bit scales and mins (`_k4_scales`), 128
  bytes: 64-value chunk c's elements 0-31 are the low nibbles of bytes 32c..32c+31, 32-63 the
  high ones; sub-block j (32 values) has w = d * sc[j] * q - dmin * m[j].
- Q5_K (256, 176): d, dmin, 12 bytes of scales, qh[32] (chunk c's fifth bits: bit 2c of
  qh[l] for element l, bit 2c + 1 for element l + 32), 128 bytes of nibbles as Q4_K.
- Q6_K (256, 210): ql[128], qh[64], 16 int8 scales (one per 16 values), d;
  w = d * sc[i / 16] * (q - 32), q six bits (see `_dequantize_q6_k`).

Layouts made at load, never found in a file: the 8-row interleaved formats (`R8_SOURCES`) and
Q5_0_BYTES (32, 34): Q5_0's block with its values one byte each, Q8_0's block (d, 32 int8 q -
16, in -16 .. 15); `q5_0_to_bytes` makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantFormat:
    name: str  # the qtype string used everywhere ("q4_k")
    code: int  # its number in the native kernels (`ae_linear_quant`'s fmt)
    values: int  # values per block
    nbytes: int  # bytes per block
    row_group: int = 1  # rows come in groups of this many (Q4_K_R8: 8)


Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 = "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"
Q4_K, Q5_K, Q6_K = "q4_k", "q5_k", "q6_k"
# Q4_K, Q8_0, Q5_0, Q4_0 and Q6_K with every 8 rows interleaved: made at load for the AVX512-VNNI
# one-row products (kernels/csrc/quant_r8.c has the layouts), never found in a file.
Q4_K_R8, Q8_0_R8, Q5_0_R8, Q4_0_R8 = "q4_k_r8", "q8_0_r8", "q5_0_r8", "q4_0_r8"
Q6_K_R8 = "q6_k_r8"
# Q5_0's values one byte each: made at load for AVX2 machines (see `q5_0_to_bytes`)
Q5_0_BYTES = "q5_0_bytes"
FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat(Q8_0, 0, 32, 34),
        QuantFormat(Q4_0, 1, 32, 18),
        QuantFormat(Q4_1, 2, 32, 20),
        QuantFormat(Q5_0, 3, 32, 22),
        QuantFormat(Q5_1, 4, 32, 24),
        QuantFormat(Q4_K, 5, 256, 144),
        QuantFormat(Q5_K, 6, 256, 176),
        QuantFormat(Q6_K, 7, 256, 210),
        QuantFormat(Q4_K_R8, 8, 256, 144, 8),  # per row; 8 rows make a group block of 1152
        QuantFormat(Q8_0_R8, 9, 32, 34, 8),  # 8 rows make a group block of 272
        QuantFormat(Q5_0_R8, 10, 32, 22, 8),  # of 176
        QuantFormat(Q4_0_R8, 11, 32, 18, 8),  # of 144
        QuantFormat(Q6_K_R8, 12, 256, 210, 8),  # of 1680
        QuantFormat(Q5_0_BYTES, 13, 32, 34),
    )
}
# each interleaved format: the file's format it is made from
R8_SOURCES = {Q4_K_R8: Q4_K, Q8_0_R8: Q8_0, Q5_0_R8: Q5_0, Q4_0_R8: Q4_0, Q6_K_R8: Q6_K}
LEGACY = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)  # blocks of 32 (kernels/csrc/quant_legacy.c)
K_QUANTS = (Q4_K, Q5_K, Q6_K)  # super-blocks of 256 (kernels/csrc/quant_kquants.c)


def quant_format(qtype: str) -> QuantFormat:
    """The format named `qtype`; ValueError naming the supported ones otherwise."""
    try:
        return FORMATS[qtype]
    except KeyError:
        names = ", ".join(FORMATS)
        raise ValueError(f"unsupported quantization type {qtype!r} (supported: {names})") from None


def in_features(qweight: torch.Tensor, qtype: str) -> int:
    """K of a `qtype` weight uint8 [N, K / values * bytes]; ValueError if it is not one."""
    fmt = quant_format(qtype)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] % fmt.nbytes:
        raise ValueError(
            f"a {qtype} weight is uint8 [N, a multiple of {fmt.nbytes} bytes], got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )
    return qweight.shape[1] // fmt.nbytes * fmt.values


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes [..., 2] (little-endian fp16) as fp32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes [..., 16] as their 32 nibbles [..., 32]: the low ones first (ggml's order)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """qh [..., 4] (a little-endian uint32) as its 32 bits [..., 32], bit 0 first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh.unsqueeze(-1) >> shifts) & 1  # [..., 4, 8]
    return bits.flatten(-2)


def _q5_values(b: torch.Tensor, off: int) -> torch.Tensor:
    """Q5_0 (off 0) or Q5_1 (off 2: its m) blocks [..., bytes] as their 32 q, 0..31 [..., 32]."""
    return _nibbles(b[..., 6 + off :]) | (_bits(b[..., 2 + off : 6 + off]) << 4)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K / Q5_K block [..., 12] as eight 6-bit scales and eight
    6-bit mins [..., 8] each (ggml's get_scale_min_k4)."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:  # [..., 210] -> [..., 256]
    ql, qh = b[..., :128].to(torch.int32), b[..., 128:192].to(torch.int32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210])
    halves = []
    for h in range(2):  # 128 values each: ql[64h : 64h + 64], qh[32h : 32h + 32]
        lo, hi = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        q = torch.cat(
            [
                (lo[..., :32] & 15) | ((hi & 3) << 4),
                (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4),
                (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4),
                (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4),
            ],
            dim=-1,
        )  # [..., 128]
        halves.append(q - 32)
    q = torch.cat(halves, -1).float()  # [..., 256]
    return q * sc.repeat_interleave(16, dim=-1) * d


def dequantize(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """`qtype` blocks, uint8 [N, K / values * bytes], as the fp32 weight [N, K]."""
    if qtype in R8_SOURCES:
        return dequantize(r8_to_file(qweight, qtype), R8_SOURCES[qtype])
    fmt = quant_format(qtype)
    k = in_features(qweight, qtype)
    n = qweight.shape[0]
    b = qweight.reshape(n, -1, fmt.nbytes)  # [N, blocks, bytes]
    if qtype in (Q8_0, Q5_0_BYTES):
        w = b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., :2])
    elif qtype == Q4_0:
        w = (_nibbles(b[..., 2:]).float() - 8) * _f16(b[..., :2])
    elif qtype == Q4_1:
        w = _nibbles(b[..., 4:]).float() * _f16(b[..., :2]) + _f16(b[..., 2:4])
    elif qtype in (Q5_0, Q5_1):
        off = 0 if qtype == Q5_0 else 2  # Q5_1 has m after d
        q = _q5_values(b, off).float()
        d = _f16(b[..., :2])
        w = (q - 16) * d if qtype == Q5_0 else q * d + _f16(b[..., 2:4])
    elif qtype in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
        sc, m = _k4_scales(b[..., 4:16])  # [N, blocks, 8]
        qs = b[..., -128:].reshape(n, -1, 4, 32)  # 4 chunks of 64 values
        q = torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.int32)  # [N, blocks, 4, 64]
        if qtype == Q5_K:
            qh = b[..., 16:48].to(torch.int32).unsqueeze(-2)  # [N, blocks, 1, 32]
            shift = 2 * torch.arange(4, dtype=torch.int32).view(4, 1)
            q = q + 16 * torch.cat([(qh >> shift) & 1, (qh >> (shift + 1)) & 1], dim=-1)
        q = q.reshape(n, -1, 8, 32).float()
        w = d.unsqueeze(-1) * sc.float().unsqueeze(-1) * q - (
            dmin.unsqueeze(-1) * m.float().unsqueeze(-1)
        )
    else:
        w = _dequantize_q6_k(b)
    return w.reshape(n, k)


def r8_to_q4_k(qweight: torch.Tensor) -> torch.Tensor:
    """Q4_K_R8 weights, uint8 [N, K / 256 * 144], back as the Q4_K rows they were made from
    (the same shape; csrc/quant_r8.c's layout read in torch: the reference of
    `ae_unpack_q4_k_r8`)."""
    n = qweight.shape[0]
    if n % 8:
        raise ValueError(f"{Q4_K_R8} weights have a multiple of 8 rows, not {n}")
    g = qweight.reshape(n // 8, -1, 1152).to(torch.int32)  # [groups, super-blocks, 1152]
    d = g[..., 0:32].reshape(*g.shape[:2], 2, 8, 2)  # d, dmin; row r's 2 bytes
    a = g[..., 32:96].reshape(*g.shape[:2], 8, 8)  # [j][r]
    b = g[..., 96:128]
    m_lo = torch.cat([b & 15, b >> 4], dim=-1).reshape(*g.shape[:2], 8, 8)
    sc = (a & 63).transpose(-1, -2)  # [groups, super-blocks, r, j]
    m = (((a >> 6) << 4) | m_lo).transpose(-1, -2)
    scales = torch.cat(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ],
        dim=-1,
    )  # [groups, super-blocks, r, 12]
    chunks = g[..., 128:].reshape(*g.shape[:2], 16, 8, 2, 4)  # [c][r][h][e]
    q = torch.stack([chunks & 15, chunks >> 4], dim=3)  # [c][lo/hi][r][h][e]
    q = q.permute(0, 1, 4, 2, 3, 5, 6).reshape(*g.shape[:2], 8, 4, 2, 32)  # [r][c64][half][l]
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*g.shape[:2], 8, 128)
    dd = d.permute(0, 1, 3, 2, 4).reshape(*g.shape[:2], 8, 4)
    blocks = torch.cat([dd, scales, qs], dim=-1)  # [groups, super-blocks, r, 144]
    return blocks.transpose(1, 2).reshape(n, -1).to(torch.uint8)


def r8_to_q8_0(qweight: torch.Tensor) -> torch.Tensor:
    """Q8_0_R8 weights, uint8 [N, K / 32 * 34], back as the Q8_0 rows they were made from (the
    same shape; the reference of `ae_unpack_q8_0_r8`)."""
    n = qweight.shape[0]
    if n % 8:
        raise ValueError(f"{Q8_0_R8} weights have a multiple of 8 rows, not {n}")
    g = qweight.reshape(n // 8, -1, 272)  # [groups, blocks, 272]
    d = g[..., :16].reshape(*g.shape[:2], 8, 2)  # row r's fp16 d
    chunks = g[..., 16:].reshape(*g.shape[:2], 4, 8, 2, 4) ^ 0x80  # [s][r][h][e]: q as bytes
    q = chunks.permute(0, 1, 3, 2, 4, 5).reshape(*g.shape[:2], 8, 32)  # [r][8s + 4h + e]
    blocks = torch.cat([d, q], dim=-1)  # [groups, blocks, r, 34]
    return blocks.transpose(1, 2).reshape(n, -1).contiguous()


def r8_to_q5_0(qweight: torch.Tensor, qtype: str = Q5_0_R8) -> torch.Tensor:
    """Q5_0_R8 (or with `qtype` Q4_0_R8) weights, uint8 [N, K / 32 * 22 (18)], back as the
    Q5_0 (Q4_0) rows they were made from (the same shape; the reference of `ae_unpack_r8`)."""
    n = qweight.shape[0]
    if n % 8:
        raise ValueError(f"{qtype} weights have a multiple of 8 rows, not {n}")
    hb = qtype == Q5_0_R8
    g = qweight.reshape(n // 8, -1, 176 if hb else 144)  # [groups, blocks, bytes]
    d = g[..., :16].reshape(*g.shape[:2], 8, 2)  # row r's fp16 d
    chunks = g[..., 16:144].reshape(*g.shape[:2], 2, 8, 2, 4)  # [c][r][h][e]
    q = torch.stack([chunks & 15, chunks >> 4], dim=3)  # [c][lo/hi][r][h][e]: step 2c + lo/hi
    q = q.permute(0, 1, 4, 2, 3, 5, 6).reshape(*g.shape[:2], 8, 32)  # [r][8s + 4h + e]
    parts = [d]
    if hb:  # step s's fifth bits: bit 8 * (byte) + i of its mask is lane byte 8 * byte + i
        bits = _bits(g[..., 144:176]).reshape(*g.shape[:2], 4, 8, 2, 4)  # [s][r][h][e]
        bits = bits.permute(0, 1, 3, 2, 4, 5).reshape(*g.shape[:2], 8, 4, 8)  # [r][byte][bit]
        qh = (bits.to(torch.int32) << torch.arange(8, dtype=torch.int32)).sum(-1)
        parts.append(qh.to(torch.uint8))  # [groups, blocks, r, 4]: a little-endian uint32
    parts.append(q[..., :16] | (q[..., 16:] << 4))
    blocks = torch.cat(parts, dim=-1)  # [groups, blocks, r, 22 or 18]
    return blocks.transpose(1, 2).reshape(n, -1).contiguous()


def r8_to_q6_k(qweight: torch.Tensor) -> torch.Tensor:
    """Q6_K_R8 weights, uint8 [N, K / 256 * 210], back as the Q6_K rows they were made from (the
    same shape; the reference of `ae_unpack_r8`)."""
    n = qweight.shape[0]
    if n % 8:
        raise ValueError(f"{Q6_K_R8} weights have a multiple of 8 rows, not {n}")
    g = qweight.reshape(n // 8, -1, 1680)  # [groups, super-blocks, 1680]
    lead = g.shape[:2]
    d = g[..., :16].reshape(*lead, 8, 2)  # row r's fp16 d
    sc = g[..., 16:144].reshape(*lead, 16, 8).transpose(-1, -2)  # [r][j] int8 scales
    parts = g[..., 144:].reshape(*lead, 8, 3, 64)  # low chunks 2p, 2p + 1, high chunk p
    lo = parts[..., :2, :].reshape(*lead, 16, 8, 2, 4)  # [c][r][h][e]: steps 2c, 2c + 1
    lo = torch.stack([lo & 15, lo >> 4], dim=3).reshape(*lead, 32, 8, 2, 4)  # [t][r][h][e]
    hi = parts[..., 2, :].reshape(*lead, 8, 8, 2, 4)  # [c][r][h][e]: steps 4c .. 4c + 3
    hi = torch.stack([(hi >> (2 * i)) & 3 for i in range(4)], dim=3).reshape(*lead, 32, 8, 2, 4)
    u = (lo | (hi << 4)).permute(0, 1, 3, 2, 4, 5).reshape(*lead, 8, 2, 4, 32)  # [r][half][q]
    q0, q1, q2, q3 = u.unbind(-2)  # values l, l + 32, l + 64, l + 96 of a half
    ql = torch.cat([(q0 & 15) | ((q2 & 15) << 4), (q1 & 15) | ((q3 & 15) << 4)], dim=-1)
    qh = (q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6)
    blocks = torch.cat(
        [ql.reshape(*lead, 8, 128), qh.reshape(*lead, 8, 64), sc, d], dim=-1
    )  # [groups, super-blocks, r, 210]
    return blocks.transpose(1, 2).reshape(n, -1).contiguous()


def r8_to_file(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """Weights of an interleaved format `qtype` back as the file's rows they were made from."""
    if qtype == Q4_K_R8:
        return r8_to_q4_k(qweight)
    if qtype == Q8_0_R8:
        return r8_to_q8_0(qweight)
    if qtype == Q6_K_R8:
        return r8_to_q6_k(qweight)
    return r8_to_q5_0(qweight, qtype)


def q5_0_to_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """Q5_0 weights, uint8 [N, K / 32 * 22], as Q5_0_BYTES (uint8 [N, K / 32 * 34]): each
    block's d, then its 32 values q - 16 as int8. The same weights, 34 bytes a block where
    Q5_0 takes 22: on AVX2, where unpacking the fifth bits bounds Q5_0's one-row products,
    those read Q8_0's tiles instead (AMD Zen 1: 1.5x the blocks a second)."""
    k = in_features(qweight, Q5_0)
    n = qweight.shape[0]
    b = qweight.reshape(n, -1, 22)
    q = _q5_values(b, 0).to(torch.int16) - 16  # [N, nb, 32]
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    out[..., :2] = b[..., :2]
    out[..., 2:] = q.to(torch.int8).view(torch.uint8)
    return out.reshape(n, -1)


def random_blocks(qtype: str, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Random valid `qtype` blocks for an [n, k] weight (k a multiple of the block's values):
    random quants, scales in fp16 of moderate size (no inf or NaN), for kernel tests of the
    formats no quantizer here writes."""
    fmt = quant_format(qtype)
    if k % fmt.values:
        raise ValueError(f"K={k} is not a multiple of {fmt.values} ({qtype})")
    if qtype in R8_SOURCES:  # any bytes are valid, but for each row's fp16 scales
        if n % fmt.row_group:
            raise ValueError(f"N={n} is not a multiple of {fmt.row_group} ({qtype})")
        group_bytes, scales = (1152, 16) if qtype == Q4_K_R8 else (8 * fmt.nbytes, 8)
        shape = (n // 8 * k // fmt.values, group_bytes)
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        lo, hi = (1e-3, 2e-2) if qtype in (Q4_K_R8, Q6_K_R8) else (-0.05, 0.05)
        values = torch.rand(raw.shape[0], scales, generator=generator) * (hi - lo) + lo
        raw[:, : 2 * scales] = values.half().view(torch.uint8)
        return raw.reshape(n, -1)
    blocks = n * k // fmt.values
    raw = torch.randint(0, 256, (blocks, fmt.nbytes), dtype=torch.uint8, generator=generator)

    def f16(lo: float, hi: float) -> torch.Tensor:
        v = torch.rand(blocks, 1, generator=generator) * (hi - lo) + lo
        return v.half().view(torch.uint8)  # [blocks, 2]

    if qtype in (Q4_K, Q5_K):
        raw[:, 0:2], raw[:, 2:4] = f16(1e-3, 2e-2), f16(1e-3, 2e-2)
    elif qtype == Q6_K:
        raw[:, 208:210] = f16(1e-3, 2e-2)
    else:
        raw[:, 0:2] = f16(-0.05, 0.05)
        if qtype == Q5_0_BYTES:  # values in -16 .. 15
            raw[:, 2:] = ((raw[:, 2:].to(torch.int16) & 31) - 16).to(torch.int8).view(torch.uint8)
        if qtype in (Q4_1, Q5_1):
            raw[:, 2:4] = f16(-0.5, 0.5)
    return raw.reshape(n, -1)

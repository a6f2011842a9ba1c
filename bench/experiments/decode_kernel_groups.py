"""A variant of the fused decode attention: lane groups take one key each.

In ``trio_mlx._decode_attention`` a whole warp takes one key at a time: its 32
lanes hold ``dim / 32`` elements each, and each key's score is a 5-round
shuffle sum per query head. Here a key takes only ``dim / 8`` lanes (eight
elements each), so a warp scores ``256 / dim`` keys at once with a shorter sum;
the lane groups' partial softmaxes are merged by shuffles at the end.
``python bench/experiments/decode_kernel_groups.py`` checks it against MLX's
masked attention and times both kernels (16 calls per evaluation).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import mlx.core as mx

SOURCE = """
    constexpr int LPK = D / 8;   // lanes per key
    constexpr int KPW = 32 / LPK;  // keys per warp per round
    const int kv_head = blockIdx.x;
    const int row = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int slot = lane / LPK;
    const int part = lane % LPK;
    const int heads = gridDim.x * G;
    const int length = k_shape[2];
    const int first = start[row * start_strides[0]];
    const float softmax_scale = scale[0];
    float qv[G][8];
    float acc[G][8];
    float best[G];
    float total[G];
    for (int g = 0; g < G; ++g) {
        const int64_t at = row * q_strides[0] + (kv_head * G + g) * q_strides[1]
            + (int64_t)(part * 8) * q_strides[3];
        for (int e = 0; e < 8; ++e) {
            qv[g][e] = static_cast<float>(q[at + e * q_strides[3]]) * softmax_scale;
            acc[g][e] = 0.0f;
        }
        best[g] = __int_as_float(0xff800000);
        total[g] = 0.0f;
    }
    const int64_t kb = row * k_strides[0] + kv_head * k_strides[1] + (int64_t)(part * 8) * k_strides[3];
    const int64_t vb = row * v_strides[0] + kv_head * v_strides[1] + (int64_t)(part * 8) * v_strides[3];
    for (int base = first + warp * KPW; base < length; base += W * KPW) {
        const int j = base + slot;
        const bool live = j < length;
        float kk[8];
        float vv[8];
        for (int e = 0; e < 8; ++e) {
            kk[e] = live ? static_cast<float>(k[kb + j * k_strides[2] + e * k_strides[3]]) : 0.0f;
            vv[e] = live ? static_cast<float>(v[vb + j * v_strides[2] + e * v_strides[3]]) : 0.0f;
        }
        float score[G];
        for (int g = 0; g < G; ++g) {
            score[g] = 0.0f;
            for (int e = 0; e < 8; ++e) {
                score[g] += qv[g][e] * kk[e];
            }
        }
        for (int step = LPK / 2; step > 0; step >>= 1) {
            for (int g = 0; g < G; ++g) {
                score[g] += __shfl_xor_sync(0xffffffff, score[g], step);
            }
        }
        if (live) {
            for (int g = 0; g < G; ++g) {
                const float top = fmaxf(best[g], score[g]);
                const float shrink = __expf(best[g] - top);
                const float weight = __expf(score[g] - top);
                total[g] = total[g] * shrink + weight;
                for (int e = 0; e < 8; ++e) {
                    acc[g][e] = acc[g][e] * shrink + weight * vv[e];
                }
                best[g] = top;
            }
        }
    }
    // Merge the warp's key slots: lanes with the same part hold the same dims.
    for (int step = LPK; step < 32; step <<= 1) {
        for (int g = 0; g < G; ++g) {
            const float other_best = __shfl_xor_sync(0xffffffff, best[g], step);
            const float other_total = __shfl_xor_sync(0xffffffff, total[g], step);
            const float top = fmaxf(best[g], other_best);
            const float mine = total[g] > 0.0f ? __expf(best[g] - top) : 0.0f;
            const float theirs = other_total > 0.0f ? __expf(other_best - top) : 0.0f;
            for (int e = 0; e < 8; ++e) {
                const float other_acc = __shfl_xor_sync(0xffffffff, acc[g][e], step);
                acc[g][e] = acc[g][e] * mine + other_acc * theirs;
            }
            total[g] = total[g] * mine + other_total * theirs;
            best[g] = top;
        }
    }
    __shared__ float merged_best[W][G];
    __shared__ float merged_total[W][G];
    __shared__ float merged_acc[W][G][D];
    if (slot == 0) {
        for (int g = 0; g < G; ++g) {
            for (int e = 0; e < 8; ++e) {
                merged_acc[warp][g][part * 8 + e] = acc[g][e];
            }
            if (lane == 0) {
                merged_best[warp][g] = best[g];
                merged_total[warp][g] = total[g];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += 32 * W) {
        const int g = i / D;
        const int d = i % D;
        float top = __int_as_float(0xff800000);
        for (int w = 0; w < W; ++w) {
            top = fmaxf(top, merged_best[w][g]);
        }
        float sum = 0.0f;
        float value = 0.0f;
        for (int w = 0; w < W; ++w) {
            const float weight = merged_total[w][g] > 0.0f ? __expf(merged_best[w][g] - top) : 0.0f;
            sum += merged_total[w][g] * weight;
            value += merged_acc[w][g][d] * weight;
        }
        out[((int64_t)row * heads + kv_head * G + g) * D + d] =
            static_cast<T>(sum > 0.0f ? value / sum : 0.0f);
    }
"""

_KERNEL: Any = None


def grouped(
    q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float, warps: int
) -> Any:
    """The lane-group kernel; the same contract as ``decode_attention``."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.cuda_kernel(
            name="trio_mlx_decode_attention_groups",
            input_names=["q", "k", "v", "start", "scale"],
            output_names=["out"],
            source=SOURCE,
            ensure_row_contiguous=False,
        )
    rows, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    (out,) = _KERNEL(
        inputs=[q, k, v, start.astype(mx.int32), mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("D", dim), ("G", heads // kv_heads), ("W", warps)],
        grid=(32 * warps * kv_heads, rows, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(rows, heads, 1, dim)],
        output_dtypes=[q.dtype],
    )
    return out


def timed(fn: Any, rounds: int = 100, layers: int = 16) -> float:
    for _ in range(10):
        mx.eval([fn() for _ in range(layers)])
    begin = time.perf_counter()
    for _ in range(rounds):
        mx.eval([fn() for _ in range(layers)])
    return (time.perf_counter() - begin) / rounds / layers * 1e6


def main() -> None:
    from trio_mlx import _decode_attention

    print(mx.default_device(), mx.__version__)
    for rows, length, heads, kv_heads, dim, paddings in (
        (8, 384, 32, 8, 64, [i % 17 for i in range(8)]),
        (64, 384, 32, 8, 64, [i % 17 for i in range(64)]),
        (64, 1536, 32, 8, 64, [i % 17 for i in range(64)]),
        (64, 4096, 32, 8, 64, [0] + [4096 - 300 - i for i in range(63)]),
        (64, 1536, 32, 8, 128, [i % 17 for i in range(64)]),
        (5, 77, 16, 2, 128, [0, 3, 76, 40, 1]),
        (3, 50, 8, 8, 32, [0, 10, 49]),
        (7, 300, 32, 4, 256, [i * 13 for i in range(7)]),
    ):
        spare = 256 - length % 256 if length % 256 else 0
        q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
        k = mx.random.normal((rows, kv_heads, length + spare, dim)).astype(mx.bfloat16)
        v = mx.random.normal((rows, kv_heads, length + spare, dim)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        k, v = k[..., :length, :], v[..., :length, :]
        start = mx.array(paddings)
        mask = (mx.arange(length)[None] >= start[:, None])[:, None, None, :]
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
        want = want.astype(mx.float32)
        masked = partial(mx.fast.scaled_dot_product_attention, q, k, v, scale=dim**-0.5, mask=mask)
        cells = [f"masked {timed(masked):.0f}"]
        base = partial(_decode_attention.decode_attention, q, k, v, start, dim**-0.5)
        cells.append(f"warp-per-key {timed(base):.0f}")
        for warps in (4, 8, 16):
            if warps * (heads // kv_heads) * (dim + 2) * 4 > 48 * 1024:
                continue
            fn = partial(grouped, q, k, v, start, dim**-0.5, warps)
            error = mx.abs(fn().astype(mx.float32) - want).max().item()
            cells.append(f"groups W={warps} {timed(fn):.0f} (max diff {error:.1e})")
        print(
            f"B={rows} kL={length} H={heads}/{kv_heads} D={dim}: " + ", ".join(cells) + " us",
            flush=True,
        )


if __name__ == "__main__":
    main()

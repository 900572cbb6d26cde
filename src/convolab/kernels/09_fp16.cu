// Rung 9: fp16: half-precision operands, two output channels per half2 instruction.
//
// What it adds over the fp32 rungs: the input tile (with its halo) and the weights live in
// shared memory as 16-bit halves, and the weights are packed in pairs of output channels
// (half2 {w[m], w[m+1]}, prepared once on the host). One input value broadcast to a half2
// then feeds two output channels per instruction.
//
// Two arithmetic modes (the HALF_ACCUM define, a tuner parameter):
//   HALF_ACCUM=0: halves are only storage. Products and sums are fp32 (each half2 is widened
//                 before the FMA): accuracy is that of rounding x and w to fp16 (~4e-4 rel).
//   HALF_ACCUM=1: the K*K products of one input channel are accumulated with __hfma2 in
//                 half2 (two FMAs per instruction, the fp16 rate), and that short partial
//                 sum is added into an fp32 accumulator after every channel. A pure-half
//                 sum over all C*K*K terms would lose ~eps*sqrt(C*K*K) (over 1e-2 for
//                 C=64, K=7); flushing per channel bounds the half chain at K*K <= 49 terms.
// Both stay within the 1e-2 tolerance the registry promises for fp16 inputs.
//
// The float32 -> half conversion of x happens here, while the input tile is staged into
// shared memory: there is no separate conversion pass, so Op Time includes it and the
// global-memory traffic for x is still 4 bytes per element (the gain is arithmetic and
// shared-memory footprint, not DRAM bandwidth).
//
// Block: TILE x TILE output pixels of one image with TILE x TILE/PPT threads; a thread
// computes PPT pixels (rows TILE/PPT apart) for MPAIRS*2 output channels.
// Dynamic shared memory: the input tile ((TILE-1)*S+K)^2 halves + MPAIRS*K*K half2 weights.

#include <cuda_fp16.h>

#ifndef TILE
#define TILE 16
#endif
#ifndef MPAIRS
#define MPAIRS 2  // output-channel pairs per thread (2*MPAIRS channels)
#endif
#ifndef HALF_ACCUM
#define HALF_ACCUM 1
#endif
#ifndef PPT
#define PPT 2  // output rows per thread: each weight read from shared memory feeds PPT pixels
#endif
#if TILE % PPT != 0
#error "TILE must be a multiple of PPT"
#endif
#define ROWS (TILE / PPT)  // thread rows per block

// w2: (M2, C, K, K) half2, M2 = ceil(M / 2); channel pair j holds {w[2j], w[2j+1] or 0}.
extern "C" __global__ void __launch_bounds__(TILE * ROWS)
conv_fp16(const float* __restrict__ x, const __half2* __restrict__ w2,
          const float* __restrict__ bias, float* __restrict__ y,
          int B, int C, int H, int W, int M, int K, int S, int Ho, int Wo) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int in_tile = (TILE - 1) * S + K;
    const int kk = K * K;
    __half2* w_s = reinterpret_cast<__half2*>(smem_raw);            // MPAIRS * kk
    __half* x_s = reinterpret_cast<__half*>(w_s + MPAIRS * kk);      // in_tile * in_tile

    const int tiles_w = (Wo + TILE - 1) / TILE;
    const int tiles_h = (Ho + TILE - 1) / TILE;
    const int M2 = (M + 1) / 2;
    const int pair_groups = (M2 + MPAIRS - 1) / MPAIRS;
    int block = blockIdx.x;
    const int tw = block % tiles_w;
    block /= tiles_w;
    const int th = block % tiles_h;
    block /= tiles_h;
    const int pg = block % pair_groups;
    const int b = block / pair_groups;
    (void)B;

    const int tx = threadIdx.x % TILE;
    const int ty = threadIdx.x / TILE;  // 0 .. ROWS-1; rows ty + i*ROWS
    const int wo = tw * TILE + tx;
    const int h0 = th * TILE * S;
    const int w0 = tw * TILE * S;
    const int pair0 = pg * MPAIRS;

    float2 acc[PPT][MPAIRS];
#pragma unroll
    for (int i = 0; i < PPT; ++i)
#pragma unroll
        for (int j = 0; j < MPAIRS; ++j) acc[i][j] = make_float2(0.0f, 0.0f);

    for (int c = 0; c < C; ++c) {
        const float* xc = x + (size_t)(b * C + c) * H * W;
        for (int i = threadIdx.x; i < in_tile * in_tile; i += TILE * ROWS) {
            const int r = i / in_tile, s = i - (i / in_tile) * in_tile;
            const int h = h0 + r, ww = w0 + s;
            x_s[i] = __float2half_rn((h < H && ww < W) ? xc[(size_t)h * W + ww] : 0.0f);
        }
        for (int i = threadIdx.x; i < MPAIRS * kk; i += TILE * ROWS) {
            const int j = i / kk, pq = i - (i / kk) * kk;
            w_s[i] = (pair0 + j < M2) ? w2[((size_t)(pair0 + j) * C + c) * kk + pq]
                                      : __floats2half2_rn(0.0f, 0.0f);
        }
        __syncthreads();

        // Threads outside the output still run the loop (reading in-bounds shared memory)
        // so that no barrier is skipped; their results are simply not stored.
#if HALF_ACCUM
        __half2 part[PPT][MPAIRS];
#pragma unroll
        for (int i = 0; i < PPT; ++i)
#pragma unroll
            for (int j = 0; j < MPAIRS; ++j) part[i][j] = __floats2half2_rn(0.0f, 0.0f);
        for (int p = 0; p < K; ++p) {
            for (int q = 0; q < K; ++q) {
                __half2 wv[MPAIRS];
#pragma unroll
                for (int j = 0; j < MPAIRS; ++j) wv[j] = w_s[j * kk + p * K + q];
#pragma unroll
                for (int i = 0; i < PPT; ++i) {
                    const __half2 xv =
                        __half2half2(x_s[((ty + i * ROWS) * S + p) * in_tile + tx * S + q]);
#pragma unroll
                    for (int j = 0; j < MPAIRS; ++j) part[i][j] = __hfma2(xv, wv[j], part[i][j]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < PPT; ++i)
#pragma unroll
            for (int j = 0; j < MPAIRS; ++j) {
                const float2 f = __half22float2(part[i][j]);
                acc[i][j].x += f.x;
                acc[i][j].y += f.y;
            }
#else
        for (int p = 0; p < K; ++p) {
            for (int q = 0; q < K; ++q) {
                float2 wv[MPAIRS];
#pragma unroll
                for (int j = 0; j < MPAIRS; ++j) wv[j] = __half22float2(w_s[j * kk + p * K + q]);
#pragma unroll
                for (int i = 0; i < PPT; ++i) {
                    const float xv =
                        __half2float(x_s[((ty + i * ROWS) * S + p) * in_tile + tx * S + q]);
#pragma unroll
                    for (int j = 0; j < MPAIRS; ++j) {
                        acc[i][j].x += xv * wv[j].x;
                        acc[i][j].y += xv * wv[j].y;
                    }
                }
            }
        }
#endif
        __syncthreads();
    }

    const size_t n_pix = (size_t)Ho * Wo;
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
        const int ho = th * TILE + ty + i * ROWS;
        if (ho >= Ho || wo >= Wo) continue;
#pragma unroll
        for (int j = 0; j < MPAIRS; ++j) {
            const int m = 2 * (pair0 + j);
            const size_t o = (size_t)ho * Wo + wo;
            if (m < M) y[((size_t)b * M + m) * n_pix + o] = acc[i][j].x + bias[m];
            if (m + 1 < M) y[((size_t)b * M + m + 1) * n_pix + o] = acc[i][j].y + bias[m + 1];
        }
    }
}

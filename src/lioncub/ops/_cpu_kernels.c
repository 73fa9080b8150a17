/* Fused CPU passes of a Lion / LionCub step (lioncub.ops.native loads this file, compiled on first use).
 *
 * Every function works on contiguous arrays of one floating type, named by its suffix: _f32 (float),
 * _f64 (double) or _bf16 (bfloat16 stored as uint16, computed in float). The arithmetic repeats, operation
 * for operation, what the torch code of lioncub does on CPU, so that the results are bit for bit the same:
 *
 *   x.mul(b)             one rounding to the storage type:          ROUND(x * b)
 *   x.add_(y, alpha=a)   ATen's fused multiply-add (vectorised and scalar tail): ROUND(fma(y, a, x))
 *   bf16                 float32 "opmath", rounded to bfloat16 after each op (lioncub.ops.kernels' reference)
 *   sign                 (x > 0) - (x < 0): +0 for zeros and NaN, as torch.sign
 *
 * The file is compiled with -ffp-contract=off: the only fused multiply-adds are the fma() calls written
 * here. Scalars come from Python already rounded to the work type (float32 for _f32 and _bf16).
 *
 * Bit layout of the 1-bit and lane encodings: lioncub.ops.packing (element 8j+i is bit 7-i of byte j;
 * p-bit lanes, first element in the high lane). Positions are absolute in the output (an element offset
 * into a bucket), so that a bucket's parameters can be encoded one call each.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LC_CLONES
#endif

#define LC_EXPORT __attribute__((visibility("default")))

static inline float bf16_load(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0; /* c10::BFloat16's NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_round(float f) {
    uint32_t u = (uint32_t)bf16_bits(f) << 16;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

#define LOAD_f32(p, i) ((p)[i])
#define LOAD_f64(p, i) ((p)[i])
#define LOAD_bf16(p, i) bf16_load((p), (i))
#define STORE_f32(p, i, x) ((p)[i] = (x))
#define STORE_f64(p, i, x) ((p)[i] = (x))
#define STORE_bf16(p, i, x) ((p)[i] = bf16_bits(x))
#define ROUND_f32(x) (x)
#define ROUND_f64(x) (x)
#define ROUND_bf16(x) bf16_round(x)
#define FMA_f32(a, b, c) fmaf((a), (b), (c))
#define FMA_f64(a, b, c) fma((a), (b), (c))
#define FMA_bf16(a, b, c) fmaf((a), (b), (c))

/* Set lanes [start, end) of `out` (bits-bit lanes at absolute lane positions) to value (0/1 per lane),
 * keeping the other lanes of the bytes at the two ends. */
LC_EXPORT void lc_fill_lanes(uint8_t *out, int64_t start, int64_t end, int bits, int value) {
    const int per = 8 / bits;
    for (int64_t pos = start; pos < end; pos++) {
        int shift = 8 - bits * (int)(pos % per + 1);
        uint8_t mask = (uint8_t)(((1u << bits) - 1u) << shift);
        out[pos / per] = (uint8_t)((out[pos / per] & ~mask) | ((value ? 1u : 0u) << shift));
    }
}

/* ---------------------------------------------------------------------------------- the direction
 * c = ROUND(fma(g, a1, ROUND(m * b1))), g negated when neg, +0 when has_g == 0; with mout (else NULL)
 * also the next momentum mout = ROUND(fma(g, a2, ROUND(m * b2))) (m is left as it is). Every variant returns
 * the number of non-finite c and writes the largest |c| to *peak (+Inf counts, NaN does not). The work
 * is done in blocks of BLOCK elements whose temporaries stay in L1: one vectorised loop computes c (and
 * the votes), a second one encodes the block. */

#define BLOCK 512
#define AHEAD (4 * BLOCK) /* software prefetch distance, elements */
#define GATHER 0x8040201008040201ULL /* (eight 0/1 bytes, little-endian) * GATHER >> 56: MSB-first byte */

#define ALWAYS static inline __attribute__((always_inline))

/* Copy a block to its place in a large output with non-temporal stores where possible (no read for
 * ownership of lines that are overwritten whole: the next momentum is written, never read, by its pass). */
ALWAYS void stream_f32(float *dst, const float *src, int64_t n) {
#if defined(__x86_64__)
    int64_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) dst[i] = src[i];
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    for (; i < n; i++) dst[i] = src[i];
#else
    memcpy(dst, src, (size_t)n * sizeof(float));
#endif
}

ALWAYS void stream_f64(double *dst, const double *src, int64_t n) {
#if defined(__x86_64__)
    int64_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 15); i++) dst[i] = src[i];
    for (; i + 2 <= n; i += 2) _mm_stream_pd(dst + i, _mm_loadu_pd(src + i));
    for (; i < n; i++) dst[i] = src[i];
#else
    memcpy(dst, src, (size_t)n * sizeof(double));
#endif
}

ALWAYS void stream_bf16(uint16_t *dst, const uint16_t *src, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(uint16_t));
}

ALWAYS void stream_fence(void) {
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

/* The software prefetch distance in elements, 0 for none: AHEAD, or 0 where the hardware prefetchers do
 * better on their own (lioncub.ops.native chooses, lc_set_prefetch sets it once per process). */
static int64_t lc_ahead = AHEAD;

LC_EXPORT void lc_set_prefetch(int on) { lc_ahead = on ? AHEAD : 0; }

ALWAYS void prefetch_block(const void *a, const void *b, int64_t bytes, int write) {
    for (int64_t q = 0; q < bytes; q += 64) {
        if (a) {
            if (write)
                __builtin_prefetch((const char *)a + q, 1);
            else
                __builtin_prefetch((const char *)a + q, 0);
        }
        if (b) __builtin_prefetch((const char *)b + q, 0);
    }
}

/* mode 0: c to cout; 1: sign(c) to sout (int8); 2: the vote [c > 0 or (c == 0 and zplus)] to vout
 * (uint8 0/1; zplus = 1: [c >= 0], the papers' rule) */
#define DIRECTION_CORE(SUF, T, W, U, ABS)                                                                \
    ALWAYS U dir_core_##SUF(const T *m, const T *g, int64_t n, W b1, W a1, const int neg,              \
                            const int has_g, const int mode, const int zplus, T *cout, int8_t *sout,     \
                            uint8_t *vout, U top, const int mom, T *mout, W b2, W a2) {                  \
        for (int64_t i = 0; i < n; i++) {                                                                \
            W gi = has_g ? (neg ? -LOAD_##SUF(g, i) : LOAD_##SUF(g, i)) : (W)0;                          \
            W mi = LOAD_##SUF(m, i);                                                                     \
            W c = ROUND_##SUF(FMA_##SUF(gi, a1, ROUND_##SUF(mi * b1)));                                  \
            if (mode == 0)                                                                               \
                STORE_##SUF(cout, i, c);                                                                 \
            else if (mode == 1)                                                                          \
                sout[i] = (int8_t)((c > 0) - (c < 0));                                                   \
            else                                                                                         \
                vout[i] = (uint8_t)((c > 0) | ((c == 0) & zplus));                                       \
            if (mom) STORE_##SUF(mout, i, ROUND_##SUF(FMA_##SUF(gi, a2, ROUND_##SUF(mi * b2))));         \
            U a;                                                                                         \
            memcpy(&a, &c, sizeof a);                                                                    \
            a &= ABS; /* |c| as bits: ordered like |c|; Inf and NaN lie above every finite value */      \
            top = a > top ? a : top;                                                                     \
        }                                                                                                \
        return top;                                                                                      \
    }                                                                                                    \
                                                                                                         \
    /* the (neg, has_g, momentum) specialisations of one mode */                                         \
    ALWAYS U dir_any_##SUF(const T *m, const T *g, int64_t n, W b1, W a1, int neg, int has_g,           \
                           const int mode, int zplus, T *cout, int8_t *sout, uint8_t *vout, U top,       \
                           T *mout, W b2, W a2) {                                                        \
        const int z = zplus ? 1 : 0;                                                                     \
        if (mout) {                                                                                      \
            if (!has_g) return dir_core_##SUF(m, g, n, b1, a1, 0, 0, mode, z, cout, sout, vout, top, 1, mout, b2, a2); \
            if (neg) return dir_core_##SUF(m, g, n, b1, a1, 1, 1, mode, z, cout, sout, vout, top, 1, mout, b2, a2); \
            return dir_core_##SUF(m, g, n, b1, a1, 0, 1, mode, z, cout, sout, vout, top, 1, mout, b2, a2); \
        }                                                                                                \
        if (!has_g) return dir_core_##SUF(m, g, n, b1, a1, 0, 0, mode, z, cout, sout, vout, top, 0, 0, b2, a2); \
        if (neg) return dir_core_##SUF(m, g, n, b1, a1, 1, 1, mode, z, cout, sout, vout, top, 0, 0, b2, a2); \
        return dir_core_##SUF(m, g, n, b1, a1, 0, 1, mode, z, cout, sout, vout, top, 0, 0, b2, a2);      \
    }                                                                                                    \
                                                                                                         \
    ALWAYS double peak_##SUF(U top) { /* the largest |c| (+Inf, NaN when some c is) as a double */      \
        W w;                                                                                             \
        memcpy(&w, &top, sizeof w);                                                                      \
        return (double)w;                                                                                \
    }                                                                                                    \
                                                                                                         \
    /* the blocks of one mode: m, g prefetched ahead, the next momentum streamed out */                  \
    ALWAYS U dir_blocks_##SUF(const T *m, const T *g, int64_t n, W b1, W a1, int neg, int has_g,        \
                              const int mode, T *cout, int8_t *sout, U top, T *mout, W b2, W a2) {       \
        T mbuf[BLOCK];                                                                                   \
        for (int64_t i = 0; i < n; i += BLOCK) {                                                         \
            int64_t len = n - i < BLOCK ? n - i : BLOCK;                                                 \
            if (lc_ahead && i + lc_ahead < n)                                                            \
                prefetch_block(m + i + lc_ahead, has_g ? g + i + lc_ahead : 0, BLOCK * (int64_t)sizeof(T), 0); \
            top = dir_any_##SUF(m + i, has_g ? g + i : g, len, b1, a1, neg, has_g, mode, 0,              \
                                cout ? cout + i : cout, sout ? sout + i : sout, 0, top, mout ? mbuf : 0, \
                                b2, a2);                                                                 \
            if (mout) stream_##SUF(mout + i, mbuf, len);                                                 \
        }                                                                                                \
        if (mout) stream_fence();                                                                        \
        return top;                                                                                      \
    }                                                                                                    \
                                                                                                         \
    /* c written to out (n elements); returns the largest |c| (NaN or Inf when some c is not finite) */   \
    LC_EXPORT LC_CLONES double lc_direction_##SUF(const T *m, const T *g, int64_t n, W b1, W a1,        \
                                                  int neg, int has_g, T *out, T *mout, W b2, W a2) {     \
        return peak_##SUF(dir_blocks_##SUF(m, g, n, b1, a1, neg, has_g, 0, out, 0, 0, mout, b2, a2));    \
    }                                                                                                    \
                                                                                                         \
    /* sign(c) as int8 (NaN -> 0) */                                                                     \
    LC_EXPORT LC_CLONES double lc_direction_sign_##SUF(const T *m, const T *g, int64_t n, W b1, W a1,   \
                                                       int neg, int has_g, int8_t *out, T *mout, W b2,   \
                                                       W a2) {                                           \
        return peak_##SUF(dir_blocks_##SUF(m, g, n, b1, a1, neg, has_g, 1, 0, out, 0, mout, b2, a2));    \
    }                                                                                                    \
                                                                                                         \
    /* the votes [c > 0 or (c == 0 and zplus)] in bits-bit lanes (bits 1, 2, 4, 8) at lane positions    \
     * [pos, pos + n) */                                                                                 \
    LC_EXPORT LC_CLONES double lc_direction_lanes_##SUF(const T *m, const T *g, int64_t n, W b1, W a1,  \
                                                        int neg, int has_g, uint8_t *out, int64_t pos,   \
                                                        int bits, int zplus, T *mout, W b2, W a2) {      \
        const int per = 8 / bits;                                                                        \
        uint8_t v[BLOCK];                                                                                \
        T mbuf[BLOCK];                                                                                   \
        int64_t i = 0;                                                                                   \
        U top = 0;                                                                                       \
        int64_t head = (per - pos % per) % per; /* lanes up to the first whole byte */                   \
        if (head > n) head = n;                                                                          \
        if (head) {                                                                                      \
            top = dir_any_##SUF(m, g, head, b1, a1, neg, has_g, 2, zplus, 0, 0, v, top, mout, b2, a2);   \
            for (int64_t j = 0; j < head; j++) lc_fill_lanes(out, pos + j, pos + j + 1, bits, v[j]);    \
            i = head;                                                                                    \
        }                                                                                                \
        uint8_t *dst = out + (pos + i) / per;                                                            \
        while (i < n) {                                                                                  \
            int64_t len = n - i < BLOCK ? n - i : BLOCK;                                                 \
            if (lc_ahead && i + lc_ahead < n)                                                            \
                prefetch_block(m + i + lc_ahead, has_g ? g + i + lc_ahead : 0, BLOCK * (int64_t)sizeof(T), 0); \
            top = dir_any_##SUF(m + i, has_g ? g + i : g, len, b1, a1, neg, has_g, 2, zplus, 0, 0, v,    \
                                top, mout ? mbuf : 0, b2, a2);                                           \
            if (mout) stream_##SUF(mout + i, mbuf, len);                                                 \
            int64_t whole = len / per * per, j = 0;                                                      \
            if (per == 8) {                                                                              \
                for (; j < whole; j += 8) {                                                              \
                    uint64_t w;                                                                          \
                    memcpy(&w, v + j, 8);                                                                \
                    *dst++ = (uint8_t)((w * GATHER) >> 56);                                              \
                }                                                                                        \
            } else if (per == 2) { /* constant lane counts: loops the compiler vectorises */             \
                for (; j < whole; j += 2) *dst++ = (uint8_t)(v[j] << 4 | v[j + 1]);                      \
            } else if (per == 4) {                                                                       \
                for (; j < whole; j += 4)                                                                \
                    *dst++ = (uint8_t)(v[j] << 6 | v[j + 1] << 4 | v[j + 2] << 2 | v[j + 3]);            \
            } else { /* 8-bit lanes: the votes themselves */                                             \
                memcpy(dst, v, (size_t)whole);                                                           \
                dst += whole;                                                                            \
                j = whole;                                                                               \
            }                                                                                            \
            for (; j < len; j++) lc_fill_lanes(out, pos + i + j, pos + i + j + 1, bits, v[j]);          \
            i += len;                                                                                    \
        }                                                                                                \
        if (mout) stream_fence();                                                                        \
        return peak_##SUF(top);                                                                          \
    }

DIRECTION_CORE(f32, float, float, uint32_t, 0x7FFFFFFFu)
DIRECTION_CORE(f64, double, double, uint64_t, 0x7FFFFFFFFFFFFFFFull)
DIRECTION_CORE(bf16, uint16_t, float, uint32_t, 0x7FFFFFFFu)

/* ---------------------------------------------------------------------------------- the apply
 * p <- ROUND(fma(u, neg_lr, decay ? ROUND(p * decay_factor) : p)) with u from
 *   kind 0: packed bits at bit positions [pos, pos + n): 1 -> +1, 0 -> -1;
 *   kind 1: int8 values u (sign_of: their sign);
 *   kind 2: values of the parameter's own type;
 *   kind 3: lane_bits-bit lanes (2, 4, 8) at lane positions [pos, pos + n), lane value v -> table[v];
 *   kind 4: int8 values divided by lane_bits (the mean of N signs: their sum / N);
 * then, when momentum, m <- ROUND(fma(g, a2, ROUND(m * b2))) (g negated when neg, +0 when has_g == 0).
 * The update of a block is first written to u[] in the work type (bits: eight values per byte from a
 * table), then one vectorised loop updates p and m. */

static float SIGNS_F32[256][8];
static double SIGNS_F64[256][8];

__attribute__((constructor)) static void lc_init_tables(void) {
    for (int b = 0; b < 256; b++)
        for (int j = 0; j < 8; j++) {
            SIGNS_F32[b][j] = ((b >> (7 - j)) & 1) ? 1.0f : -1.0f;
            SIGNS_F64[b][j] = ((b >> (7 - j)) & 1) ? 1.0 : -1.0;
        }
}

#define SIGNS_f32 SIGNS_F32
#define SIGNS_bf16 SIGNS_F32
#define SIGNS_f64 SIGNS_F64

#define APPLY(SUF, T, W)                                                                                 \
    ALWAYS void apply_core_##SUF(T *p, const W *u, int64_t n, W neg_lr, const int decay,                 \
                                 W decay_factor, const int momentum, T *m, const T *g, W b2, W a2,       \
                                 const int neg, const int has_g) {                                       \
        for (int64_t i = 0; i < n; i++) {                                                                \
            W w = LOAD_##SUF(p, i);                                                                      \
            if (decay) w = ROUND_##SUF(w * decay_factor);                                                \
            STORE_##SUF(p, i, ROUND_##SUF(FMA_##SUF(u[i], neg_lr, w)));                                  \
            if (momentum) {                                                                              \
                W gi = has_g ? (neg ? -LOAD_##SUF(g, i) : LOAD_##SUF(g, i)) : (W)0;                      \
                W t = ROUND_##SUF(LOAD_##SUF(m, i) * b2);                                                \
                STORE_##SUF(m, i, ROUND_##SUF(FMA_##SUF(gi, a2, t)));                                    \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    ALWAYS void apply_any_##SUF(T *p, const W *u, int64_t n, W neg_lr, int decay, W decay_factor,       \
                                int momentum, T *m, const T *g, W b2, W a2, int neg, int has_g) {        \
        if (!momentum) {                                                                                 \
            if (decay)                                                                                   \
                apply_core_##SUF(p, u, n, neg_lr, 1, decay_factor, 0, m, g, b2, a2, 0, 0);               \
            else                                                                                         \
                apply_core_##SUF(p, u, n, neg_lr, 0, decay_factor, 0, m, g, b2, a2, 0, 0);               \
        } else if (!has_g) {                                                                             \
            if (decay)                                                                                   \
                apply_core_##SUF(p, u, n, neg_lr, 1, decay_factor, 1, m, g, b2, a2, 0, 0);               \
            else                                                                                         \
                apply_core_##SUF(p, u, n, neg_lr, 0, decay_factor, 1, m, g, b2, a2, 0, 0);               \
        } else if (neg) {                                                                                \
            if (decay)                                                                                   \
                apply_core_##SUF(p, u, n, neg_lr, 1, decay_factor, 1, m, g, b2, a2, 1, 1);               \
            else                                                                                         \
                apply_core_##SUF(p, u, n, neg_lr, 0, decay_factor, 1, m, g, b2, a2, 1, 1);               \
        } else {                                                                                         \
            if (decay)                                                                                   \
                apply_core_##SUF(p, u, n, neg_lr, 1, decay_factor, 1, m, g, b2, a2, 0, 1);               \
            else                                                                                         \
                apply_core_##SUF(p, u, n, neg_lr, 0, decay_factor, 1, m, g, b2, a2, 0, 1);               \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    LC_EXPORT LC_CLONES void lc_apply_##SUF(T *p, int64_t n, int kind, const void *src, int64_t pos,    \
                                            int sign_of, W neg_lr, int decay, W decay_factor,            \
                                            int momentum, T *m, const T *g, W b2, W a2, int neg,         \
                                            int has_g, int lane_bits, const int8_t *table) {             \
        const uint8_t *bits = (const uint8_t *)src;                                                      \
        const int8_t *votes = (const int8_t *)src;                                                       \
        const T *values = (const T *)src;                                                                \
        W u[BLOCK];                                                                                      \
        W lanes[256 * 4]; /* kind 3: the update of every lane of every byte value (bits 2, 4, 8) */     \
        const int per = kind == 3 ? 8 / lane_bits : 1;                                                   \
        const unsigned mask = kind == 3 ? (1u << lane_bits) - 1u : 0u;                                   \
        if (kind == 3)                                                                                   \
            for (int b = 0; b < 256; b++)                                                                \
                for (int j = 0; j < per; j++)                                                            \
                    lanes[b * per + j] = (W)table[(b >> (8 - lane_bits * (j + 1))) & mask];              \
        for (int64_t i = 0; i < n;) {                                                                    \
            int64_t len = n - i < BLOCK ? n - i : BLOCK;                                                 \
            if (lc_ahead && i + lc_ahead < n) {                                                          \
                prefetch_block(p + i + lc_ahead, momentum ? m + i + lc_ahead : 0, BLOCK * (int64_t)sizeof(T), 1); \
                if (momentum && has_g) prefetch_block(g + i + lc_ahead, 0, BLOCK * (int64_t)sizeof(T), 0); \
            }                                                                                            \
            if (kind == 0) {                                                                             \
                int64_t j = 0, k = pos + i;                                                              \
                for (; j < len && (k & 7); j++, k++) u[j] = ((bits[k >> 3] >> (7 - (k & 7))) & 1) ? 1 : -1; \
                for (; j + 8 <= len; j += 8, k += 8) memcpy(u + j, SIGNS_##SUF[bits[k >> 3]], 8 * sizeof(W)); \
                for (; j < len; j++, k++) u[j] = ((bits[k >> 3] >> (7 - (k & 7))) & 1) ? 1 : -1;         \
            } else if (kind == 1) {                                                                      \
                if (sign_of)                                                                             \
                    for (int64_t j = 0; j < len; j++) u[j] = (W)((votes[i + j] > 0) - (votes[i + j] < 0)); \
                else                                                                                     \
                    for (int64_t j = 0; j < len; j++) u[j] = (W)votes[i + j];                            \
            } else if (kind == 4) {                                                                      \
                const W divisor = (W)lane_bits;                                                          \
                for (int64_t j = 0; j < len; j++) u[j] = (W)votes[i + j] / divisor;                      \
            } else if (kind == 3) {                                                                      \
                int64_t j = 0, k = pos + i;                                                              \
                for (; j < len && k % per; j++, k++) u[j] = lanes[bits[k / per] * per + k % per];        \
                if (per == 4) /* constant sizes: the copies inline */                                    \
                    for (; j + 4 <= len; j += 4, k += 4) memcpy(u + j, lanes + bits[k / 4] * 4, 4 * sizeof(W)); \
                else if (per == 2)                                                                       \
                    for (; j + 2 <= len; j += 2, k += 2) memcpy(u + j, lanes + bits[k / 2] * 2, 2 * sizeof(W)); \
                else                                                                                     \
                    for (; j < len; j++, k++) u[j] = lanes[bits[k]];                                     \
                for (; j < len; j++, k++) u[j] = lanes[bits[k / per] * per + k % per];                   \
            } else {                                                                                     \
                for (int64_t j = 0; j < len; j++) u[j] = LOAD_##SUF(values, i + j);                      \
            }                                                                                            \
            apply_any_##SUF(p + i, u, len, neg_lr, decay, decay_factor, momentum, momentum ? m + i : m,  \
                            momentum && has_g ? g + i : g, b2, a2, neg, has_g);                          \
            i += len;                                                                                    \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    /* the momentum alone: m <- ROUND(fma(g, a2, ROUND(m * b2))) */                                     \
    LC_EXPORT LC_CLONES void lc_momentum_##SUF(T *m, const T *g, int64_t n, W b2, W a2, int neg,        \
                                               int has_g) {                                              \
        for (int64_t i = 0; i < n; i++) {                                                                \
            W gi = has_g ? (neg ? -LOAD_##SUF(g, i) : LOAD_##SUF(g, i)) : (W)0;                          \
            STORE_##SUF(m, i, ROUND_##SUF(FMA_##SUF(gi, a2, ROUND_##SUF(LOAD_##SUF(m, i) * b2))));       \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    /* one Lion step: c = ROUND(fma(g, a1, ROUND(m * b1))), u = sign(c), the apply above, then m */      \
    ALWAYS void lion_core_##SUF(T *p, const T *g, T *m, int64_t n, W b1, W a1, W b2, W a2, W neg_lr,    \
                                const int decay, W decay_factor, const int neg) {                        \
        for (int64_t i = 0; i < n; i++) {                                                                \
            W gi = neg ? -LOAD_##SUF(g, i) : LOAD_##SUF(g, i);                                           \
            W mi = LOAD_##SUF(m, i);                                                                     \
            W c = ROUND_##SUF(FMA_##SUF(gi, a1, ROUND_##SUF(mi * b1)));                                  \
            W u = (W)((c > 0) - (c < 0));                                                                \
            W w = LOAD_##SUF(p, i);                                                                      \
            if (decay) w = ROUND_##SUF(w * decay_factor);                                                \
            STORE_##SUF(p, i, ROUND_##SUF(FMA_##SUF(u, neg_lr, w)));                                     \
            STORE_##SUF(m, i, ROUND_##SUF(FMA_##SUF(gi, a2, ROUND_##SUF(mi * b2))));                     \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    LC_EXPORT LC_CLONES void lc_lion_##SUF(T *p, const T *g, T *m, int64_t n, W b1, W a1, W b2, W a2,   \
                                           W neg_lr, int decay, W decay_factor, int neg) {               \
        if (decay && neg)                                                                                \
            lion_core_##SUF(p, g, m, n, b1, a1, b2, a2, neg_lr, 1, decay_factor, 1);                     \
        else if (decay)                                                                                  \
            lion_core_##SUF(p, g, m, n, b1, a1, b2, a2, neg_lr, 1, decay_factor, 0);                     \
        else if (neg)                                                                                    \
            lion_core_##SUF(p, g, m, n, b1, a1, b2, a2, neg_lr, 0, decay_factor, 1);                     \
        else                                                                                             \
            lion_core_##SUF(p, g, m, n, b1, a1, b2, a2, neg_lr, 0, decay_factor, 0);                     \
    }

APPLY(f32, float, float)
APPLY(f64, double, double)
APPLY(bf16, uint16_t, float)

/* ---------------------------------------------------------------------------------- L1 quantizer, pass 2
 * levels = clip(rint((x / d) * scale), -levels, levels), NaN -> 0, in float (wide == 0: d and scale
 * already rounded to float) or double; d per group of `chunk` elements (chunk == 0: one divisor).
 * out_bytes: 1, 2 or 4 (int8, int16, int32). */

#define QUANTIZE(SUF, T)                                                                                 \
    ALWAYS void quantize_core_##SUF(const T *x, int64_t n, double d64, const int wide, double scale,     \
                                    int64_t levels, void *out, const int out_bytes) {                    \
        const float d32 = (float)d64, s32 = (float)scale, top32 = (float)levels;                         \
        const double top64 = (double)levels;                                                             \
        for (int64_t i = 0; i < n; i++) {                                                                \
            int32_t q;                                                                                   \
            if (wide) {                                                                                  \
                double t = rint(((double)LOAD_##SUF(x, i) / d64) * scale);                               \
                t = t > top64 ? top64 : (t < -top64 ? -top64 : t);                                       \
                q = t == t ? (int32_t)t : 0;                                                             \
            } else {                                                                                     \
                float t = rintf(((float)LOAD_##SUF(x, i) / d32) * s32);                                  \
                t = t > top32 ? top32 : (t < -top32 ? -top32 : t);                                       \
                q = t == t ? (int32_t)t : 0;                                                             \
            }                                                                                            \
            if (out_bytes == 1)                                                                          \
                ((int8_t *)out)[i] = (int8_t)q;                                                          \
            else if (out_bytes == 2)                                                                     \
                ((int16_t *)out)[i] = (int16_t)q;                                                        \
            else                                                                                         \
                ((int32_t *)out)[i] = q;                                                                 \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    LC_EXPORT LC_CLONES void lc_quantize_##SUF(const T *x, int64_t n, const double *divisors,           \
                                               int64_t chunk, int wide, double scale, int64_t levels,    \
                                               void *out, int out_bytes) {                               \
        char *o = (char *)out;                                                                           \
        int64_t start = 0;                                                                               \
        for (int64_t grp = 0; start < n; grp++) {                                                        \
            int64_t len = chunk > 0 && chunk < n - start ? chunk : n - start;                            \
            const T *xs = x + start;                                                                     \
            void *os = o + start * out_bytes;                                                            \
            double d = divisors[grp];                                                                    \
            if (out_bytes == 1) {                                                                        \
                if (wide)                                                                                \
                    quantize_core_##SUF(xs, len, d, 1, scale, levels, os, 1);                            \
                else                                                                                     \
                    quantize_core_##SUF(xs, len, d, 0, scale, levels, os, 1);                            \
            } else if (out_bytes == 2) {                                                                 \
                quantize_core_##SUF(xs, len, d, wide, scale, levels, os, 2);                             \
            } else {                                                                                     \
                quantize_core_##SUF(xs, len, d, wide, scale, levels, os, 4);                             \
            }                                                                                            \
            start += len;                                                                                \
        }                                                                                                \
    }

QUANTIZE(f32, float)
QUANTIZE(f64, double)
QUANTIZE(bf16, uint16_t)

/* ---------------------------------------------------------------------------------- 1-bit majority
 * rows: n_rows x row_bytes packed votes; out[j] (out_bytes bytes): bit set where the count of set bits
 * over the rows reaches `threshold`; bits at positions >= n_bits are 0. Bit-sliced: the counts of 64
 * positions at a time live in bit planes, added with ripple carries and compared with the threshold. */

ALWAYS uint64_t ge_threshold(const uint64_t *plane, int planes, uint64_t threshold) {
    uint64_t gt = 0, eq = ~(uint64_t)0;
    for (int k = planes - 1; k >= 0; k--) {
        if ((threshold >> k) & 1) {
            eq &= plane[k];
        } else {
            gt |= eq & plane[k];
            eq &= ~plane[k];
        }
    }
    return gt | eq;
}

/* the words [j0, j1) of 8 bytes, with `planes` known at compile time where it is small */
ALWAYS void majority_words(const uint8_t *rows, int64_t n_rows, int64_t row_bytes, uint8_t *out,
                           int64_t j0, int64_t j1, const int planes, uint64_t threshold) {
    for (int64_t j = j0; j + 8 <= j1; j += 8) {
        uint64_t plane[64];
        for (int k = 0; k < planes; k++) plane[k] = 0;
        for (int64_t r = 0; r < n_rows; r++) {
            uint64_t carry;
            memcpy(&carry, rows + r * row_bytes + j, 8);
            for (int k = 0; k < planes; k++) {
                uint64_t t = plane[k] & carry;
                plane[k] ^= carry;
                carry = t;
            }
        }
        uint64_t word = ge_threshold(plane, planes, threshold);
        memcpy(out + j, &word, 8);
    }
}

LC_EXPORT LC_CLONES void lc_majority(const uint8_t *rows, int64_t n_rows, int64_t row_bytes,
                                     uint8_t *out, int64_t out_bytes, int64_t n_bits,
                                     int64_t threshold) {
    int planes = 1;
    while ((1LL << planes) <= n_rows) planes++;
    if ((1LL << planes) <= threshold) { /* no count reaches it */
        memset(out, 0, (size_t)out_bytes);
        return;
    }
    const int64_t words = out_bytes / 8 * 8;
    const uint64_t th = (uint64_t)threshold;
    switch (planes) { /* N = 1, 2-3, 4-7, 8-15: the plane loops unrolled */
    case 1: majority_words(rows, n_rows, row_bytes, out, 0, words, 1, th); break;
    case 2: majority_words(rows, n_rows, row_bytes, out, 0, words, 2, th); break;
    case 3: majority_words(rows, n_rows, row_bytes, out, 0, words, 3, th); break;
    case 4: majority_words(rows, n_rows, row_bytes, out, 0, words, 4, th); break;
    default: majority_words(rows, n_rows, row_bytes, out, 0, words, planes, th); break;
    }
    uint64_t plane[64];
    for (int64_t j = words; j < out_bytes; j++) {
        memset(plane, 0, sizeof(uint64_t) * (size_t)planes);
        for (int64_t r = 0; r < n_rows; r++) {
            uint64_t carry = rows[r * row_bytes + j];
            for (int k = 0; k < planes; k++) {
                uint64_t t = plane[k] & carry;
                plane[k] ^= carry;
                carry = t;
            }
        }
        out[j] = (uint8_t)ge_threshold(plane, planes, th);
    }
    int64_t tail = n_bits % 8;
    if (out_bytes && tail) out[out_bytes - 1] &= (uint8_t)(0xFF << (8 - tail));
}

/* The parameter server's count (Distributed Lion's majority): rows as lc_majority; out: 2-bit lanes
 * (lioncub.ops.packing.pack_lanes) holding sign(2 * count - N) + 1 for positions < n_bits, 0 beyond. */
LC_EXPORT LC_CLONES void lc_server_majority(const uint8_t *rows, int64_t n_rows, int64_t row_bytes,
                                            uint8_t *out, int64_t out_bytes, int64_t n_bits) {
    static uint16_t spread[256]; /* bit 7-i of a byte to bit 15-2i */
    static int ready = 0;
    if (!ready) {
        for (int b = 0; b < 256; b++) {
            uint16_t v = 0;
            for (int i = 0; i < 8; i++) v |= (uint16_t)(((b >> (7 - i)) & 1) << (15 - 2 * i));
            spread[b] = v;
        }
        ready = 1;
    }
    int planes = 1;
    while ((1LL << planes) <= n_rows) planes++;
    const uint64_t plus_at = (uint64_t)(n_rows / 2 + 1), not_minus_at = (uint64_t)((n_rows + 1) / 2);
    const int64_t in_bytes = (n_bits + 7) / 8;
    uint64_t plane[64];
    for (int64_t j = 0; j < in_bytes; j++) {
        memset(plane, 0, sizeof(uint64_t) * (size_t)planes);
        for (int64_t r = 0; r < n_rows; r++) {
            uint64_t carry = rows[r * row_bytes + j];
            for (int k = 0; k < planes; k++) {
                uint64_t t = plane[k] & carry;
                plane[k] ^= carry;
                carry = t;
            }
        }
        uint8_t plus = (uint8_t)ge_threshold(plane, planes, plus_at);
        uint8_t tie = (uint8_t)(ge_threshold(plane, planes, not_minus_at) & ~plus);
        if (j == in_bytes - 1 && n_bits % 8) { /* lanes past n_bits are 0 */
            uint8_t keep = (uint8_t)(0xFF << (8 - n_bits % 8));
            plus &= keep;
            tie &= keep;
        }
        uint16_t v = (uint16_t)(spread[plus] | (spread[tie] >> 1));
        if (2 * j < out_bytes) out[2 * j] = (uint8_t)(v >> 8);
        if (2 * j + 1 < out_bytes) out[2 * j + 1] = (uint8_t)(v & 0xFF);
    }
    for (int64_t j = 2 * in_bytes; j < out_bytes; j++) out[j] = 0;
}

/* ---------------------------------------------------------------------------------- dense contribution
 * The dense presets' wire buffer from the gradient in one pass: out = ROUND_wire(wire(g) / n), wire()
 * the conversion to the wire type (float32, float64 or bfloat16; double -> bfloat16 through float, as
 * c10 converts), then the division in the wire type's opmath (float for bfloat16); g negated when neg.
 * Returns the largest |g| (NaN or Inf when some g is not finite). in: 0 float, 1 double; wire: 0 float,
 * 1 double, 2 bfloat16. */

#define SCALE_CORE(NAME, TIN, TOUT, U, ABS, CONV)                                                       \
    ALWAYS double NAME(const TIN *g, int64_t n, const int neg, double divisor, TOUT *out) {               \
        U top = 0;                                                                                       \
        for (int64_t i = 0; i < n; i++) {                                                                \
            TIN x = neg ? -g[i] : g[i];                                                                  \
            U a;                                                                                         \
            memcpy(&a, &x, sizeof a);                                                                    \
            a &= ABS; /* |g| as bits: Inf and NaN above every finite value */                            \
            top = a > top ? a : top;                                                                     \
            CONV;                                                                                        \
        }                                                                                                \
        TIN peak;                                                                                        \
        memcpy(&peak, &top, sizeof peak);                                                                \
        return (double)peak;                                                                             \
    }

SCALE_CORE(scale_f32_f32, float, float, uint32_t, 0x7FFFFFFFu, out[i] = x / (float)divisor)
SCALE_CORE(scale_f64_f64, double, double, uint64_t, 0x7FFFFFFFFFFFFFFFull, out[i] = x / divisor)
SCALE_CORE(scale_f64_f32, double, float, uint64_t, 0x7FFFFFFFFFFFFFFFull, out[i] = (float)x / (float)divisor)
SCALE_CORE(scale_f32_bf16, float, uint16_t, uint32_t, 0x7FFFFFFFu,
           out[i] = bf16_bits(bf16_round(x) / (float)divisor))
SCALE_CORE(scale_f64_bf16, double, uint16_t, uint64_t, 0x7FFFFFFFFFFFFFFFull,
           out[i] = bf16_bits(bf16_round((float)x) / (float)divisor))

LC_EXPORT LC_CLONES double lc_scale(const void *g, int64_t n, int in, int neg, double divisor, void *out,
                                    int wire) {
    if (in == 0 && wire == 0) return neg ? scale_f32_f32(g, n, 1, divisor, out) : scale_f32_f32(g, n, 0, divisor, out);
    if (in == 1 && wire == 1) return neg ? scale_f64_f64(g, n, 1, divisor, out) : scale_f64_f64(g, n, 0, divisor, out);
    if (in == 1 && wire == 0) return scale_f64_f32(g, n, neg, divisor, out);
    if (in == 0 && wire == 2) return scale_f32_bf16(g, n, neg, divisor, out);
    if (in == 1 && wire == 2) return scale_f64_bf16(g, n, neg, divisor, out);
    return -1.0; /* not a combination of this file */
}

/* One Lion step of a float32 parameter whose gradient is bfloat16 (the 16-bit dense preset's mean
 * gradient, widened exactly): lc_lion_f32 with g read from bfloat16. */
LC_EXPORT LC_CLONES void lc_lion_f32_bf16g(float *p, const uint16_t *g, float *m, int64_t n, float b1, float a1,
                                           float b2, float a2, float neg_lr, int decay, float decay_factor) {
    for (int64_t i = 0; i < n; i++) {
        float gi = bf16_load(g, i), mi = m[i];
        float c = fmaf(gi, a1, mi * b1);
        float u = (float)((c > 0) - (c < 0));
        float w = decay ? p[i] * decay_factor : p[i];
        p[i] = fmaf(u, neg_lr, w);
        m[i] = fmaf(gi, a2, mi * b2);
    }
}

LC_EXPORT int lc_abi_version(void) { return 5; }

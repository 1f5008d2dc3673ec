/* Native CPU elementwise kernels (fp32), loaded by kvrelay.kernels.cpu_native through ctypes.
 * Same contracts as the torch references in kvrelay.kernels.reference; each is one pass over
 * its rows where the references run several torch ops, each reading and writing the activations.
 * Small inputs run on the calling thread: an OpenMP fork costs more than they do. Thread counts
 * come from the caller (torch.get_num_threads()): OpenMP's own default is per calling thread. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN_ELEMENTS 65536

/* out = w * (h * rsqrt(mean(h^2) + eps)) per row, where h = x, or h = x + residual (also written
 * to sum_out) when residual is given. Rows of x and residual are `x_stride` apart; out and sum_out
 * are contiguous. The sum of squares is kept in fp64, so it rounds once, like torch's pairwise sum. */
void add_rms_norm_f32(const float *x, const float *residual, const float *w, float *out, float *sum_out,
                      int64_t rows, int64_t cols, int64_t x_stride, int64_t residual_stride, float eps,
                      int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * cols;
        const float *h = xr;
        if (residual) {
            const float *rr = residual + r * residual_stride;
            float *s = sum_out + r * cols;
            for (int64_t c = 0; c < cols; c++) s[c] = xr[c] + rr[c];
            h = s;
        }
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < cols; c++) ss += (double)h[c] * h[c];
        const float inv = 1.0f / sqrtf((float)(ss / cols) + eps);
        for (int64_t c = 0; c < cols; c++) o[c] = w[c] * (h[c] * inv);
    }
}

/* Half-rotation rotary embedding of one tensor x[T, H, D] (token stride x_stride, heads packed)
 * into out[T, H, D] (contiguous); cos_sin[pos] holds cos in its first D/2 values, sin in the rest.
 * No fused multiply-add, so results are the reference's bit for bit. Returns -1, having written
 * nothing, when a position lies outside the table's num_positions rows. */
__attribute__((optimize("fp-contract=off")))
int rotary_f32(const int64_t *positions, const float *x, float *out, const float *cos_sin, int64_t tokens,
               int64_t heads, int64_t head_dim, int64_t x_stride, int64_t num_positions, int num_threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * x_stride + h * head_dim;
            float *o = out + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float c = cs[i], s = cs[half + i], x1 = xi[i], x2 = xi[half + i];
                const float a = x1 * c, b = -x2 * s, e = x2 * c, f = x1 * s;
                o[i] = a + b;
                o[half + i] = e + f;
            }
        }
    }
    return 0;
}

/* Copy rows key/value[t] (row_bytes each, rows `key_stride` / `value_stride` bytes apart) into the
 * layer caches at slot slots[t]; slots < 0 are skipped. Returns -1, having written nothing, when a
 * slot lies past the cache's num_slots. */
int write_kv_rows(const char *key, const char *value, char *k_cache, char *v_cache, const int64_t *slots,
                  int64_t tokens, int64_t row_bytes, int64_t key_stride, int64_t value_stride, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + t * key_stride, row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride, row_bytes);
    }
    return 0;
}

/* Unpack a gather_blocks buffer [layers, 2, n, block] into blocks ids[0..n) of the cache
 * [.., 2, num_blocks, block] for layers [layer_start, layer_start + layers); block_bytes per
 * (layer, K/V, block). One memcpy per block: torch's indexed assignment moved ~4.6 GB/s here,
 * memcpy 16-20 GB/s. Returns -1, having written nothing, if an id lies outside the cache. */
int scatter_blocks_rows(char *cache, const char *buf, const int64_t *ids, int64_t n, int64_t layers,
                        int64_t layer_start, int64_t num_blocks, int64_t block_bytes) {
    for (int64_t j = 0; j < n; j++)
        if (ids[j] < 0 || ids[j] >= num_blocks) return -1;
    for (int64_t l = 0; l < layers; l++) {
        for (int64_t kv = 0; kv < 2; kv++) {
            char *dst = cache + ((layer_start + l) * 2 + kv) * num_blocks * block_bytes;
            const char *src = buf + (l * 2 + kv) * n * block_bytes;
            for (int64_t j = 0; j < n; j++)
                memcpy(dst + ids[j] * block_bytes, src + j * block_bytes, (size_t)block_bytes);
        }
    }
    return 0;
}

/* Copy blocks between two KV caches of the same block shape, [L, 2, num_blocks, block] each:
 * dst block dst_ids[j] <- src block src_ids[j] for layers [layer_start, layer_start + layers),
 * K and V. The same-node direct hand-off: a decode worker copies a prefill worker's held blocks
 * (a read-only shared mapping of its cache) straight into its reserved ones. Returns -1, having
 * written nothing, if an id lies outside its cache. */
int copy_blocks_rows(char *dst, const char *src, const int64_t *dst_ids, const int64_t *src_ids, int64_t n,
                     int64_t layers, int64_t layer_start, int64_t dst_num_blocks, int64_t src_num_blocks,
                     int64_t block_bytes) {
    for (int64_t j = 0; j < n; j++)
        if (dst_ids[j] < 0 || dst_ids[j] >= dst_num_blocks || src_ids[j] < 0 || src_ids[j] >= src_num_blocks)
            return -1;
    for (int64_t l = layer_start; l < layer_start + layers; l++) {
        for (int64_t kv = 0; kv < 2; kv++) {
            char *d = dst + (l * 2 + kv) * dst_num_blocks * block_bytes;
            const char *s = src + (l * 2 + kv) * src_num_blocks * block_bytes;
            for (int64_t j = 0; j < n; j++)
                memcpy(d + dst_ids[j] * block_bytes, s + src_ids[j] * block_bytes, (size_t)block_bytes);
        }
    }
    return 0;
}

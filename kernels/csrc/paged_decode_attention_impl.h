/* Body of paged decode attention for one element type; paged_decode_attention.c includes it once
 * per dtype with T (element type), LOAD (T -> float), STORE (float -> T) and FN (name) defined.
 *
 * One query token per sequence against its paged context, read in place through the block
 * table: each K and V row crosses memory once. The torch reference instead gathers the blocks
 * into a padded copy and reads that back, three passes over the same bytes.
 *
 * A task is one sequence and a range of its KV heads (all of them when there are enough
 * sequences to keep every thread busy, so a task reads each block's rows front to back); a KV
 * head handles all query heads of its GQA group, so each K/V row is loaded once. Scores are
 * kept whole (two-pass softmax): a few KiB even for long contexts, small next to K/V.
 */

int FN(const T *q, const T *k_cache, const T *v_cache, T *out, const int32_t *block_tables,
       int64_t table_stride, const int32_t *seq_lens, int64_t batch, int64_t num_heads,
       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t block_stride,
       int64_t num_blocks, int64_t max_len, float scale, int num_threads) {
    const int64_t D = head_dim;
    const int64_t token_stride = num_kv_heads * D;
    const int64_t split = batch >= 4 * num_threads ? 1 : num_kv_heads;
    const int64_t heads_per_task = num_kv_heads / split;
    const int64_t rows = heads_per_task * (num_heads / num_kv_heads);  /* query heads per task */
    const int64_t stride = max_len > 0 ? max_len : 1;
    int status = 0; /* 0 ok, -1 out of memory, -2 block id out of range */
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * rows * stride);
        float *qf = malloc(sizeof(float) * rows * D);
        float *acc = malloc(sizeof(float) * rows * D);
        float *sums = malloc(sizeof(float) * rows);
        if (!scores || !qf || !acc || !sums) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < batch * split; task++) {
            if (!scores || !qf || !acc || !sums) continue;
            const int64_t b = task / split, h0 = (task % split) * heads_per_task;
            const int64_t len = seq_lens[b];
            const int32_t *table = block_tables + b * table_stride;
            int bad_block = 0;
            for (int64_t i = 0; i * block_size < len; i++)
                bad_block |= table[i] < 0 || table[i] >= num_blocks;
            if (bad_block) {
#pragma omp atomic write
                status = -2;
                continue;
            }
            /* Query rows h0*group .. are contiguous: heads of one KV head's group are adjacent. */
            const T *qb = q + (b * num_heads + h0 * (num_heads / num_kv_heads)) * D;
            for (int64_t i = 0; i < rows * D; i++) qf[i] = LOAD(qb[i]);
            const int64_t group = num_heads / num_kv_heads;

            for (int64_t start = 0; start < len; start += block_size) {
                const int64_t base = (int64_t)table[start / block_size] * block_stride + h0 * D;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t t = 0; t < n; t++) {
                    const T *k_row = k_cache + base + t * token_stride;
                    for (int64_t r = 0; r < rows; r++) {
                        const T *k = k_row + (r / group) * D;
                        const float *qr = qf + r * D;
                        double s = 0.0; /* fp64: random test models amplify fp32 rounding past 1e-4 */
#pragma omp simd reduction(+ : s)
                        for (int64_t d = 0; d < D; d++) s += qr[d] * LOAD(k[d]);
                        scores[r * stride + start + t] = (float)s * scale;
                    }
                }
            }

            for (int64_t r = 0; r < rows; r++) {
                float *sr = scores + r * stride;
                float m = -INFINITY;
                for (int64_t t = 0; t < len; t++) m = sr[t] > m ? sr[t] : m;
                float sum = 0.0f;
                for (int64_t t = 0; t < len; t++) {
                    sr[t] = expf(sr[t] - m);
                    sum += sr[t];
                }
                sums[r] = sum;
            }

            memset(acc, 0, sizeof(float) * rows * D);
            for (int64_t start = 0; start < len; start += block_size) {
                const int64_t base = (int64_t)table[start / block_size] * block_stride + h0 * D;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t t = 0; t < n; t++) {
                    const T *v_row = v_cache + base + t * token_stride;
                    for (int64_t r = 0; r < rows; r++) {
                        const T *v = v_row + (r / group) * D;
                        const float p = scores[r * stride + start + t];
                        float *ar = acc + r * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) ar[d] += p * LOAD(v[d]);
                    }
                }
            }
            T *ob = out + (b * num_heads + h0 * group) * D;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t d = 0; d < D; d++) ob[r * D + d] = STORE(acc[r * D + d] / sums[r]);
        }
        free(scores);
        free(qf);
        free(acc);
        free(sums);
    }
    return status;
}

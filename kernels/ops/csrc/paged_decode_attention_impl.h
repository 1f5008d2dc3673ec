/* Body of paged decode attention for one element type; paged_decode_attention.c includes it once
 * per dtype with T (element type), LOAD (T -> float), STORE (float -> T), DOTS (scores of a
 * block's tokens for one head), AXPY (probability-weighted sum of a block's V rows for one head)
 * and FN (name) defined; it undefines them at its end, ready for the next dtype.
 *
 * One query token per sequence against its paged context, read in place through the block
 * table: each K and V row crosses memory once. The torch reference instead gathers the blocks
 * into a padded copy and reads that back, three passes over the same bytes.
 *
 * A task is one sequence and a range of its KV heads (all of them when there are enough
 * sequences to keep every thread busy, so a task reads each block's rows front to back); a KV
 * head handles all query heads of its GQA group, so each K/V row is loaded once. Scores are
 * kept whole (two-pass softmax): a few KiB even for long contexts, small next to K/V.
 *
 * The K pass and then the V pass walk the blocks; each block first prefetches (into L2) the task's
 * rows of the block PREFETCH_AHEAD later, across the K -> V boundary. Blocks lie anywhere
 * in the pool, so the hardware prefetcher, which stops at 4 KiB pages, cannot run ahead of the
 * arithmetic on its own: with this, the kernel read at ~22 GB/s instead of ~17 on the 2-core
 * AVX-512 machine (benchmarks/decode_attention.py; on the AVX2 EPYC, 4 ahead matched no prefetch).
 */

int FN(const T *q, const T *k_cache, const T *v_cache, T *out, const int32_t *block_tables,
       int64_t table_stride, const int32_t *seq_lens, int64_t batch, int64_t num_heads,
       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t block_stride,
       int64_t num_blocks, int64_t max_len, float scale, int64_t window, float softcap, int num_threads) {
    const int64_t D = head_dim;
    const int64_t token_stride = num_kv_heads * D;
    const int64_t split = batch >= 4 * num_threads ? 1 : num_kv_heads;
    const int64_t heads_per_task = num_kv_heads / split;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t rows = heads_per_task * group; /* query heads per task */
    const int64_t row_bytes = heads_per_task * D * (int64_t)sizeof(T); /* a task's part of a token row */
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
            const int64_t nblk = (len + block_size - 1) / block_size;
            const int64_t first = window > 0 && len > window ? len - window : 0; /* first token attended */
            const int64_t blk0 = first / block_size;
            const int32_t *table = block_tables + b * table_stride;
            int bad_block = 0;
            for (int64_t i = blk0; i < nblk; i++) bad_block |= table[i] < 0 || table[i] >= num_blocks;
            if (bad_block) {
#pragma omp atomic write
                status = -2;
                continue;
            }
            /* Query rows h0*group .. are contiguous: heads of one KV head's group are adjacent. */
            const T *qb = q + (b * num_heads + h0 * group) * D;
            for (int64_t i = 0; i < rows * D; i++) qf[i] = LOAD(qb[i]);
            memset(acc, 0, sizeof(float) * rows * D);

            /* K pass: scores. Each block first prefetches the block PREFETCH_AHEAD later (past
             * the last K block: the first V blocks). */
            for (int64_t blk = blk0; blk < nblk; blk++) {
                const int64_t ahead = blk + PREFETCH_AHEAD;
                if (ahead < nblk)
                    PREFETCH_ROWS(k_cache + (int64_t)table[ahead] * block_stride + h0 * D, block_size, token_stride, row_bytes);
                else if (ahead - nblk + blk0 < nblk)
                    PREFETCH_ROWS(v_cache + (int64_t)table[ahead - nblk + blk0] * block_stride + h0 * D, block_size,
                                  token_stride, row_bytes);
                /* this block's tokens [start, start + n), clipped to [first, len) */
                const int64_t bstart = blk * block_size, start = bstart > first ? bstart : first;
                const int64_t n = (len - bstart < block_size ? len - bstart : block_size) - (start - bstart);
                const T *kb = k_cache + (int64_t)table[blk] * block_stride + (start - bstart) * token_stride + h0 * D;
#if defined(__AVX512F__) /* head by head over the block's tokens: q stays in registers */
                for (int64_t h = 0; h < heads_per_task; h++)
                    for (int64_t r = h * group; r < (h + 1) * group; r++)
                        DOTS(scores + r * stride + start, qf + r * D, kb + h * D, n, token_stride, D, scale);
#else /* token by token, so the block is read front to back: 5-15% faster on the AVX2 EPYC */
                for (int64_t t = 0; t < n; t++)
                    for (int64_t h = 0; h < heads_per_task; h++)
                        for (int64_t r = h * group; r < (h + 1) * group; r++)
                            DOTS(scores + r * stride + start + t, qf + r * D, kb + t * token_stride + h * D, 1,
                                 token_stride, D, scale);
#endif
            }
            for (int64_t r = 0; r < rows; r++) { /* softmax numerators and their sums */
                float *sr = scores + r * stride;
                if (softcap > 0.0f)
                    for (int64_t t = first; t < len; t++) sr[t] = softcap * tanhf(sr[t] / softcap);
                float m = -INFINITY;
#pragma omp simd reduction(max : m)
                for (int64_t t = first; t < len; t++) m = sr[t] > m ? sr[t] : m;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = first; t < len; t++) {
                    sr[t] = expf(sr[t] - m);
                    sum += sr[t];
                }
                sums[r] = sum;
            }
            /* V pass: probability-weighted sums. */
            for (int64_t blk = blk0; blk < nblk; blk++) {
                if (blk + PREFETCH_AHEAD < nblk)
                    PREFETCH_ROWS(v_cache + (int64_t)table[blk + PREFETCH_AHEAD] * block_stride + h0 * D, block_size,
                                  token_stride, row_bytes);
                const int64_t bstart = blk * block_size, start = bstart > first ? bstart : first;
                const int64_t n = (len - bstart < block_size ? len - bstart : block_size) - (start - bstart);
                const T *vb = v_cache + (int64_t)table[blk] * block_stride + (start - bstart) * token_stride + h0 * D;
                for (int64_t h = 0; h < heads_per_task; h++)
                    for (int64_t r = h * group; r < (h + 1) * group; r++)
                        AXPY(acc + r * D, scores + r * stride + start, vb + h * D, n, token_stride, D);
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

#undef T
#undef DOTS
#undef AXPY
#undef LOAD
#undef STORE
#undef FN

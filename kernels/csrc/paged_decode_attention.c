/* Native CPU paged decode attention (fp32, bf16, fp16), loaded by kvrelay.kernels.cpu_native
 * through ctypes. Same contract as kvrelay.kernels.reference.paged_decode_attention; every
 * function returns 0, -1 when a thread could not allocate its scratch buffers, or -2 when a
 * block table entry in use lies outside the cache (checked so it cannot read out of bounds). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_load(_Float16 x) { return (float)x; }
static inline _Float16 f16_store(float x) { return (_Float16)x; }

#define T float
#define LOAD f32_load
#define STORE f32_store
#define FN paged_decode_attention_f32
#include "paged_decode_attention_impl.h"
#undef T
#undef LOAD
#undef STORE
#undef FN

#define T uint16_t
#define LOAD bf16_load
#define STORE bf16_store
#define FN paged_decode_attention_bf16
#include "paged_decode_attention_impl.h"
#undef T
#undef LOAD
#undef STORE
#undef FN

#define T _Float16
#define LOAD f16_load
#define STORE f16_store
#define FN paged_decode_attention_f16
#include "paged_decode_attention_impl.h"
#undef T
#undef LOAD
#undef STORE
#undef FN

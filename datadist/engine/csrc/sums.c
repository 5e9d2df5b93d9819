/*
 * Block sums of a byte stream as it goes by (a summer), summed where the bytes lie (AVX2
 * loads and adds where the processor has them), of a plan's runs in plan order (shared
 * among threads for large plans), and the stream checksum made from them (CRC-32 of the
 * sums and the tail bytes: checksum.from_block_sums).
 */
#include "native.h"

/* Whether n more bytes fit the summer's blocks (and its tail). */
int summer_fits(const summer_t *m, uint64_t n) {
    uint64_t end = m->pos + n;
    if (end < m->pos || end > (uint64_t)m->nblocks << 12) return 0;
    return m->tail_start == UINT64_MAX || end <= m->tail_start + m->tail_len;
}

/* The two sums of the n bytes at s (a multiple of 64), as copy_sum_simd computes them but
 * without storing anything: loads and adds only, which is what summing bytes that a system
 * call just moved (so they are in the cache) costs.  AVX2 where the processor has it (four
 * words per register; the lane formula is copy_sum_simd's), else copy_sum_simd into a
 * scratch block. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx2"))) static void sum_avx2(const uint8_t *s, uint64_t n, uint64_t *sum, uint64_t *wsum) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
    for (uint64_t i = 0; i < n; i += 64) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(s + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(s + i + 32)));
        b0 = _mm256_add_epi64(b0, a0);
        b1 = _mm256_add_epi64(b1, a1);
    }
    uint64_t s1[8], s2[8], m = n / 64, total = 0, weighted = 0;
    _mm256_storeu_si256((__m256i *)s1, a0); _mm256_storeu_si256((__m256i *)(s1 + 4), a1);
    _mm256_storeu_si256((__m256i *)s2, b0); _mm256_storeu_si256((__m256i *)(s2 + 4), b1);
    for (uint64_t lane = 0; lane < 8; lane++) {
        total += s1[lane];
        weighted += 8 * (m * s1[lane] - s2[lane]) + lane * s1[lane];
    }
    *sum = total;
    *wsum = weighted;
}
#define DD_HAVE_AVX2 1
#endif

/* Add the n bytes at s (value offset o on, inside one 4 KiB block) to the sums, without
 * moving them. */
static void sum_block(const uint8_t *s, uint64_t n, uint64_t o, uint64_t *sums) {
#if defined(DD_HAVE_AVX2)
    static int avx2 = -1;
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (avx2 && !(o & 7) && n >= 64) {
        uint64_t body = n & ~(uint64_t)63, sum, rel, k = ((o & 4095) >> 3) + 1;
        sum_avx2(s, body, &sum, &rel);
        sums[2 * (o >> 12)] += sum;
        sums[2 * (o >> 12) + 1] += k * sum + rel;
        s += body; o += body; n -= body;
    }
#endif
    uint8_t scratch[4096] __attribute__((aligned(64)));
    copy_sum(scratch, s, n, o, sums, 0);
}

/* Add the n bytes at s (the stream's next ones) to the sums, without moving them: whole
 * words are summed where they lie (sum_block), the rest goes through copy_sum into a
 * block-sized scratch that stays in the L1 cache (or into the tail), so the sums are
 * those of a copy by construction.  The caller checked summer_fits. */
void sum_piece(summer_t *m, const uint8_t *s, uint64_t n) {
    while (n) {
        uint64_t o = m->pos, take = 4096 - (o & 4095);
        if (o >= m->tail_start) {
            take = n;
            copy_sum(m->tail + (o - m->tail_start), s, take, o, m->sums, 0);
        } else {
            if (m->tail_start - o < take) take = m->tail_start - o;
            if (take > n) take = n;
            sum_block(s, take, o, m->sums);
        }
        m->pos += take;
        s += take;
        n -= take;
    }
}

/* The block sums of the whole 4 KiB blocks of the n bytes at s, added to sums (two per
 * block), without moving them. */
void dd_sum_blocks(const uint8_t *s, uint64_t n, uint64_t *sums) {
    summer_t m = {sums, (size_t)(n >> 12), 0, NULL, UINT64_MAX, 0};
    sum_piece(&m, s, n & ~(uint64_t)4095);
}

typedef struct {
    const plan_t *p;
    uint8_t *out;
    uint64_t lo;
} gather_t;

static void gather_piece(void *ctx, size_t t, size_t u, uint64_t a, uint64_t from, uint64_t to) {
    const gather_t *g = ctx;
    memcpy(g->out + (a + from - g->lo), (const uint8_t *)(uintptr_t)(g->p->b_base[t] + g->p->b_off[u] + from),
           to - from);
}

/* Copy the bytes of the plan's stream (b side: the destination) from offset lo to its end
 * into out: the kept last partial block of a stream copied with block sums. */
void gather_stream(const plan_t *p, uint64_t lo, uint8_t *out) {
    gather_t g = {p, out, lo};
    walk_stream(p, lo, plan_bytes(p), gather_piece, &g);
}

typedef struct {
    const plan_t *p;
    summer_t *m;
    uint64_t start; /* the summer's pos at the stream's offset 0 */
} sum_walk_t;

static void sum_run_piece(void *ctx, size_t t, size_t u, uint64_t a, uint64_t from, uint64_t to) {
    sum_walk_t *w = ctx;
    w->m->pos = w->start + a + from;
    sum_piece(w->m, (const uint8_t *)(uintptr_t)(w->p->a_base[t] + w->p->a_off[u] + from), to - from);
}

/* Add bytes [lo, hi) of the a side's stream (the runs in plan order) to the summer, whose
 * pos is the stream's offset 0 plus `start`. */
static void sum_range(const plan_t *p, summer_t *m, uint64_t start, uint64_t lo, uint64_t hi) {
    sum_walk_t w = {p, m, start};
    walk_stream(p, lo, hi, sum_run_piece, &w);
}

/* One thread's share of a plan's sums: chunks of 4 KiB aligned stream ranges, so the
 * threads add to disjoint blocks (and tail bytes) of the one shared summer. */
typedef struct {
    const plan_t *p;
    chunks_t *work;
    summer_t m;      /* this thread's cursor over the shared sums and tail */
    uint64_t start;  /* the summer's pos at the stream's offset 0 */
} sum_part_t;

static void *sum_thread(void *arg) {
    sum_part_t *w = arg;
    uint64_t lo, hi;
    while (next_chunk(w->work, &lo, &hi)) sum_range(w->p, &w->m, w->start, lo, hi);
    return NULL;
}

/* Add the a side's runs of a plan, in plan order, to the summer's stream (the caller
 * checked summer_fits): the checksum of what a transfer of that plan would move.  Large
 * plans whose stream starts on a block boundary are summed by up to max_threads threads:
 * an owner summing a one-sided copy's half reads it from memory, which one core does at
 * a fraction of the memory's bandwidth. */
void dd_sum_plan(summer_t *m, const plan_t *p, int max_threads) {
    uint64_t total = plan_bytes(p);
    int n = (m->pos & 4095) ? 1 : parts_for(max_threads, total);
    if (n == 1) {
        sum_range(p, m, m->pos, 0, total);
        return;
    }
    chunks_t work = chunks_for(total, n, 0);
    sum_part_t parts[DD_MAX_THREADS];
    for (int k = 0; k < n; k++) parts[k] = (sum_part_t){p, &work, *m, m->pos};
    run_threads(sum_thread, parts, sizeof(sum_part_t), n);
}

/* CRC-32 (the IEEE polynomial, reflected: zlib's crc32, chained the same way). */
static uint32_t crc_table[256];

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, uint64_t n) {
    if (!crc_table[1]) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            crc_table[i] = c;
        }
    }
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* The checksum of an n-byte stream from its summer (checksum.from_block_sums): CRC-32 of
 * the sums of its whole blocks, then of its tail bytes, with n in the high half. */
uint64_t summer_checksum(const summer_t *m, uint64_t n) {
    uint32_t crc = crc32_update(0, (const uint8_t *)m->sums, (n >> 12) * 16);
    if (n & 4095) crc = crc32_update(crc, m->tail, n & 4095);
    return (n & 0xFFFFFFFFu) << 32 | crc;
}

/* A summer for a whole n-byte stream in memory of its own (free with summer_free);
 * nblocks 0 when out of memory. */
summer_t summer_alloc(uint64_t n) {
    summer_t m = {calloc((size_t)((n + 4095) >> 12) * 2 + 1, 8), (size_t)((n + 4095) >> 12), 0,
                  malloc((size_t)(n & 4095) + 1), n - (n & 4095), n & 4095};
    if (!m.sums || !m.tail) {
        free(m.sums);
        free(m.tail);
        m.sums = NULL;
        m.tail = NULL;
        m.nblocks = 0;
    }
    return m;
}

void summer_free(summer_t *m) {
    free(m->sums);
    free(m->tail);
}

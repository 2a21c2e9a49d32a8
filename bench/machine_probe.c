/* This CPU's throughput limits, for bench/machine_limits.py (which compiles it with -O2 -march=native
 * -pthread and runs it): each probe is a tight loop on T threads, each thread for about MS
 * milliseconds after a common start, and prints one line "<probe> <threads> <ops per second>".
 *
 *   machine_probe vnni512|vnni512fold|int8avx2|fma512|fma256 THREADS MS
 *       int8 multiply-adds (one u8 x s8 product added into an int32 = one multiply-add) or fp32 FMAs:
 *       16 (vnni512, fma512), 8 (fma256) or 6 (int8avx2: 16 ymm registers) independent accumulators per
 *       thread, so the loop
 *       is bound by the instructions' throughput, not their latency
 *         vnni512   vpdpbusd zmm (AVX-512 VNNI): 64 multiply-adds per instruction
 *         vnni512fold  vpdpbusd with a 32-element block format's per-block fold (see vnni512fold)
 *         int8avx2  vpmaddubsw + vpmaddwd + vpaddd on ymm (AVX2 without VNNI): 32 per three instructions
 *         fma512    vfmadd231ps zmm: 16 FMAs; fma256: vfmadd231ps ymm, 8
 *   machine_probe clock THREADS MS
 *       a chain of dependent adds (x86-64), one per cycle: adds/s is the clock each thread runs at
 *   machine_probe read THREADS MB
 *       read bandwidth: MB megabytes (far past the caches), each thread summing its own contiguous
 *       part with 64-byte loads into 8 accumulators; after one untimed pass (page faults, TLB), five
 *       timed passes, each printed as "read <threads> <bytes per second> <on CPU time>"
 * Each line ends with the same rate over the threads' own CPU time instead (each thread's work over
 * its CLOCK_THREAD_CPUTIME_ID, summed over the threads): the rate of cores that other processes did
 * not share, i.e. the quiet machine's, whatever the load (for reads an upper estimate, as threads that
 * ran at different times did not share the memory system).
 * A probe this CPU or compiler lacks prints "<probe> <threads> unsupported". */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static double cpu_now(void) {  /* this thread's CPU time: excludes the time other processes hold the core */
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

enum { CHUNK = 1 << 16 };  /* loop iterations between clock reads */

typedef struct {
    const char *kind;
    double seconds;          /* compute: how long each thread runs */
    const uint8_t *data;     /* read: this thread's part */
    size_t bytes;
    pthread_barrier_t *start, *end;
    double ops, elapsed, cpu; /* out: multiply-adds done, seconds taken, of them on the CPU */
    long long sink;          /* out: keeps the loops' results alive */
} Job;

#define RUN_FOR(job, body)                                                              \
    do {                                                                                \
        double t0_ = now(), c0_ = cpu_now(), t_;                                          \
        long long chunks = 0;                                                           \
        do {                                                                            \
            for (int i = 0; i < CHUNK; i++) { body }                                    \
            chunks++;                                                                   \
        } while ((t_ = now()) - t0_ < (job)->seconds);                                  \
        (job)->elapsed = t_ - t0_;                                                     \
        (job)->cpu = cpu_now() - c0_;                                                  \
        (job)->ops = (double)chunks * CHUNK;                                            \
    } while (0)

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define HAVE_VNNI512 1
static void vnni512(Job *job) {
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    __m512i c[16];
    for (int k = 0; k < 16; k++) c[k] = _mm512_set1_epi32(k);
    RUN_FOR(job, {
        for (int k = 0; k < 16; k++) c[k] = _mm512_dpbusd_epi32(c[k], a, b);
        __asm__ volatile("" : "+v"(a), "+v"(b));  /* the inputs may change: nothing is hoisted */
    });
    job->ops *= 16.0 * 64;
    __m512i s = c[0];
    for (int k = 1; k < 16; k++) s = _mm512_add_epi32(s, c[k]);
    job->sink = _mm512_reduce_add_epi32(s);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* vnni512fold: vpdpbusd with the per-block work an exact kernel of a 32-element block format cannot skip, as
 * kernels/csrc/quant_dot.c's wide tile (4 rows by 32 outputs, two groups of 16) does it for Q8_0. Per block: each
 * (row, group)'s int32 sum starts from the block's correction, takes 8 vpdpbusd (one a k-group: the group's 64 weight
 * bytes + 128 by the row's 4 activations broadcast), then the fold: converted to fp32, the block's scale product
 * (weight scale by activation scale) rounded, and one fma into the fp32 sum. The fold is 3 vector operations per 8
 * vpdpbusd whatever the tile's shape; the weights (1 KiB) stay in L1, so this is a ceiling for the tiles. */
static void vnni512fold(Job *job) {
    static uint8_t w[2][8][64] __attribute__((aligned(64)));
    static int8_t x[4][32] __attribute__((aligned(64)));
    static float dw[2][16] __attribute__((aligned(64))), dx[4] = {1.0f, 0.5f, 0.25f, 2.0f};
    static int32_t sums[4] = {1, 2, 3, 4};
    for (int i = 0; i < 2 * 8 * 64; i++) ((uint8_t *)w)[i] = (uint8_t)(i * 7);
    for (int i = 0; i < 4 * 32; i++) ((int8_t *)x)[i] = (int8_t)(i * 3);
    for (int i = 0; i < 32; i++) ((float *)dw)[i] = 1e-3f * (float)i;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[2][4];
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < 4; r++) acc[v][r] = _mm512_setzero_ps();
    const uint8_t *wp = &w[0][0][0];
    const int8_t *xp = &x[0][0];
    RUN_FOR(job, {
        __asm__ volatile("" : "+r"(wp), "+r"(xp));  /* the next block's bytes, as far as the compiler knows */
        __m512i t[2][4];
        for (int r = 0; r < 4; r++) t[0][r] = t[1][r] = _mm512_set1_epi32(-128 * sums[r]);
        for (int g = 0; g < 8; g++) {
            const __m512i w0 = _mm512_xor_si512(_mm512_load_si512((const void *)(wp + 64 * g)), flip);
            const __m512i w1 = _mm512_xor_si512(_mm512_load_si512((const void *)(wp + 512 + 64 * g)), flip);
            for (int r = 0; r < 4; r++) {
                int32_t four;
                memcpy(&four, xp + 32 * r + 4 * g, 4);
                const __m512i b = _mm512_set1_epi32(four);
                t[0][r] = _mm512_dpbusd_epi32(t[0][r], w0, b);
                t[1][r] = _mm512_dpbusd_epi32(t[1][r], w1, b);
            }
        }
        for (int v = 0; v < 2; v++) {
            const __m512 scale_w = _mm512_load_ps(dw[v]);
            for (int r = 0; r < 4; r++)
                acc[v][r] = _mm512_fmadd_ps(_mm512_mul_ps(scale_w, _mm512_set1_ps(dx[r])),
                                            _mm512_cvtepi32_ps(t[v][r]), acc[v][r]);
        }
    });
    job->ops *= 64.0 * 64;
    __m512 s = _mm512_setzero_ps();
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < 4; r++) s = _mm512_add_ps(s, acc[v][r]);
    job->sink = (long long)_mm512_reduce_add_ps(s);
}
#endif

#if defined(__AVX2__)
#define HAVE_INT8AVX2 1
static void int8avx2(Job *job) {
    /* each accumulator its own activations: one product per accumulator, none shared (common
       subexpressions would leave fewer multiplies than counted); named variables, not an array,
       so that they stay in registers */
    __m256i b = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_set1_epi8(1), a1 = _mm256_set1_epi8(2), a2 = _mm256_set1_epi8(3);
    __m256i a3 = _mm256_set1_epi8(4), a4 = _mm256_set1_epi8(5), a5 = _mm256_set1_epi8(6);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
#define STEP(c, a) c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones))
    RUN_FOR(job, {
        STEP(c0, a0); STEP(c1, a1); STEP(c2, a2); STEP(c3, a3); STEP(c4, a4); STEP(c5, a5);
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
    });
#undef STEP
    job->ops *= 6.0 * 32;
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(c4, c5));
    int32_t out[8];
    _mm256_storeu_si256((__m256i *)out, s);
    job->sink = 0;
    for (int j = 0; j < 8; j++) job->sink += out[j];
}
#endif

#if defined(__AVX512F__)
#define HAVE_FMA512 1
static void fma512(Job *job) {
    __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-7f), c[16];
    for (int k = 0; k < 16; k++) c[k] = _mm512_set1_ps((float)k);
    RUN_FOR(job, {
        for (int k = 0; k < 16; k++) c[k] = _mm512_fmadd_ps(a, b, c[k]);
        __asm__ volatile("" : "+v"(a), "+v"(b));
    });
    job->ops *= 16.0 * 16;
    __m512 s = c[0];
    for (int k = 1; k < 16; k++) s = _mm512_add_ps(s, c[k]);
    job->sink = (long long)_mm512_reduce_add_ps(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_FMA256 1
static void fma256(Job *job) {
    __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-7f), c[8];
    for (int k = 0; k < 8; k++) c[k] = _mm256_set1_ps((float)k);
    RUN_FOR(job, {
        for (int k = 0; k < 8; k++) c[k] = _mm256_fmadd_ps(a, b, c[k]);
        __asm__ volatile("" : "+x"(a), "+x"(b));
    });
    job->ops *= 8.0 * 8;
    float out[8];
    __m256 s = c[0];
    for (int k = 1; k < 8; k++) s = _mm256_add_ps(s, c[k]);
    _mm256_storeu_ps(out, s);
    job->sink = (long long)(out[0] + out[7]);
}
#endif

#if defined(__x86_64__)
#define HAVE_CLOCK 1
static void clock_chain(Job *job) {
    /* one dependent add per cycle: adds/s is the core's clock as this thread sees it (time-sharing
       with other processes lowers it as it lowers every probe; the ratio of a probe to it is
       instructions per cycle) */
    long long x = 0;
    RUN_FOR(job, {
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                         "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    });
    job->ops *= 8;
    job->sink = x;
}
#endif

static void read_pass(Job *job) {
    double c0 = cpu_now();
    const uint8_t *p = job->data;
    size_t n = job->bytes / 64 * 64;
#if defined(__AVX512F__)
    __m512i s[8];
    for (int k = 0; k < 8; k++) s[k] = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 512 <= n; i += 512)
        for (int k = 0; k < 8; k++) s[k] = _mm512_add_epi64(s[k], _mm512_load_si512((const void *)(p + i + 64 * k)));
    for (int k = 1; k < 8; k++) s[0] = _mm512_add_epi64(s[0], s[k]);
    job->sink += _mm512_reduce_add_epi64(s[0]);
#else
    const uint64_t *q = (const uint64_t *)p;
    uint64_t s[8] = {0};
    for (size_t i = 0; i + 8 <= n / 8; i += 8)
        for (int k = 0; k < 8; k++) s[k] += q[i + k];
    for (int k = 0; k < 8; k++) job->sink += (long long)s[k];
#endif
    job->cpu = cpu_now() - c0;
}

static void *worker(void *arg) {
    Job *job = arg;
    int reads = strcmp(job->kind, "read") == 0;
    for (int pass = 0; pass < (reads ? 6 : 1); pass++) {
        pthread_barrier_wait(job->start);
        if (reads) read_pass(job);
#ifdef HAVE_VNNI512
        else if (!strcmp(job->kind, "vnni512")) vnni512(job);
        else if (!strcmp(job->kind, "vnni512fold")) vnni512fold(job);
#endif
#ifdef HAVE_INT8AVX2
        else if (!strcmp(job->kind, "int8avx2")) int8avx2(job);
#endif
#ifdef HAVE_FMA512
        else if (!strcmp(job->kind, "fma512")) fma512(job);
#endif
#ifdef HAVE_FMA256
        else if (!strcmp(job->kind, "fma256")) fma256(job);
#endif
#ifdef HAVE_CLOCK
        else if (!strcmp(job->kind, "clock")) clock_chain(job);
#endif
        pthread_barrier_wait(job->end);
    }
    return NULL;
}

static int supported(const char *kind) {
    if (!strcmp(kind, "read")) return 1;
#ifdef HAVE_VNNI512
    if (!strcmp(kind, "vnni512") || !strcmp(kind, "vnni512fold")) return 1;
#endif
#ifdef HAVE_INT8AVX2
    if (!strcmp(kind, "int8avx2")) return 1;
#endif
#ifdef HAVE_FMA512
    if (!strcmp(kind, "fma512")) return 1;
#endif
#ifdef HAVE_FMA256
    if (!strcmp(kind, "fma256")) return 1;
#endif
#ifdef HAVE_CLOCK
    if (!strcmp(kind, "clock")) return 1;
#endif
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s vnni512|vnni512fold|int8avx2|fma512|fma256|clock THREADS MS | read THREADS MB\n", argv[0]);
        return 2;
    }
    const char *kind = argv[1];
    int threads = atoi(argv[2]);
    double amount = atof(argv[3]);
    if (threads < 1 || amount <= 0) return 2;
    if (!supported(kind)) {
        printf("%s %d unsupported\n", kind, threads);
        return 0;
    }
    int reads = !strcmp(kind, "read");
    size_t total = reads ? (size_t)(amount * (1 << 20)) / (512 * threads) * (512 * threads) : 0;
    uint8_t *data = NULL;
    if (reads) {
        if (posix_memalign((void **)&data, 4096, total)) return 1;
        memset(data, 1, total);
    }
    pthread_barrier_t start, end;
    pthread_barrier_init(&start, NULL, threads + 1);
    pthread_barrier_init(&end, NULL, threads + 1);
    Job *jobs = calloc(threads, sizeof(Job));
    pthread_t *ids = calloc(threads, sizeof(pthread_t));
    for (int t = 0; t < threads; t++) {
        jobs[t] = (Job){.kind = kind, .seconds = reads ? 0 : amount / 1e3, .start = &start, .end = &end,
                        .data = reads ? data + total / threads * t : NULL, .bytes = total / threads};
        pthread_create(&ids[t], NULL, worker, &jobs[t]);
    }
    long long sink = 0;
    for (int pass = 0; pass < (reads ? 6 : 1); pass++) {
        pthread_barrier_wait(&start);
        double t0 = now();
        pthread_barrier_wait(&end);
        double wall = now() - t0;
        double on_cpu = 0;  /* each thread's part over its own CPU time, summed */
        for (int t = 0; t < threads; t++) on_cpu += jobs[t].bytes / jobs[t].cpu;
        if (reads && pass > 0) printf("read %d %.6e %.6e\n", threads, total / wall, on_cpu);
    }
    if (!reads) {  /* each thread stops on its own clock: ops over the longest thread's time */
        double ops = 0, longest = 0, on_cpu = 0;
        for (int t = 0; t < threads; t++) {
            ops += jobs[t].ops;
            on_cpu += jobs[t].ops / jobs[t].cpu;
            if (jobs[t].elapsed > longest) longest = jobs[t].elapsed;
        }
        printf("%s %d %.6e %.6e\n", kind, threads, ops / longest, on_cpu);
    }
    for (int t = 0; t < threads; t++) {
        pthread_join(ids[t], NULL);
        sink += jobs[t].sink;
    }
    fprintf(stderr, "sink %lld\n", sink);
    free(data);
    return 0;
}

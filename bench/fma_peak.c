/* The float32 multiply-add rate this host's CPUs issue at most: one thread per CPU named, each pinned, each running
 * independent fused multiply-add chains in registers (no memory traffic), 256-bit (AVX2 + FMA) or 512-bit
 * (AVX-512F) wide. It is the ceiling any float32 kernel on these CPUs stays under, measured rather than taken from a
 * data sheet (a VM's clock is not the one it reports). bench/fma_peak.py builds and runs it.
 *
 *     fma_peak WIDTH ITERATIONS CPU [CPU ...]   -> prints the multiply-adds per second of all threads together
 *
 * WIDTH is 256 or 512. Exit status 2 with a message on stderr for a bad argument, a CPU this process may not run on,
 * or a width this CPU does not have.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 12 /* independent accumulators: more than latency (4 cycles) x FMA ports (2) on current x86 cores */
#define MAX_THREADS 256

static long iterations;
static int width;
static _Atomic int ready;
static _Atomic int go;
static volatile float sink; /* the chains' sums are stored, so no compiler may drop them */

/* a whole decimal argument in [lo, hi], or -1 ("abc" or "3x" is not 0 or 3) */
static long parse(const char *text, long lo, long hi) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    return (errno || end == text || *end || v < lo || v > hi) ? -1 : v;
}

__attribute__((target("avx2,fma"))) static float chains256(long n) {
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long k = 0; k < n; k++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    __m256 s = acc[0];
    for (int i = 1; i < CHAINS; i++) s = _mm256_add_ps(s, acc[i]);
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[7];
}

__attribute__((target("avx512f"))) static float chains512(long n) {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (long k = 0; k < n; k++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    __m512 s = acc[0];
    for (int i = 1; i < CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    return _mm512_reduce_add_ps(s);
}

struct job {
    int cpu;
    float sum;
};

static void *run(void *arg) {
    struct job *job = arg;
    int cpu = job->cpu;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set); /* checked against the mask in main */
    atomic_fetch_add(&ready, 1);
    while (!atomic_load(&go)) sched_yield(); /* the main thread needs a CPU to say go */
    job->sum = width == 512 ? chains512(iterations) : chains256(iterations);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: fma_peak WIDTH ITERATIONS CPU [CPU ...]\n");
        return 2;
    }
    width = (int)parse(argv[1], 256, 512);
    iterations = parse(argv[2], 1, 1L << 40);
    int n = argc - 3;
    if ((width != 256 && width != 512) || iterations < 0 || n > MAX_THREADS) {
        fprintf(stderr, "fma_peak: WIDTH must be 256 or 512, ITERATIONS a positive integer, at most %d CPUs\n",
                MAX_THREADS);
        return 2;
    }
    __builtin_cpu_init();
    if (width == 512 ? !__builtin_cpu_supports("avx512f")
                     : !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
        fprintf(stderr, "fma_peak: this CPU has no %d-bit FMA\n", width);
        return 2;
    }
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
        perror("fma_peak: sched_getaffinity");
        return 2;
    }
    static struct job jobs[MAX_THREADS];
    for (int i = 0; i < n; i++) {
        long cpu = parse(argv[3 + i], 0, CPU_SETSIZE - 1);
        if (cpu < 0 || !CPU_ISSET(cpu, &allowed)) {
            fprintf(stderr, "fma_peak: cannot run on CPU %s\n", argv[3 + i]);
            return 2;
        }
        jobs[i].cpu = (int)cpu;
    }
    pthread_t threads[MAX_THREADS];
    for (int i = 0; i < n; i++)
        if (pthread_create(&threads[i], NULL, run, &jobs[i]) != 0) {
            fprintf(stderr, "fma_peak: cannot start a thread\n");
            return 2; /* the threads started spin until exit, which ends them */
        }
    while (atomic_load(&ready) < n) sched_yield();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    atomic_store(&go, 1);
    for (int i = 0; i < n; i++) pthread_join(threads[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < n; i++) sink += jobs[i].sum;
    double seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    double fmas = (double)n * (double)iterations * CHAINS * (width / 32);
    printf("%.6e\n", fmas / seconds);
    return 0;
}

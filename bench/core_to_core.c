/* Core-to-core round trip: two threads, each pinned to one of two CPUs, bounce one cache line. On the VM this was
 * written on, 50-150 ns when the two CPUs share an L3 and 300-400 ns when they do not; a VM's vCPUs can move between such
 * placements while it runs, and a shared-memory ring's speed moves with them (bench/placement.py).
 *
 *     core_to_core CPU_A CPU_B ROUNDS   -> prints the mean nanoseconds per round trip
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long rounds;
static int cpu_b;
/* the bounced line holds nothing else (rounds and cpu_b are read in the loops) */
static struct {
    _Alignas(64) _Atomic long value;
    char pad[64 - sizeof(long)];
} line;
#define flag line.value

/* a whole decimal argument in [lo, hi], or -1 ("abc" or "3x" is not 0 or 3) */
static long parse(const char *text, long lo, long hi) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    return (errno || end == text || *end || v < lo || v > hi) ? -1 : v;
}

static int pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *bounce(void *arg) {
    (void)arg;
    pin(cpu_b); /* checked in main */
    long n = rounds;
    for (long i = 0; i < n; i++) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {
        }
        atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: core_to_core CPU_A CPU_B ROUNDS\n");
        return 2;
    }
    int cpu_a = (int)parse(argv[1], 0, CPU_SETSIZE - 1);
    cpu_b = (int)parse(argv[2], 0, CPU_SETSIZE - 1);
    rounds = parse(argv[3], 1, 1L << 40);
    /* both CPUs are checked here: a thread that could not move would leave the other spinning forever */
    cpu_set_t allowed;
    if (rounds < 1 || cpu_a < 0 || cpu_b < 0 ||
        sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(cpu_a, &allowed) ||
        !CPU_ISSET(cpu_b, &allowed) || pin(cpu_a) != 0) {
        fprintf(stderr, "core_to_core: bad rounds, or cannot run on CPU %d or %d\n", cpu_a, cpu_b);
        return 2;
    }
    pthread_t other;
    if (pthread_create(&other, NULL, bounce, NULL) != 0)
        return 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long n = rounds;
    for (long i = 0; i < n; i++) {
        atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
        while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(other, NULL);
    printf("%.1f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / rounds);
    return 0;
}

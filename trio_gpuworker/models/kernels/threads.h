/* Fork/join threads for a kernel that tinygrad runs: the kernel is freestanding (no libc), so the host
   passes the addresses of pthread_create, pthread_join and sched_yield in a buffer (models/ckernel.py
   thread_table). A barrier spins briefly, then yields its core: the other thread may be descheduled
   (another process on the core), and a spinning waiter must not keep it from running. */
#ifndef TG_THREADS_H
#define TG_THREADS_H

#define MAXT 8  /* threads at most */
#define SPINS 2000

typedef int (*create_fn)(unsigned long *, const void *, void *(*)(void *), void *);
typedef int (*join_fn)(unsigned long, void **);
typedef int (*yield_fn)(void);

/* the host's table: the three functions, then the threads wanted */
typedef struct { create_fn create; join_fn join; yield_fn yield; long nthreads; } thread_table;

typedef struct { int count, sense; } barrier_t;

/* every one of n threads calls it; none returns before all have called it. sense: the caller's own flag */
static inline __attribute__((always_inline)) void barrier(barrier_t *b, int n, int *sense, yield_fn yield) {
  if (n == 1) return;
  int s = !*sense;
  *sense = s;
  if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == n) {
    __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->sense, s, __ATOMIC_RELEASE);
    return;
  }
  for (int i = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != s; i++) {
    if (i < SPINS) __builtin_ia32_pause();
    else yield();
  }
}
#endif

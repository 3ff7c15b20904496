/* Fork/join threads for a kernel that tinygrad runs, and the host's table of functions. The kernel is
   freestanding and must link nothing: tinygrad's loader would resolve a call to libc or libm as a 32-bit
   displacement from the kernel's pages, which is wrong (a jump to anywhere) once those pages land over 2 GiB
   from the library, as they do in a process with large mappings. So the host passes the addresses of
   pthread_create, pthread_join, sched_yield and expf in a buffer (models/ckernel.py host_table). A barrier
   spins briefly, then yields its core: the other thread may be descheduled (another process on the core),
   and a spinning waiter must not keep it from running. */
#ifndef TG_THREADS_H
#define TG_THREADS_H

#define MAXT 8  /* threads at most */
#define SPINS 2000

typedef int (*create_fn)(unsigned long *, const void *, void *(*)(void *), void *);
typedef int (*join_fn)(unsigned long, void **);
typedef int (*yield_fn)(void);
typedef float (*expf_fn)(float);

/* the host's table: its functions, then the threads wanted */
typedef struct { create_fn create; join_fn join; yield_fn yield; expf_fn expf; long nthreads; } host_table;

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

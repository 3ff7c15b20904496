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

/* A team: up to `most` threads (the host table's ask, at most MAXT) each run body(team, tid) on the team's job;
   thread 0 is the caller. The team's size must be known before anyone starts, so members wait for go. */
typedef struct team team_t;
struct team {
  const host_table *tt;
  void *job;
  void (*body)(team_t *tm, int tid);
  barrier_t bar;
  int nt, go;
};

typedef struct { team_t *tm; int tid; } member_t;

/* every member of the team calls it; none returns before all have (sense: the caller's own flag) */
static inline __attribute__((always_inline)) void team_sync(team_t *tm, int *sense) {
  barrier(&tm->bar, tm->nt, sense, tm->tt->yield);
}

static void *team_member(void *arg) {
  member_t *m = (member_t *)arg;
  while (!__atomic_load_n(&m->tm->go, __ATOMIC_ACQUIRE)) m->tm->tt->yield();
  m->tm->body(m->tm, m->tid);
  return 0;
}

static void team_run(const host_table *tt, int most, void (*body)(team_t *, int), void *job) {
  team_t tm = {tt, job, body, {0, 0}, 1, 0};
  int want = tt->nthreads < 1 ? 1 : tt->nthreads > most ? most : (int)tt->nthreads;
  unsigned long th[MAXT];
  member_t ms[MAXT];
  int started = 1;
  for (int t = 1; t < want && t < MAXT; t++) {
    ms[t] = (member_t){&tm, t};
    if (tt->create(&th[t], 0, team_member, &ms[t]) != 0) break;
    started++;
  }
  tm.nt = started;
  __atomic_store_n(&tm.go, 1, __ATOMIC_RELEASE);
  body(&tm, 0);
  for (int t = 1; t < started; t++) tt->join(th[t], 0);
}
#endif

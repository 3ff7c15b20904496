/* C11 atomics on raw shared-memory addresses for the ring header (docs/architecture.md, 'Ring header').
 *
 * The ring header lives in a memfd mapped by several processes, so every cursor and bit access
 * must be a real hardware atomic: a lock-based fallback would lock per process, not per word.
 * Cursor stores are release and loads acquire so payload bytes are visible before the cursor
 * that publishes them; the wake bit read-modify-writes are acq_rel so that "advance cursor, then
 * fetch_or" on one side and "fetch_and, then load cursor" on the other can never both miss.
 */
#ifndef CYTHON_RING_ATOMICS_H
#define CYTHON_RING_ATOMICS_H

#include <stdatomic.h>
#include <stdint.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring header ABI is little-endian and is accessed in place"
#endif
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "u64 atomics must be lock-free to work across processes");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "u32 atomics must be lock-free to work across processes");

#define CR_A64(p) ((_Atomic uint64_t *)(p))
#define CR_A32(p) ((_Atomic uint32_t *)(p))

static inline uint64_t cr_load_acquire_u64(void *p) { return atomic_load_explicit(CR_A64(p), memory_order_acquire); }
static inline uint64_t cr_load_relaxed_u64(void *p) { return atomic_load_explicit(CR_A64(p), memory_order_relaxed); }
static inline void cr_store_release_u64(void *p, uint64_t v) { atomic_store_explicit(CR_A64(p), v, memory_order_release); }
static inline uint64_t cr_fetch_or_u64(void *p, uint64_t v) { return atomic_fetch_or_explicit(CR_A64(p), v, memory_order_acq_rel); }
static inline uint64_t cr_fetch_and_u64(void *p, uint64_t v) { return atomic_fetch_and_explicit(CR_A64(p), v, memory_order_acq_rel); }

static inline uint32_t cr_load_acquire_u32(void *p) { return atomic_load_explicit(CR_A32(p), memory_order_acquire); }
static inline void cr_store_release_u32(void *p, uint32_t v) { atomic_store_explicit(CR_A32(p), v, memory_order_release); }
static inline uint32_t cr_fetch_or_u32(void *p, uint32_t v) { return atomic_fetch_or_explicit(CR_A32(p), v, memory_order_acq_rel); }
static inline uint32_t cr_fetch_and_u32(void *p, uint32_t v) { return atomic_fetch_and_explicit(CR_A32(p), v, memory_order_acq_rel); }

/* Returns 1 and stores `desired` only if the word held `expected`. */
static inline int cr_cas_u32(void *p, uint32_t expected, uint32_t desired) {
    return atomic_compare_exchange_strong_explicit(CR_A32(p), &expected, desired, memory_order_acq_rel,
                                                   memory_order_acquire);
}

#endif

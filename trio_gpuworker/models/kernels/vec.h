/* Vector types and helpers shared by the kernels (clang ext_vector_type; -march=native picks the ISA). */
#ifndef TG_VEC_H
#define TG_VEC_H
/* every helper is always_inline, so a vector argument never crosses a call boundary whatever the ISA */
#pragma clang diagnostic ignored "-Wpsabi"

typedef float v16 __attribute__((ext_vector_type(16), aligned(4)));
typedef float v8 __attribute__((ext_vector_type(8), aligned(4)));
typedef float v4 __attribute__((ext_vector_type(4)));
typedef unsigned char u16 __attribute__((ext_vector_type(16), aligned(1)));
typedef signed char s16 __attribute__((ext_vector_type(16), aligned(1)));
typedef int i16 __attribute__((ext_vector_type(16)));
typedef int i8 __attribute__((ext_vector_type(8)));
typedef unsigned char u8 __attribute__((ext_vector_type(8), aligned(1)));
typedef double v8d __attribute__((ext_vector_type(8), aligned(8)));
typedef long v8l __attribute__((ext_vector_type(8)));
#define INL static inline __attribute__((always_inline))
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

INL float hsum8(v8 a) { v4 c = a.lo + a.hi; return (c.x + c.y) + (c.z + c.w); }
INL float hsum(v16 a) { return hsum8(a.lo + a.hi); }
#endif

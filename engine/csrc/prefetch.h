
/* One cache line towards L1. Inline asm on x86: GCC drops __builtin_prefetch from loops it vectorizes,
   and a loop of nothing but prefetches is vectorized away. The address goes in as a register, not a memory
   operand: an "m" operand of a char tells GCC the asm may read any memory, so it stores every accumulator
   array that could alias it before each prefetch (measured: the bf16 product tile ran at half speed). */
static inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht0 (%0)" : : "r"(p));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

/* One cache line towards the last-level cache only (for data needed a little later). */
static inline void prefetch_line_llc(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht2 (%0)" : : "r"(p));
#else
    __builtin_prefetch(p, 0, 1);
#endif
}

/* What the CPU the kernels run on can do, asked once per process. Internal to kernels/cpu. */
#ifndef STRATA_KERNELS_CPU_FEATURES_H
#define STRATA_KERNELS_CPU_FEATURES_H

/* Nonzero when the x86 vector paths may run: AVX2 with FMA (the matmul tiles) and F16C (the
 * weight decoders). 0 on other CPUs and architectures, and when the environment variable
 * STRATA_KERNELS_PORTABLE is set (not "0"): the portable paths give the same bits, and the tests
 * check them that way on any machine. */
int kern_cpu_has_avx2(void);

#endif

/* The limit for batched CartPole stepping on this machine: a plain C loop doing the work of
 * msrl's cartpole_step kernel (gymnasium's dynamics in float64, float32 observations and final
 * observations, rewards, flags, episode tracking, same-step autoreset), parallelised over envs
 * with OpenMP, with no Python, no tensors and no launch in between.
 *
 *   gcc -O3 -fopenmp -ffp-contract=off bench/cartpole_loop.c -lm -o /tmp/cartpole_loop
 *   /tmp/cartpole_loop NUM_ENVS STEPS        -> prints env steps per second
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

static unsigned long long splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double uniform01(unsigned long long seed, unsigned long long env, unsigned long long ep, unsigned long long k) {
    return (double)(splitmix64(seed ^ splitmix64(env ^ splitmix64(ep * 4ULL + k))) >> 11) * (1.0 / 9007199254740992.0);
}

int main(int argc, char** argv) {
    int n = argc > 1 ? atoi(argv[1]) : 4096, steps = argc > 2 ? atoi(argv[2]) : 200;
    const double g = 9.8, mp = 0.1, tm = 1.1, len = 0.5, pml = 0.05, tau = 0.02;
    const double th = 12.0 * 2.0 * 3.141592653589793 / 360.0;
    double* st = malloc(sizeof(double) * 4 * n);
    int* t = calloc(n, sizeof(int));
    long long *ep = calloc(n, sizeof(long long)), *eplen = calloc(n, sizeof(long long)), *dlen = malloc(sizeof(long long) * n);
    double *epret = calloc(n, sizeof(double)), *dret = malloc(sizeof(double) * n);
    float *obs = malloc(sizeof(float) * 4 * n), *fobs = malloc(sizeof(float) * 4 * n), *rew = malloc(sizeof(float) * n);
    unsigned char *term = malloc(n), *trunc = malloc(n);
    long long* act = malloc(sizeof(long long) * 8 * n);
    for (long long i = 0; i < 8LL * n; ++i) act[i] = rand() & 1;
    for (int e = 0; e < n; ++e)
        for (int k = 0; k < 4; ++k) st[4 * e + k] = -0.05 + 0.1 * uniform01(0, e, 0, k);
    double t0 = omp_get_wtime();
    for (int s = 0; s < steps; ++s) {
        const long long* a = act + (long long)(s % 8) * n;
#pragma omp parallel for schedule(static)
        for (int e = 0; e < n; ++e) {
            double* x = st + 4 * e;
            double f = a[e] == 1 ? 10.0 : -10.0, c = cos(x[2]), sn = sin(x[2]);
            double tmp = (f + pml * (x[3] * x[3]) * sn) / tm;
            double tha = (g * sn - c * tmp) / (len * (4.0 / 3.0 - mp * (c * c) / tm));
            double xa = tmp - pml * tha * c / tm;
            x[0] += tau * x[1]; x[1] += tau * xa; x[2] += tau * x[3]; x[3] += tau * tha;
            int te = x[0] < -2.4 || x[0] > 2.4 || x[2] < -th || x[2] > th, tt = t[e] + 1, tr = tt >= 500, d = te || tr;
            rew[e] = 1.0f; term[e] = te; trunc[e] = tr;
            for (int k = 0; k < 4; ++k) fobs[4 * e + k] = (float)x[k];
            double r = epret[e] + 1.0; long long l = eplen[e] + 1;
            dret[e] = d ? r : 0.0; dlen[e] = d ? l : -1; epret[e] = d ? 0.0 : r; eplen[e] = d ? 0 : l;
            if (d) { ep[e] += 1; for (int k = 0; k < 4; ++k) x[k] = -0.05 + 0.1 * uniform01(0, e, ep[e], k); tt = 0; }
            t[e] = tt;
            for (int k = 0; k < 4; ++k) obs[4 * e + k] = (float)x[k];
        }
    }
    double dt = omp_get_wtime() - t0;
    double check = 0; for (int e = 0; e < n; ++e) check += obs[4 * e] + dret[e];
    printf("%.1f\n", (double)n * steps / dt);
    fprintf(stderr, "checksum %f threads %d\n", check, omp_get_max_threads());
    return 0;
}

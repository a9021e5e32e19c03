// msrl native Pendulum-v1: gymnasium's PendulumEnv (g = 10, m = l = 1, dt = 0.05, max speed 8,
// max torque 2) under TimeLimit(200), with same-step autoreset. One thread per env.
// Arithmetic follows gymnasium's NumPy 2 promotion exactly: the torque u is float32 and the
// terms computed from it alone (0.001 * u^2, 3 * u) stay float32; the state is float64.

#include "msrl_rng.cuh"

#define PD_G 10.0
#define PD_DT 0.05
#define PD_MAX_SPEED 8.0
#define PD_MAX_TORQUE 2.0f
#define PD_PI 3.141592653589793

__device__ __forceinline__ void pd_start(double* s, unsigned long long seed, unsigned long long env, unsigned long long episode) {
    s[0] = -PD_PI + 2.0 * PD_PI * msrl_uniform(seed + env, 0ULL, episode, 0ULL);  // theta ~ U[-pi, pi)
    s[1] = -1.0 + 2.0 * msrl_uniform(seed + env, 0ULL, episode, 1ULL);            // theta_dot ~ U[-1, 1)
}

__device__ __forceinline__ void pd_obs(const double* s, float* o) {
    o[0] = (float)cos(s[0]);
    o[1] = (float)sin(s[0]);
    o[2] = (float)s[1];
}

// state (N, 2) float64 (theta, theta_dot); steps (N,) int32; episode (N,) int64; obs (N, 3) float32.
extern "C" __global__ void pendulum_reset(double* __restrict__ state, int* __restrict__ steps, long long* __restrict__ episode,
                                          float* __restrict__ obs, unsigned long long seed, int num_envs) {
    int env = blockIdx.x * blockDim.x + threadIdx.x;
    if (env >= num_envs) return;
    episode[env] = 0;
    steps[env] = 0;
    pd_start(state + 2 * env, seed, (unsigned long long)env, 0ULL);
    pd_obs(state + 2 * env, obs + 3 * env);
}

// action (N, 1) float32 torque (clipped to [-2, 2]); reward (N,) float32 = -cost.
extern "C" __global__ void pendulum_step(double* __restrict__ state, int* __restrict__ steps, long long* __restrict__ episode,
                                         const float* __restrict__ action, float* __restrict__ obs,
                                         float* __restrict__ final_obs, float* __restrict__ reward,
                                         bool* __restrict__ terminated, bool* __restrict__ truncated,
                                         double* __restrict__ ep_return, long long* __restrict__ ep_length,
                                         double* __restrict__ done_return, long long* __restrict__ done_length,
                                         unsigned long long seed, int num_envs, int max_steps) {
    int env = blockIdx.x * blockDim.x + threadIdx.x;
    if (env >= num_envs) return;
    double* s = state + 2 * env;
    double th = s[0], thdot = s[1];
    float u = fminf(fmaxf(action[env], -PD_MAX_TORQUE), PD_MAX_TORQUE);
    double thn = msrl_remainder(th + PD_PI, 2.0 * PD_PI) - PD_PI;
    double cost = (thn * thn + 0.1 * (thdot * thdot)) + (double)(0.001f * (u * u));
    double newthdot = thdot + (3.0 * PD_G / 2.0 * sin(th) + (double)(3.0f * u)) * PD_DT;
    newthdot = fmin(fmax(newthdot, -PD_MAX_SPEED), PD_MAX_SPEED);
    s[0] = th + newthdot * PD_DT;
    s[1] = newthdot;
    int t = steps[env] + 1;
    bool trunc = t >= max_steps;
    float r = (float)(-cost);
    reward[env] = r;
    terminated[env] = false;
    truncated[env] = trunc;
    pd_obs(s, final_obs + 3 * env);
    long long ep = msrl_track_episode(env, (double)r, trunc, ep_return, ep_length, done_return, done_length, episode);
    if (ep >= 0) {
        pd_start(s, seed, (unsigned long long)env, (unsigned long long)ep);
        t = 0;
    }
    steps[env] = t;
    pd_obs(s, obs + 3 * env);
}

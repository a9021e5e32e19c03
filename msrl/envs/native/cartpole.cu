// msrl native CartPole-v1: gymnasium's CartPoleEnv (Euler integration, 12-degree / 2.4 limits,
// reward 1 per step) under TimeLimit(500), with same-step autoreset.
// One thread per env; env = blockIdx.x * blockDim.x + threadIdx.x. Sizes are arguments, so a
// new number of envs needs no recompilation. Compiled by NVRTC/nvcc for GPUs and, through
// msrl/envs/native/cuda_host_shim.h, by g++ for the CPU.

#include "msrl_rng.cuh"

#define CP_GRAVITY 9.8
#define CP_MASSCART 1.0
#define CP_MASSPOLE 0.1
#define CP_TOTAL_MASS (CP_MASSPOLE + CP_MASSCART)
#define CP_LENGTH 0.5
#define CP_POLEMASS_LENGTH (CP_MASSPOLE * CP_LENGTH)
#define CP_FORCE_MAG 10.0
#define CP_TAU 0.02
#define CP_THETA_THRESHOLD (12.0 * 2.0 * 3.141592653589793 / 360.0)
#define CP_X_THRESHOLD 2.4

__device__ __forceinline__ void cartpole_start(double* s, unsigned long long seed, unsigned long long env,
                                               unsigned long long episode) {
    for (int k = 0; k < 4; ++k) s[k] = -0.05 + 0.1 * msrl_uniform(seed + env, 0ULL, episode, (unsigned long long)k);
}

// state (N, 4) float64; steps (N,) int32; episode (N,) int64 (episodes started); obs (N, 4) float32.
extern "C" __global__ void cartpole_reset(double* __restrict__ state, int* __restrict__ steps, long long* __restrict__ episode, float* __restrict__ obs,
                                          unsigned long long seed, int num_envs) {
    int env = blockIdx.x * blockDim.x + threadIdx.x;
    if (env >= num_envs) return;
    double* s = state + 4 * env;
    episode[env] = 0;
    cartpole_start(s, seed, (unsigned long long)env, 0ULL);
    steps[env] = 0;
    for (int k = 0; k < 4; ++k) obs[4 * env + k] = (float)s[k];
}

// action (N,) int64 in {0, 1}; outputs obs/final_obs (N, 4) float32, reward (N,) float32,
// terminated/truncated (N,) bool. Episode tracking: ep_return (N,) float64 and ep_length (N,)
// int64 accumulate the running episode; done_return/done_length (N,) receive a finished
// episode's return and length (length -1 where none finished).
extern "C" __global__ void cartpole_step(double* __restrict__ state, int* __restrict__ steps, long long* __restrict__ episode, const long long* __restrict__ action,
                                         float* __restrict__ obs, float* __restrict__ final_obs, float* __restrict__ reward, bool* __restrict__ terminated,
                                         bool* __restrict__ truncated, double* __restrict__ ep_return, long long* __restrict__ ep_length,
                                         double* __restrict__ done_return, long long* __restrict__ done_length,
                                         unsigned long long seed, int num_envs, int max_steps) {
    int env = blockIdx.x * blockDim.x + threadIdx.x;
    if (env >= num_envs) return;
    double* s = state + 4 * env;
    double x = s[0], x_dot = s[1], theta = s[2], theta_dot = s[3];
    double force = action[env] == 1 ? CP_FORCE_MAG : -CP_FORCE_MAG;
    double costheta = cos(theta);
    double sintheta = sin(theta);
    double temp = (force + CP_POLEMASS_LENGTH * (theta_dot * theta_dot) * sintheta) / CP_TOTAL_MASS;
    double thetaacc = (CP_GRAVITY * sintheta - costheta * temp) /
                      (CP_LENGTH * (4.0 / 3.0 - CP_MASSPOLE * (costheta * costheta) / CP_TOTAL_MASS));
    double xacc = temp - CP_POLEMASS_LENGTH * thetaacc * costheta / CP_TOTAL_MASS;
    x = x + CP_TAU * x_dot;
    x_dot = x_dot + CP_TAU * xacc;
    theta = theta + CP_TAU * theta_dot;
    theta_dot = theta_dot + CP_TAU * thetaacc;
    s[0] = x; s[1] = x_dot; s[2] = theta; s[3] = theta_dot;
    bool term = x < -CP_X_THRESHOLD || x > CP_X_THRESHOLD || theta < -CP_THETA_THRESHOLD || theta > CP_THETA_THRESHOLD;
    int t = steps[env] + 1;
    bool trunc = t >= max_steps;  // TimeLimit: truncated may be set together with terminated
    reward[env] = 1.0f;
    terminated[env] = term;
    truncated[env] = trunc;
    for (int k = 0; k < 4; ++k) final_obs[4 * env + k] = (float)s[k];
    long long ep = msrl_track_episode(env, 1.0, term || trunc, ep_return, ep_length, done_return, done_length, episode);
    if (ep >= 0) {
        cartpole_start(s, seed, (unsigned long long)env, (unsigned long long)ep);
        t = 0;
    }
    steps[env] = t;
    for (int k = 0; k < 4; ++k) obs[4 * env + k] = (float)s[k];
}

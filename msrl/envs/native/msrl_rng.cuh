// Shared by msrl's native env kernels: a counter-based random number generator and NumPy's
// floored remainder, identical on the GPU (NVRTC/nvcc) and in the host build. The torch
// references mirror them in msrl/envs/native/base.py.
#pragma once

// splitmix64 (Steele, Lea, Flood 2014).
__device__ __forceinline__ unsigned long long msrl_splitmix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// U[0, 1) with 53 random bits from (key, stream, episode, k); k < 4 draws per episode. The key
// of env i is seed + i (as gymnasium seeds vector envs), so replicas holding slices of the envs
// draw what one process holding all of them would.
__device__ __forceinline__ double msrl_uniform(unsigned long long seed, unsigned long long stream,
                                               unsigned long long episode, unsigned long long k) {
    unsigned long long h = msrl_splitmix64(seed ^ msrl_splitmix64(stream ^ msrl_splitmix64(episode * 4ULL + k)));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

// U[0, 1) from (key, stream, episode, k) for any number of draws k per episode.
__device__ __forceinline__ double msrl_uniform_many(unsigned long long seed, unsigned long long stream,
                                                    unsigned long long episode, unsigned long long k) {
    unsigned long long h = msrl_splitmix64(seed ^ msrl_splitmix64(stream ^ msrl_splitmix64(msrl_splitmix64(episode) + k)));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

// Episode tracking of single-agent kernels: adds this step's reward to the running return and
// length of env `env`; when the episode ends, logs them in done_return/done_length (length -1
// where it goes on) and starts the next from zero. Returns the env's next episode count when it
// ended (the generator's episode counter), else -1.
__device__ __forceinline__ long long msrl_track_episode(int env, double reward, bool done, double* ep_return,
                                                        long long* ep_length, double* done_return,
                                                        long long* done_length, long long* episode) {
    double ret = ep_return[env] + reward;
    long long len = ep_length[env] + 1;
    done_return[env] = done ? ret : 0.0;
    done_length[env] = done ? len : -1;
    ep_return[env] = done ? 0.0 : ret;
    ep_length[env] = done ? 0 : len;
    if (!done) return -1;
    episode[env] += 1;
    return episode[env];
}

// NumPy's float remainder (npy_divmod): floored modulo built on fmod, in double and float.
__device__ __forceinline__ double msrl_remainder(double a, double b) {
    double mod = fmod(a, b);
    if (mod != 0.0) {
        if ((b < 0.0) != (mod < 0.0)) mod += b;
    } else {
        mod = copysign(0.0, b);
    }
    return mod;
}

__device__ __forceinline__ float msrl_remainderf(float a, float b) {
    float mod = fmodf(a, b);
    if (mod != 0.0f) {
        if ((b < 0.0f) != (mod < 0.0f)) mod += b;
    } else {
        mod = copysignf(0.0f, b);
    }
    return mod;
}

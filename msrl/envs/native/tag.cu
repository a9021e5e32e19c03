// msrl native Tag (continuous): WarpDrive's tag_continuous game, following the rules written out
// in shared/specs/tag_continuous.md (reference: WarpDrive's NumPy env). One block per env, one
// thread per agent (a thread-stride loop when agents outnumber threads). Phases that need every
// agent of the previous phase are separate kernels (a launch boundary is a grid-wide barrier),
// so the source needs no __syncthreads and runs unchanged through the host build.
//
// Arrays are (E, N) row-major for per-agent values (E envs, N agents), (E,) per env.
// Reductions written by several threads (a tagger's reward, the runner count) use atomicAdd.

#include "msrl_rng.cuh"

#define TG_PI 3.14159265358979f
#define TG_MAX_OBSERVED 64  // most other agents in a partial observation
#define TG_TWO_PI 6.28318530717959f
// Every kernel is launched with up to Tag.MAX_BLOCK = 1024 threads (one per agent): bounding the
// registers for that block size keeps a launch of ~300+ agents from failing for want of them
// (with CUPY_CUDA_COMPILE_WITH_DEBUG the observation kernel otherwise needs 226 registers).

// Per env: choose the taggers (Floyd's sampling of num_taggers ids out of N), list them, reset
// the clock and the runner count. One thread per env. only_done: reset only envs with done[e].
extern "C" __global__ void __launch_bounds__(1024) tag_reset_env(float* __restrict__ agent_type, int* __restrict__ tagger_ids, int* __restrict__ t,
                                         int* __restrict__ runners_left, long long* __restrict__ episode,
                                         const bool* __restrict__ done, int only_done, unsigned long long seed,
                                         int num_envs, int num_agents, int num_taggers) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= num_envs) return;
    if (only_done && !done[e]) return;
    long long ep = only_done ? episode[e] + 1 : 0;
    episode[e] = ep;
    float* type = agent_type + (long long)e * num_agents;
    for (int a = 0; a < num_agents; ++a) type[a] = 0.0f;
    int k = 0;
    for (int j = num_agents - num_taggers; j < num_agents; ++j, ++k) {
        int r = (int)(msrl_uniform_many(seed + (unsigned long long)e, 0ULL, (unsigned long long)ep, (unsigned long long)k) * (double)(j + 1));
        if (r > j) r = j;
        if (type[r] == 1.0f) r = j;
        type[r] = 1.0f;
    }
    // the taggers' ids in ascending order (tag_rewards scans them; ties go to the lowest id)
    int* ids = tagger_ids + (long long)e * num_taggers;
    for (int a = 0, m = 0; a < num_agents; ++a)
        if (type[a] == 1.0f) ids[m++] = a;
    t[e] = 0;
    runners_left[e] = num_agents - num_taggers;
}

// Per agent: start position U[0, L)^2, heading in {0, pi/2, pi, 3pi/2}, at rest, in the game.
extern "C" __global__ void __launch_bounds__(1024) tag_reset_agents(float* __restrict__ x, float* __restrict__ y, float* __restrict__ dir,
                                            float* __restrict__ speed, float* __restrict__ acc, float* __restrict__ in_game,
                                            const long long* __restrict__ episode, const bool* __restrict__ done,
                                            int only_done, unsigned long long seed, int num_envs, int num_agents,
                                            float grid_length) {
    int e = blockIdx.x;
    if (e >= num_envs) return;
    if (only_done && !done[e]) return;
    unsigned long long ep = (unsigned long long)episode[e];
    for (int a = threadIdx.x; a < num_agents; a += blockDim.x) {
        long long i = (long long)e * num_agents + a;
        unsigned long long key = seed + (unsigned long long)e, stream = 0x100000000ULL + (unsigned long long)a;
        x[i] = (float)(msrl_uniform_many(key, stream, ep, 0ULL) * (double)grid_length);
        y[i] = (float)(msrl_uniform_many(key, stream, ep, 1ULL) * (double)grid_length);
        dir[i] = (float)(int)(msrl_uniform_many(key, stream, ep, 2ULL) * 4.0) * (TG_PI / 2.0f);
        speed[i] = 0.0f;
        acc[i] = 0.0f;
        in_game[i] = 1.0f;
    }
}

// Per agent, steps 1-6 of the rules (and the env's clock, t += 1); writes each agent's reward so far (edge penalty + step
// term for agents in the game, 0 otherwise). action: (E, N, 2) int64 indices into the tables.
extern "C" __global__ void __launch_bounds__(1024) tag_dynamics(float* __restrict__ x, float* __restrict__ y, float* __restrict__ dir,
                                        float* __restrict__ speed, float* __restrict__ acc,
                                        const float* __restrict__ in_game, const float* __restrict__ agent_type,
                                        const long long* __restrict__ action, const float* __restrict__ acc_table,
                                        const float* __restrict__ turn_table, float* __restrict__ reward,
                                        int* __restrict__ t, int num_envs, int num_agents, float grid_length,
                                        float max_speed, float skill_tagger, float skill_runner, float edge_hit_penalty,
                                        float step_penalty_tagger, float step_reward_runner) {
    int e = blockIdx.x;
    if (e >= num_envs) return;
    if (threadIdx.x == 0) t[e] += 1;  // the clock first; no thread of this kernel reads it
    for (int a = threadIdx.x; a < num_agents; a += blockDim.x) {
        long long i = (long long)e * num_agents + a;
        float g = in_game[i];
        bool tagger = agent_type[i] == 1.0f;
        float d = msrl_remainderf(dir[i] + turn_table[action[2 * i + 1]], TG_TWO_PI) * g;
        float ac = acc[i] + acc_table[action[2 * i]];
        float max_i = max_speed * (tagger ? skill_tagger : skill_runner);
        float sp = fminf(fmaxf(speed[i] + ac, 0.0f), max_i) * g;
        ac = ac * (float)(sp > 0.0f) * (float)(sp < max_i);
        float nx = x[i] + sp * cosf(d);
        float ny = y[i] + sp * sinf(d);
        bool crossed = nx < 0.0f || nx > grid_length || ny < 0.0f || ny > grid_length;
        x[i] = fminf(fmaxf(nx, 0.0f), grid_length);
        y[i] = fminf(fmaxf(ny, 0.0f), grid_length);
        dir[i] = d;
        speed[i] = sp;
        acc[i] = ac;
        float r = (crossed ? edge_hit_penalty : 0.0f) + (tagger ? step_penalty_tagger : step_reward_runner);
        reward[i] = g != 0.0f ? r : 0.0f;
    }
}

// A sorted list of the K = M best (distance, id) pairs seen so far; pairs may arrive in any order.
struct TgNearest {
    float d[TG_MAX_OBSERVED], d2[TG_MAX_OBSERVED];
    int j[TG_MAX_OBSERVED];
    int count;
};

__device__ __forceinline__ void tg_consider(TgNearest& n, int M, int j, float d2) {
    // Squared distances reject most candidates without a sqrt: sqrt is monotonic, so d2 > the
    // K-th best's d2 means d >= its d (equal d: decided by id below, after the sqrt).
    if (n.count == M && d2 > n.d2[M - 1]) return;
    float dd = sqrtf(d2);
    if (n.count == M && !(dd < n.d[M - 1] || (dd == n.d[M - 1] && j < n.j[M - 1]))) return;
    int pos = n.count < M ? n.count : M - 1;
    while (pos > 0 && (dd < n.d[pos - 1] || (dd == n.d[pos - 1] && j < n.j[pos - 1]))) {
        n.d[pos] = n.d[pos - 1];
        n.d2[pos] = n.d2[pos - 1];
        n.j[pos] = n.j[pos - 1];
        --pos;
    }
    n.d[pos] = dd;
    n.d2[pos] = d2;
    n.j[pos] = j;
    if (n.count < M) ++n.count;
}

// The partial observation of agent a (global index i) into o: the K = M nearest in-game others,
// (distance, id) ascending. With a spatial grid (G x G cells of side cell_size, in-game agents
// bucketed by tag_grid_*), cells are scanned in rings around the agent's cell until no unseen
// agent can be nearer than the K-th found; without one, all agents are scanned.
__device__ __forceinline__ void tag_observe_nearest(const float* __restrict__ x, const float* __restrict__ y,
                                                    const float* __restrict__ dir, const float* __restrict__ speed,
                                                    const float* __restrict__ acc, const float* __restrict__ in_game,
                                                    const float* __restrict__ agent_type, float* __restrict__ o,
                                                    long long base, int a, long long i, int num_agents, int M,
                                                    float pos_scale, float vel_scale, float time_frac,
                                                    const int* __restrict__ cell_start, const int* __restrict__ cell_count,
                                                    const int* __restrict__ cell_agents, int G, float cell_size) {
    TgNearest n;
    n.count = 0;
    float xi = x[i], yi = y[i];
    if (G <= 0) {
        for (int j = 0; j < num_agents; ++j) {
            long long q = base + j;
            if (j == a || in_game[q] == 0.0f) continue;
            float dx = x[q] - xi, dy = y[q] - yi;
            tg_consider(n, M, j, dx * dx + dy * dy);
        }
    } else {
        long long cbase = (base / num_agents) * (long long)G * G;
        int cx = min((int)(xi / cell_size), G - 1), cy = min((int)(yi / cell_size), G - 1);
        for (int r = 0; r < G; ++r) {
            // an agent r rings away is at least r - 1 whole cells away (margin for rounding)
            if (n.count == M && r >= 2 && n.d[M - 1] < (float)(r - 1) * cell_size * 0.9999f) break;
            for (int gy = cy - r; gy <= cy + r; ++gy) {
                if (gy < 0 || gy >= G) continue;
                bool edge_row = gy == cy - r || gy == cy + r;
                for (int gx = cx - r; gx <= cx + r; gx += (edge_row || r == 0) ? 1 : 2 * r) {
                    if (gx < 0 || gx >= G) continue;
                    long long c = cbase + (long long)gy * G + gx;
                    for (int k = cell_start[c], end = cell_start[c] + cell_count[c]; k < end; ++k) {
                        int j = cell_agents[base + k];
                        if (j == a) continue;
                        long long q = base + j;
                        float dx = x[q] - xi, dy = y[q] - yi;
                        tg_consider(n, M, j, dx * dx + dy * dy);
                    }
                }
            }
        }
    }
    for (int m = 0; m < n.count; ++m) {
        long long q = base + n.j[m];
        o[0 * M + m] = (x[q] - x[i]) / pos_scale;
        o[1 * M + m] = (y[q] - y[i]) / pos_scale;
        o[2 * M + m] = (speed[q] - speed[i]) / vel_scale;
        o[3 * M + m] = (acc[q] - acc[i]) / vel_scale;
        o[4 * M + m] = (dir[q] - dir[i]) / TG_TWO_PI;
        o[5 * M + m] = agent_type[q];
        o[6 * M + m] = in_game[q];
    }
    o[7 * M] = time_frac;
}

// Spatial grid for partial observations, four phases. Clear: zero each env's cell counts.
extern "C" __global__ void __launch_bounds__(1024) tag_grid_clear(int* __restrict__ cell_count, int num_envs, int cells) {
    int e = blockIdx.x;
    if (e >= num_envs) return;
    for (int c = threadIdx.x; c < cells; c += blockDim.x) cell_count[(long long)e * cells + c] = 0;
}

// Count: each in-game agent's cell.
extern "C" __global__ void __launch_bounds__(1024) tag_grid_count(const float* __restrict__ x, const float* __restrict__ y,
                                          const float* __restrict__ in_game, int* __restrict__ cell_of,
                                          int* __restrict__ cell_count, int num_envs, int num_agents, int G,
                                          float cell_size) {
    int e = blockIdx.x;
    if (e >= num_envs) return;
    for (int a = threadIdx.x; a < num_agents; a += blockDim.x) {
        long long i = (long long)e * num_agents + a;
        if (in_game[i] == 0.0f) {
            cell_of[i] = -1;
            continue;
        }
        int cx = min((int)(x[i] / cell_size), G - 1), cy = min((int)(y[i] / cell_size), G - 1);
        cell_of[i] = cy * G + cx;
        atomicAdd(&cell_count[(long long)e * G * G + cy * G + cx], 1);
    }
}

// Scan (one thread per env): cell_start = exclusive prefix sum of cell_count; cursor = cell_start.
extern "C" __global__ void __launch_bounds__(1024) tag_grid_scan(const int* __restrict__ cell_count, int* __restrict__ cell_start,
                                         int* __restrict__ cursor, int num_envs, int cells) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= num_envs) return;
    long long b = (long long)e * cells;
    int total = 0;
    for (int c = 0; c < cells; ++c) {
        cell_start[b + c] = total;
        cursor[b + c] = total;
        total += cell_count[b + c];
    }
}

// Fill: each in-game agent takes a slot of its cell (slot order is free: the search orders by
// (distance, id) whatever the order it meets agents in).
extern "C" __global__ void __launch_bounds__(1024) tag_grid_fill(const int* __restrict__ cell_of, int* __restrict__ cursor,
                                         int* __restrict__ cell_agents, int num_envs, int num_agents, int cells) {
    int e = blockIdx.x;
    if (e >= num_envs) return;
    for (int a = threadIdx.x; a < num_agents; a += blockDim.x) {
        long long i = (long long)e * num_agents + a;
        int c = cell_of[i];
        if (c < 0) continue;
        int slot = atomicAdd(&cursor[(long long)e * cells + c], 1);
        cell_agents[(long long)e * num_agents + slot] = a;
    }
}

// Per agent: the observation (feature-major, 7M + 1 values) of step 7. full_observation: M = N-1
// others in id order; else the K nearest in-game others (ties by id), zero-padded. only_done:
// observe only agents of envs with done[e]. observe_self (msrl's extension, off in WarpDrive's
// rules) appends the agent's own x/L, y/L, speed, acceleration, cos/sin heading and type.
extern "C" __global__ void __launch_bounds__(1024) tag_observe(const float* __restrict__ x, const float* __restrict__ y,
                                       const float* __restrict__ dir, const float* __restrict__ speed,
                                       const float* __restrict__ acc, const float* __restrict__ in_game,
                                       const float* __restrict__ agent_type, const int* __restrict__ t,
                                       float* __restrict__ obs, const bool* __restrict__ done, int only_done,
                                       int num_envs, int num_agents, int full_observation, int num_observed,
                                       int observe_self, int episode_length, float grid_length, float max_speed,
                                       const int* __restrict__ cell_start, const int* __restrict__ cell_count,
                                       const int* __restrict__ cell_agents, int G, float cell_size) {
    int e = blockIdx.x;
    if (e >= num_envs) return;
    if (only_done && !done[e]) return;
    int M = full_observation ? num_agents - 1 : num_observed;
    int width = 7 * M + 1 + (observe_self ? 7 : 0);
    long long base = (long long)e * num_agents;
    float pos_scale = sqrtf(2.0f) * grid_length;
    float vel_scale = max_speed + 1e-10f;
    float time_frac = (float)t[e] / (float)episode_length;
    for (int a = threadIdx.x; a < num_agents; a += blockDim.x) {
        long long i = base + a;
        float* o = obs + i * width;
        bool self_in = in_game[i] != 0.0f;
        if (full_observation) {
            for (int m = 0, j = 0; j < num_agents; ++j) {
                if (j == a) continue;
                long long q = base + j;
                float live = self_in ? 1.0f : 0.0f;
                o[0 * M + m] = live * (x[q] - x[i]) / pos_scale;
                o[1 * M + m] = live * (y[q] - y[i]) / pos_scale;
                o[2 * M + m] = live * (speed[q] - speed[i]) / vel_scale;
                o[3 * M + m] = live * (acc[q] - acc[i]) / vel_scale;
                o[4 * M + m] = live * (dir[q] - dir[i]) / TG_TWO_PI;
                o[5 * M + m] = agent_type[q];
                o[6 * M + m] = in_game[q];
                ++m;
            }
            o[7 * M] = self_in ? time_frac : 0.0f;
        } else {
            for (int k = 0; k < width; ++k) o[k] = 0.0f;
            if (self_in && t[e] != 0)
                tag_observe_nearest(x, y, dir, speed, acc, in_game, agent_type, o, base, a, i, num_agents, M, pos_scale,
                                    vel_scale, time_frac, cell_start, cell_count, cell_agents, G, cell_size);
        }
        if (observe_self) {  // msrl's extension: the agent's own state (not in WarpDrive's rules)
            float* s = o + 7 * M + 1;
            float live = self_in ? 1.0f : 0.0f;
            s[0] = live * x[i] / grid_length;
            s[1] = live * y[i] / grid_length;
            s[2] = live * speed[i] / vel_scale;
            s[3] = live * acc[i] / vel_scale;
            s[4] = live * cosf(dir[i]);
            s[5] = live * sinf(dir[i]);
            s[6] = agent_type[i];
        }
    }
}



// Per in-game runner: its nearest tagger (lowest id on ties); a tag within tagging_distance * L
// penalises the runner, rewards that tagger (atomicAdd: several runners may be tagged by one
// tagger in one step), and takes the runner out of the game (runner count: atomicAdd). At
// t = T every runner still in the game gets the end-of-game reward.
extern "C" __global__ void __launch_bounds__(1024) tag_rewards(const float* __restrict__ x, const float* __restrict__ y,
                                       float* __restrict__ in_game, const float* __restrict__ agent_type,
                                       const int* __restrict__ tagger_ids, int num_taggers,
                                       float* __restrict__ reward, int* __restrict__ runners_left,
                                       const int* __restrict__ t, int num_envs, int num_agents, float grid_length,
                                       float tagging_distance, float tag_reward_tagger, float tag_penalty_runner,
                                       float end_of_game_reward_runner, int runner_exits, int episode_length) {
    int e = blockIdx.x;
    if (e >= num_envs) return;
    long long base = (long long)e * num_agents;
    for (int a = threadIdx.x; a < num_agents; a += blockDim.x) {
        long long i = base + a;
        if (agent_type[i] == 1.0f || in_game[i] == 0.0f) continue;
        float best_d = 0.0f;
        int best_j = -1;
        for (int k = 0; k < num_taggers; ++k) {
            int j = tagger_ids[(long long)e * num_taggers + k];
            long long q = base + j;
            float dx = x[q] - x[i], dy = y[q] - y[i];
            float dd = sqrtf(dx * dx + dy * dy);
            if (best_j < 0 || dd < best_d) {
                best_d = dd;
                best_j = j;
            }
        }
        bool tagged = best_j >= 0 && best_d < tagging_distance * grid_length;
        if (tagged) {
            reward[i] += tag_penalty_runner;
            atomicAdd(&reward[base + best_j], tag_reward_tagger);
            if (runner_exits) {
                in_game[i] = 0.0f;
                atomicAdd(&runners_left[e], -1);
            }
        }
        if (t[e] >= episode_length && in_game[i] != 0.0f) reward[i] += end_of_game_reward_runner;
    }
}

// Per env (one thread): the game ends when time is up or no runner is left; per-agent returns
// accumulate over the game, and a finished game logs its agents' returns and its length
// (done_length -1 where the game goes on).
extern "C" __global__ void __launch_bounds__(1024) tag_finish(const int* __restrict__ t, const int* __restrict__ runners_left,
                                      const float* __restrict__ reward, double* __restrict__ ep_return,
                                      long long* __restrict__ ep_length, bool* __restrict__ terminated,
                                      double* __restrict__ done_return, long long* __restrict__ done_length,
                                      int num_envs, int num_agents, int episode_length) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= num_envs) return;
    bool done = t[e] >= episode_length || runners_left[e] <= 0;
    terminated[e] = done;
    long long len = ep_length[e] + 1;
    done_length[e] = done ? len : -1;
    ep_length[e] = done ? 0 : len;
    for (int a = 0; a < num_agents; ++a) {
        long long i = (long long)e * num_agents + a;
        double r = ep_return[i] + (double)reward[i];
        done_return[i] = done ? r : 0.0;
        ep_return[i] = done ? 0.0 : r;
    }
}

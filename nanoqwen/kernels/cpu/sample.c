// The sampler's step on the CPU, one row at a time in C: what runtime/sampling/passes.py's
// TorchPasses computes in ~60 torch ops, 3.7 ms a row of 151,936 logits with the CLI's
// default settings (top-k 20, top-p 0.8, repetition penalty 1.05), mostly full-vocabulary
// passes for the Gumbel noise and the top-k.
//
// Per row: the processed logits z (penalties, min_tokens bans, temperature) with their max
// and argmax and the 64 (`candidates`) largest values in one pass; the filter threshold tau
// from those values as TorchPasses.thresholds reads it (the whole row where its boundary
// lies past them); then the Gumbel-max draw over the tokens z >= tau, with the noise of
// sampling/noise.py. The noise is at most G_MAX (u's largest value), so a token with
// z + G_MAX under a score already drawn cannot win and its noise is never computed: the
// same draw, over a few hundred tokens instead of the vocabulary.
//
// The sampling tables' column layout comes from kernels/sampling_layout.py at each call
// (`layout`), so it is written down once.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"

enum {
    F_TEMPERATURE, F_TOP_P, F_MIN_P, F_REPETITION, F_PRESENCE, F_FREQUENCY, NUM_F,
    I_TOP_K, I_MIN_TOKENS, I_SEED, I_FLAGS, NUM_I, FLAG_GREEDY, FLAG_BAN, LAYOUT_SIZE
};

// Bits of `options`: which of a step's passes the held slots need.
#define OPT_PENALTIES 1
#define OPT_BANS 2
#define OPT_SAMPLED 4    // a sampled row is held: z is divided by the temperature
#define OPT_FILTERING 8  // a row uses top-k, top-p or min-p: tau is computed
#define OPT_RECORD 16    // the tokens count as outputs of their slots

#define MAX_CANDIDATES 1024

#define G1 0x9E3779B97F4A7C15ull  // sampling/noise.py's constants
#define G32 0x9E3779B9u

static inline uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static inline uint32_t mix32(uint32_t x) {  // lowbias32
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

static inline uint32_t row_key(uint64_t seed, uint64_t pos) {
    const uint64_t key = mix64(seed + pos * G1);
    return (uint32_t)(key ^ (key >> 32));
}

static inline float gumbel_of(uint32_t bits) {
    float u = ((float)(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
    return -logf(-logf(u));
}

static inline float token_gumbel(uint32_t key, int64_t t) {
    return gumbel_of(mix32(key + (uint32_t)(t + 1) * G32));
}

// Argmax as torch takes it: the first maximum, a NaN counting as the maximum.
typedef struct {
    float value;
    int64_t index;
    int nan;
} Best;

static inline void consider(Best* b, float v, int64_t t) {
    if (b->nan) return;
    if (isnan(v)) {
        b->value = v, b->index = t, b->nan = 1;
    } else if (v > b->value) {
        b->value = v, b->index = t;
    }
}

// A min-heap of the `cap` largest values seen (heap[0] the smallest of them).
static inline void heap_push(float* heap, int64_t* size, int64_t cap, float v) {
    int64_t i;
    if (*size < cap) {
        i = (*size)++;
        while (i > 0 && heap[(i - 1) / 2] > v) heap[i] = heap[(i - 1) / 2], i = (i - 1) / 2;
        heap[i] = v;
        return;
    }
    if (!(v > heap[0])) return;
    i = 0;
    for (;;) {  // sift v down from the root
        int64_t c = 2 * i + 1;
        if (c >= cap) break;
        if (c + 1 < cap && heap[c + 1] < heap[c]) c++;
        if (!(heap[c] < v)) break;
        heap[i] = heap[c], i = c;
    }
    heap[i] = v;
}

static int descending(const void* a, const void* b) {
    float x = *(const float*)a, y = *(const float*)b;
    return (x < y) - (x > y);
}

// Moves the n largest of v[0..len) (no NaN) to its front, in no order: a quickselect.
static void select_largest(float* v, int64_t len, int64_t n) {
    int64_t lo = 0, hi = len - 1;
    while (lo < hi) {
        float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j], v[j--] = t;
            }
        }
        if (n - 1 <= j) hi = j;
        else if (n - 1 >= i) lo = i;
        else break;
    }
}

// The n largest of v[0..len) (no NaN) at its front, sorted, largest first.
static void largest_first(float* v, int64_t len, int64_t n) {
    select_largest(v, len, n);
    qsort(v, (size_t)n, sizeof(float), descending);
}

// How many of the sorted values, probabilities p_j = e_j / total, come before the top-p
// mass: max(1, #{j : cum_j - p_j < top_p}), the cumulative sum in double then float as
// torch's CPU cumsum. *last: the float cumulative sum at the end.
static int64_t nucleus(const float* values, int64_t n, float m, float cut, float total,
                       float top_p, float* last) {
    double cum = 0.0;
    int64_t kept = 0;
    float c = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        float e = values[j] >= cut ? expf(values[j] - m) : 0.0f;
        float p = e / total;
        cum += p;
        c = (float)cum;
        if (c - p < top_p) kept++;
    }
    *last = c;
    return kept > 1 ? kept : 1;
}

// Row `which` (0 or 1) of floats for this thread, kept between calls: a fresh 600 KB
// allocation a step is mapped and zeroed by the OS each time. NULL if out of memory.
static float* scratch(int which, int64_t V) {
    static __thread float* buffer[2] = {NULL, NULL};
    static __thread int64_t size[2] = {0, 0};
    if (size[which] < V) {
        free(buffer[which]);
        buffer[which] = malloc(sizeof(float) * (size_t)V);
        size[which] = buffer[which] ? V : 0;
    }
    return buffer[which];
}

// TorchPasses._whole_row_thresholds for one row: the top_k-th largest value (need & 1), and
// top-p's boundary over the values >= tau_k, renormalised (need & 2).
static int whole_row(const float* z, int64_t V, int need, int64_t top_k, float top_p,
                     float m, float* tau_k, float* tau_p) {
    float* v = scratch(1, V);
    if (!v) return 2;
    int64_t n = 0;
    if (need & 1) {
        for (int64_t t = 0; t < V; t++)
            if (!isnan(z[t])) v[n++] = z[t];
        if (top_k <= n) {
            select_largest(v, n, top_k);
            float kth = v[0];
            for (int64_t j = 1; j < top_k; j++) kth = v[j] < kth ? v[j] : kth;
            *tau_k = kth;
        }
    }
    if (need & 2) {
        n = 0;
        double total = 0.0;
        for (int64_t t = 0; t < V; t++) {
            if (z[t] >= *tau_k) {
                v[n++] = z[t];
                total += expf(z[t] - m);
            }
        }
        // Sorted prefixes of growing length, until one holds the boundary.
        for (int64_t len = 256; n > 0; len *= 4) {
            if (len > n) len = n;
            largest_first(v, n, len);
            float last;
            int64_t kept = nucleus(v, len, m, -INFINITY, (float)total, top_p, &last);
            if (kept < len || len == n) {
                *tau_p = v[kept - 1];
                break;
            }
        }
    }
    return 0;
}

// TorchPasses.thresholds for one row: the smallest processed logit that top-k, top-p and
// min-p keep, from the row's `cap` largest values (sorted, most likely first) and, where
// its boundary lies past them, from the whole row.
static int threshold(const float* z, int64_t V, float m, const float* values, int64_t cap,
                     int64_t top_k, float top_p, float min_p, float* tau) {
    int k_on = top_k < V, k_inside = k_on && top_k <= cap;
    int64_t k_at = top_k < 1 ? 1 : (top_k > cap ? cap : top_k);
    float tau_k = k_inside ? values[k_at - 1] : -INFINITY;
    int p_on = top_p < 1.0f;
    float tau_p = -INFINITY, last = 0.0f;
    if (p_on) {
        float total = 0.0f;
        if (k_inside) {
            double s = 0.0;
            for (int64_t j = 0; j < cap; j++) s += values[j] >= tau_k ? expf(values[j] - m) : 0.0f;
            total = (float)s;
        } else {
            double s = 0.0;
#pragma omp simd reduction(+ : s)
            for (int64_t t = 0; t < V; t++) s += exp_approx(z[t] - m);
            total = (float)s;
        }
        int64_t kept = nucleus(values, cap, m, tau_k, total, top_p, &last);
        tau_p = values[kept - 1];
    }
    int k_past = k_on && !k_inside;
    int tie_past = k_inside && values[cap - 1] >= tau_k && cap < V;
    int p_past = p_on && ((!k_on && last < top_p) || k_past || tie_past);
    int need = k_past | (p_past << 1);
    if (need && whole_row(z, V, need, top_k, top_p, m, &tau_k, &tau_p)) return 2;
    float tau_min = min_p > 0.0f ? m + logf(min_p) : -INFINITY;
    float larger = tau_k > tau_p ? tau_k : tau_p;
    *tau = larger > tau_min ? larger : tau_min;
    return 0;
}

static int one_row(const float* x, int64_t V, int64_t slot, const float* fparams,
                   const int64_t* iparams, int64_t* out_pos, const uint8_t* prompt_mask,
                   int32_t* counts, uint32_t* maybe_seen, const uint8_t* ban_mask,
                   const int64_t* L, int64_t options, int64_t candidates, float* z_out,
                   float* tau_out, int64_t* token) {
    const float* f = fparams + slot * L[NUM_F];
    const int64_t* iv = iparams + slot * L[NUM_I];
    const float temperature = f[L[F_TEMPERATURE]], rep = f[L[F_REPETITION]];
    const float presence = f[L[F_PRESENCE]], frequency = f[L[F_FREQUENCY]];
    const int penalties = (options & OPT_PENALTIES) != 0;
    const int banned = (options & OPT_BANS) && (iv[L[I_FLAGS]] & L[FLAG_BAN]) &&
                       out_pos[slot] < iv[L[I_MIN_TOKENS]];
    const int sampled = (options & OPT_SAMPLED) != 0, filtering = (options & OPT_FILTERING) != 0;
    const uint8_t* seen = prompt_mask + slot * V;
    const int32_t* count = counts + slot * V;
    const uint8_t* ban = ban_mask + slot * V;
    const int64_t cap = candidates < V ? candidates : V;
    // The same float operations as TorchPasses.prepare, so z is its z bit for bit; a row
    // nothing changes is read where it is (z == x) unless its z is asked for.
    const float* z = x;
    if (penalties || banned || sampled || z_out) {
        float* w = z_out ? z_out : scratch(0, V);
        if (!w) return 2;
#pragma omp simd
        for (int64_t t = 0; t < V; t++) {
            float v = x[t];
            if (penalties) {
                int32_t c = count[t];
                if (seen[t] || c > 0) v = v < 0.0f ? v * rep : v / rep;
                v = v - frequency * (float)c;
                v = v - presence * (float)(c > 0);
            }
            if (banned && ban[t]) v = -INFINITY;
            if (sampled) v = v / temperature;
            w[t] = v;
        }
        z = w;
    }
    // The max and torch's argmax (the first maximum; the first NaN if there is one).
    float top = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t t = 0; t < V; t++) {
        top = z[t] > top ? z[t] : top;
        nan |= isnan(z[t]);
    }
    Best best = {top, 0, 0};
    for (int64_t t = 0; t < V; t++) {
        if (nan ? isnan(z[t]) : z[t] == top) {
            best = (Best){z[t], t, nan};
            break;
        }
    }
    float heap[MAX_CANDIDATES];
    int64_t heap_size = 0;
    if (filtering)
        for (int64_t t = 0; t < V; t++)
            if (!isnan(z[t])) heap_push(heap, &heap_size, cap, z[t]);
    const float m = best.value;
    float tau = -INFINITY;
    if (filtering) {
        qsort(heap, (size_t)heap_size, sizeof(float), descending);
        for (int64_t j = heap_size; j < cap; j++) heap[j] = -INFINITY;  // NaN rows only
        if (threshold(z, V, m, heap, cap, iv[L[I_TOP_K]], f[L[F_TOP_P]], f[L[F_MIN_P]], &tau))
            return 2;
    }
    if (tau_out) *tau_out = tau;
    if (!token) return 0;
    if ((iv[L[I_FLAGS]] & L[FLAG_GREEDY]) || !sampled) {
        *token = best.index;
    } else {
        const uint32_t key = row_key((uint64_t)iv[L[I_SEED]], (uint64_t)out_pos[slot]);
        const float g_max = gumbel_of(~0u);
        // The winner scores at least what the argmax token (never filtered out: tau <= m)
        // draws, and at least the best score so far: a token below that by more than any
        // noise cannot win, nor tie.
        const float first = m + token_gumbel(key, best.index);
        Best draw = {-INFINITY, 0, 0};
        for (int64_t t = 0; t < V; t++) {
            float v = z[t] < tau ? -INFINITY : z[t];
            if (v + g_max < first || v + g_max < draw.value) continue;
            consider(&draw, v + token_gumbel(key, t), t);
        }
        *token = draw.index;
    }
    if (options & OPT_RECORD) {
        counts[slot * V + *token] += 1;
        maybe_seen[slot * ((V + 31) / 32) + (*token >> 5)] |= 1u << (*token & 31);
        out_pos[slot] += 1;
    }
    return 0;
}

// For each row r of logits [rows, V] (float32) and its sampler slot slots[r]: tau_out[r]
// (unless NULL) and z_out's row (unless NULL: scratch memory), and the sampled token
// tokens[r] (unless NULL), recorded in counts, maybe_seen and out_pos with OPT_RECORD.
// Returns 0, or nonzero for arguments it does not take.
int sample_rows(const float* logits, int64_t rows, int64_t V, const int64_t* slots,
                const float* fparams, const int64_t* iparams, int64_t* out_pos,
                const uint8_t* prompt_mask, int32_t* counts, uint32_t* maybe_seen,
                const uint8_t* ban_mask, const int64_t* layout, int64_t options,
                int64_t candidates, float* z_out, float* tau_out, int64_t* tokens, int threads) {
    if (candidates < 1 || candidates > MAX_CANDIDATES || V < 1) return 1;
    int failed = 0;
#pragma omp parallel for num_threads(rows > 1 ? threads : 1) schedule(dynamic) \
    reduction(| : failed)
    for (int64_t r = 0; r < rows; r++)
        failed |= one_row(logits + r * V, V, slots[r], fparams, iparams, out_pos, prompt_mask,
                          counts, maybe_seen, ban_mask, layout, options, candidates,
                          z_out ? z_out + r * V : NULL, tau_out ? tau_out + r : NULL,
                          tokens ? tokens + r : NULL);
    return failed;
}

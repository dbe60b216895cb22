#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep under -std=c11 */
/* ---------------------------------------------------------------- shared-memory collectives
 * All-reduce and all-gather among the tensor-parallel ranks of one host through a shared segment
 * (workers/shm_collectives.py maps it): gloo's TCP round trip costs about a millisecond per
 * collective here even for a few kilobytes, and a decode step makes two per layer.
 *
 * Segment: SHM_MAX_RANKS flags, one per 64-byte line, then two buffers of `world` slots of
 * slot_bytes each. Collective number `seq` (1, 2, ... in the same order on every rank) uses buffer
 * seq % 2: a rank copies its tensor into its slot, publishes flags[rank] = seq (release), waits
 * until every flag reaches seq (acquire), then reads every slot. A rank can only start collective
 * seq + 2 (same buffer) after seeing all flags at seq + 1, which each rank publishes only after it
 * has finished reading buffer seq: two buffers need no second barrier. Sums run in rank order, so
 * every rank gets bit-identical results. */


#include <sched.h>
#include <string.h>
#include <time.h>
#include "simd.h"

#define SHM_MAX_RANKS 64
#define SHM_FLAG_STRIDE 8 /* int64s: one flag per 64-byte cache line */
#define SHM_HEADER_BYTES (SHM_MAX_RANKS * SHM_FLAG_STRIDE * 8)

int64_t tern_shm_header_bytes(void) { return SHM_HEADER_BYTES; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Spin briefly (the peer is usually microseconds away), then yield, then sleep: a waiting rank
 * must not hold a core the engine or the other ranks need. Returns -1 after timeout_s. */
static int shm_wait_all(char *seg, int world, int64_t seq, double timeout_s) {
    volatile int64_t *flags = (volatile int64_t *)seg;
    double start = 0.0;
    for (int j = 0; j < world; j++) {
        int64_t polls = 0;
        while (__atomic_load_n(&flags[j * SHM_FLAG_STRIDE], __ATOMIC_ACQUIRE) < seq) {
            polls++;
            if (polls < 4096) {
#ifdef __AVX2__
                _mm_pause();
#endif
                continue;
            }
            if (start == 0.0) start = now_s();
            double waited = now_s() - start;
            if (waited > timeout_s) return -1;
            if (waited < 1e-3) {
                sched_yield();
            } else {
                struct timespec ts = {0, 20000};
                nanosleep(&ts, NULL);
            }
        }
    }
    return 0;
}

static char *shm_slot(char *seg, int world, int64_t seq, int64_t slot_bytes, int rank) {
    return seg + SHM_HEADER_BYTES + ((seq & 1) * world + rank) * slot_bytes;
}

static void shm_publish(char *seg, int rank, int64_t seq) {
    __atomic_store_n(&((int64_t *)seg)[rank * SHM_FLAG_STRIDE], seq, __ATOMIC_RELEASE);
}

/* x (n,) float32 (is_bf16 = 0) or bfloat16 (1), summed over the ranks in place. */
int tern_shm_all_reduce(char *seg, int rank, int world, int64_t seq, int64_t slot_bytes, void *x,
                        int64_t n, int is_bf16, double timeout_s) {
    int64_t nbytes = n * (is_bf16 ? 2 : 4);
    if (world > SHM_MAX_RANKS || nbytes > slot_bytes) return -2;
    memcpy(shm_slot(seg, world, seq, slot_bytes, rank), x, nbytes);
    shm_publish(seg, rank, seq);
    if (shm_wait_all(seg, world, seq, timeout_s) != 0) return -1;
    if (!is_bf16) {
        float *out = (float *)x;
        const float *s0 = (const float *)shm_slot(seg, world, seq, slot_bytes, 0);
        for (int64_t i = 0; i < n; i++) out[i] = s0[i];
        for (int j = 1; j < world; j++) {
            const float *sj = (const float *)shm_slot(seg, world, seq, slot_bytes, j);
            for (int64_t i = 0; i < n; i++) out[i] += sj[i];
        }
        return 0;
    }
    uint16_t *out = (uint16_t *)x;
    const uint16_t *slots[SHM_MAX_RANKS];
    for (int j = 0; j < world; j++)
        slots[j] = (const uint16_t *)shm_slot(seg, world, seq, slot_bytes, j);
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) { /* the sum in float32, rounded once: as the scalar loop below */
        __m256 acc = load8_bf16(slots[0] + i);
        for (int j = 1; j < world; j++) acc = _mm256_add_ps(acc, load8_bf16(slots[j] + i));
        store8_bf16(out + i, round8_bf16(acc));
    }
#endif
    for (; i < n; i++) {
        float acc = bf16_to_f32(slots[0][i]);
        for (int j = 1; j < world; j++) acc += bf16_to_f32(slots[j][i]);
        out[i] = f32_to_bf16(acc);
    }
    return 0;
}

/* Every rank's nbytes of x, in rank order, into out (world * nbytes). */
int tern_shm_all_gather(char *seg, int rank, int world, int64_t seq, int64_t slot_bytes,
                        const void *x, int64_t nbytes, void *out, double timeout_s) {
    if (world > SHM_MAX_RANKS || nbytes > slot_bytes) return -2;
    memcpy(shm_slot(seg, world, seq, slot_bytes, rank), x, nbytes);
    shm_publish(seg, rank, seq);
    if (shm_wait_all(seg, world, seq, timeout_s) != 0) return -1;
    for (int j = 0; j < world; j++)
        memcpy((char *)out + j * nbytes, shm_slot(seg, world, seq, slot_bytes, j), nbytes);
    return 0;
}

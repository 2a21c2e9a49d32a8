/* Scratch memory a thread keeps from one kernel call to the next.
 *
 * A batch-16 decode step of the default model made about 1,300 malloc/free pairs of 1-30 KB
 * (each linear layer's quantized rows, their AMX packing, each thread's unpacked Q4 blocks,
 * attention's scores), and glibc's bins took 3% of the samples under perf, all of it on the
 * thread that the other one waits for at the next barrier. A slot here is a buffer that grows
 * to the largest request and stays; one above SCRATCH_KEEP (a long prefill's) is given back to
 * the allocator when the call is done, so what stays is bounded per thread. Each thread has its
 * own slots (freed when it exits), and a slot is held by one call at a time: the callers are the
 * kernels in kernels.h's ScratchSlot list, none of which calls another that takes the same slot.
 * Only memory moves: what a kernel computes is unchanged.
 */
#include <pthread.h>
#include <stdlib.h>

#include "kernels.h"

#define SCRATCH_KEEP ((size_t)1 << 20) /* bytes a slot keeps after its call */

typedef struct {
    void *base;
    size_t bytes;
} Slot;

static pthread_key_t key;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int key_made;

static void slots_free(void *p) {
    Slot *slots = p;
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        free(slots[i].base);
    free(slots);
}

static void key_create(void) { key_made = pthread_key_create(&key, slots_free) == 0; }

static Slot *thread_slots(void) {
    pthread_once(&once, key_create);
    if (!key_made)
        return NULL;
    Slot *slots = pthread_getspecific(key);
    if (slots == NULL) {
        slots = calloc(SCRATCH_SLOTS, sizeof(Slot));
        if (slots != NULL && pthread_setspecific(key, slots) != 0) {
            free(slots);
            slots = NULL;
        }
    }
    return slots;
}

void *scratch_take(int slot, size_t bytes) {
    Slot *slots = thread_slots();
    if (slots == NULL)
        return NULL;
    Slot *s = &slots[slot];
    if (s->base != NULL && bytes <= s->bytes) /* (a first request of 0 bytes still gets a buffer) */
        return s->base;
    free(s->base);
    const size_t rounded = (bytes + 63) / 64 * 64;
    s->base = aligned_alloc(64, rounded > 0 ? rounded : 64);
    s->bytes = s->base != NULL ? rounded : 0;
    return s->base;
}

void scratch_give(int slot) {
    if (!key_made) /* no take made the key (every take in this thread ran pthread_once first) */
        return;
    Slot *slots = pthread_getspecific(key);
    if (slots == NULL || slots[slot].bytes <= SCRATCH_KEEP)
        return;
    free(slots[slot].base);
    slots[slot].base = NULL, slots[slot].bytes = 0;
}

/* netsim._hugearena: CPython's small-object arenas on transparent huge pages.
 *
 * A 10,000-peer simulation keeps several GB of small Python objects and
 * touches them in no useful order, one peer's state after another's: on
 * 4 KiB pages most of those touches also miss the TLB. pymalloc takes its
 * 1 MiB arenas from plain mmap calls, which the kernel backs with huge
 * pages only when transparent huge pages are set to "always" (Debian's
 * default is "madvise"). This module replaces the arena allocator
 * (PyObject_SetArenaAllocator) with one that carves arenas out of 64 MiB
 * regions aligned to 2 MiB and marked MADV_HUGEPAGE.
 *
 * An arena pymalloc gives back goes on a free list and is handed out again
 * (it is never unmapped: the simulation's heap only grows). Arenas the
 * previous allocator made are given back to it. Object contents, and so
 * the simulation's results, do not depend on where arenas lie.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sys/mman.h>

#define HUGE_PAGE ((size_t)2 << 20)
#define REGION ((size_t)64 << 20)

typedef struct {
    char *base;
    size_t used;
} region_t;

static PyObjectArenaAllocator previous;
static int enabled = 0;
static region_t *regions = NULL;
static size_t n_regions = 0, cap_regions = 0;
static size_t arena_size = 0; /* the size pymalloc asks for, learnt from its first call */
static void *free_list = NULL;
static size_t n_arenas = 0, n_reused = 0, n_huge_regions = 0;

static int owns(void *p) {
    char *c = (char *)p;
    for (size_t i = 0; i < n_regions; i++) {
        if (c >= regions[i].base && c < regions[i].base + REGION)
            return 1;
    }
    return 0;
}

static char *new_region(void) {
    size_t len = REGION + HUGE_PAGE;
    char *raw = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uintptr_t start = ((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    char *base = (char *)start;
    /* trim the unaligned head and tail */
    if (base > raw)
        munmap(raw, (size_t)(base - raw));
    char *end = base + REGION, *raw_end = raw + len;
    if (raw_end > end)
        munmap(end, (size_t)(raw_end - end));
#ifdef MADV_HUGEPAGE
    if (madvise(base, REGION, MADV_HUGEPAGE) == 0)
        n_huge_regions++;
#endif
    if (n_regions == cap_regions) {
        size_t cap = cap_regions ? 2 * cap_regions : 64;
        region_t *r = realloc(regions, cap * sizeof(region_t));
        if (r == NULL) {
            munmap(base, REGION);
            return NULL;
        }
        regions = r;
        cap_regions = cap;
    }
    regions[n_regions].base = base;
    regions[n_regions].used = 0;
    n_regions++;
    return base;
}

static void *arena_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (arena_size == 0 && size <= REGION && REGION % size == 0)
        arena_size = size;
    if (size != arena_size)
        return previous.alloc(previous.ctx, size);
    if (free_list != NULL) {
        void *p = free_list;
        free_list = *(void **)p;
        n_reused++;
        return p;
    }
    region_t *r = n_regions ? &regions[n_regions - 1] : NULL;
    if (r == NULL || r->used + size > REGION) {
        if (new_region() == NULL)
            return previous.alloc(previous.ctx, size);
        r = &regions[n_regions - 1];
    }
    void *p = r->base + r->used;
    r->used += size;
    n_arenas++;
    return p;
}

static void arena_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    if (ptr != NULL && size == arena_size && owns(ptr)) {
        *(void **)ptr = free_list;
        free_list = ptr;
        return;
    }
    previous.free(previous.ctx, ptr, size);
}

static PyObject *enable(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (!enabled) {
        PyObjectArenaAllocator mine = {NULL, arena_alloc, arena_free};
        PyObject_GetArenaAllocator(&previous);
        PyObject_SetArenaAllocator(&mine);
        enabled = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:i,s:n,s:n,s:n,s:n,s:n}", "enabled", enabled, "arena_size", (Py_ssize_t)arena_size,
                         "regions", (Py_ssize_t)n_regions, "huge_regions", (Py_ssize_t)n_huge_regions,
                         "arenas", (Py_ssize_t)n_arenas, "reused", (Py_ssize_t)n_reused);
}

static PyMethodDef methods[] = {
    {"enable", enable, METH_NOARGS,
     "Put pymalloc's arenas on 2 MiB-aligned MADV_HUGEPAGE regions from now on (once per process; never undone)."},
    {"stats", stats, METH_NOARGS, "Counters: regions mapped, arenas handed out and reused."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hugearena", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hugearena(void) { return PyModule_Create(&module); }

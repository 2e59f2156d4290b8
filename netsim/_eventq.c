/* netsim._eventq: the simulator's event heap, ordered by (time, sequence).
 *
 * netsim's loop kept its events in a heapq list of tuples
 * (time, seq, kind, a, b, c). Each comparison of two events went through
 * the tuples' rich comparison, to objects scattered over a heap of several
 * GB: at 10,000 peers heappop alone was about 5% of the run. Here the keys
 * lie in one array beside the payload, and a comparison reads two doubles
 * and, on a tie, two integers.
 *
 * The order is the tuples' order exactly: by time, then by the sequence
 * number, which the caller makes unique. Any correct heap of unique keys
 * pops the same sequence, so results do not change (netsim/eventq.py has
 * the pure-Python twin, used when this is not built, and the tests compare
 * the two).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    double t; /* the key: tobj's value */
    long long seq;
    PyObject *tobj, *kind, *a, *b, *c; /* strong references; tobj is handed back as pushed (an int stays one) */
} entry_t;

typedef struct {
    PyObject_HEAD
    entry_t *items;
    Py_ssize_t n, cap;
} EventQueue;

static inline int before(const entry_t *x, const entry_t *y) {
    return x->t < y->t || (x->t == y->t && x->seq < y->seq);
}

static PyObject *eq_push(EventQueue *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "push(t, seq, kind, a, b, c)");
        return NULL;
    }
    double t = PyFloat_AsDouble(args[0]);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    long long seq = PyLong_AsLongLong(args[1]);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    if (self->n == self->cap) {
        Py_ssize_t cap = self->cap ? 2 * self->cap : 1024;
        entry_t *grown = PyMem_Realloc(self->items, (size_t)cap * sizeof(entry_t));
        if (grown == NULL) return PyErr_NoMemory();
        self->items = grown;
        self->cap = cap;
    }
    entry_t e = {t, seq, Py_NewRef(args[0]), Py_NewRef(args[2]), Py_NewRef(args[3]), Py_NewRef(args[4]),
                 Py_NewRef(args[5])};
    /* sift up from the new leaf */
    Py_ssize_t i = self->n++;
    entry_t *h = self->items;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) >> 1;
        if (!before(&e, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = e;
    Py_RETURN_NONE;
}

static PyObject *eq_pop(EventQueue *self, PyObject *unused) {
    (void)unused;
    if (self->n == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty queue");
        return NULL;
    }
    PyObject *out = PyTuple_New(5);
    if (out == NULL) return NULL; /* the queue is unchanged */
    entry_t *h = self->items;
    entry_t top = h[0];
    entry_t last = h[--self->n];
    Py_ssize_t n = self->n, i = 0;
    /* sift the last entry down from the root */
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && before(&h[child + 1], &h[child])) child++;
        if (!before(&h[child], &last)) break;
        h[i] = h[child];
        i = child;
    }
    if (n > 0) h[i] = last;
    /* the tuple takes over the entry's references */
    PyTuple_SET_ITEM(out, 0, top.tobj);
    PyTuple_SET_ITEM(out, 1, top.kind);
    PyTuple_SET_ITEM(out, 2, top.a);
    PyTuple_SET_ITEM(out, 3, top.b);
    PyTuple_SET_ITEM(out, 4, top.c);
    return out;
}

static PyObject *eq_peek_time(EventQueue *self, PyObject *unused) {
    (void)unused;
    if (self->n == 0) {
        PyErr_SetString(PyExc_IndexError, "peek at an empty queue");
        return NULL;
    }
    return Py_NewRef(self->items[0].tobj);
}

static Py_ssize_t eq_len(EventQueue *self) { return self->n; }

static int eq_traverse(EventQueue *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Py_VISIT(self->items[i].tobj);
        Py_VISIT(self->items[i].kind);
        Py_VISIT(self->items[i].a);
        Py_VISIT(self->items[i].b);
        Py_VISIT(self->items[i].c);
    }
    return 0;
}

static int eq_clear(EventQueue *self) {
    entry_t *items = self->items;
    Py_ssize_t n = self->n;
    self->items = NULL;
    self->n = self->cap = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(items[i].tobj);
        Py_DECREF(items[i].kind);
        Py_DECREF(items[i].a);
        Py_DECREF(items[i].b);
        Py_DECREF(items[i].c);
    }
    PyMem_Free(items);
    return 0;
}

static void eq_dealloc(EventQueue *self) {
    PyObject_GC_UnTrack(self);
    eq_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *eq_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "EventQueue() takes no arguments");
        return NULL;
    }
    EventQueue *self = (EventQueue *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->items = NULL;
        self->n = self->cap = 0;
    }
    return (PyObject *)self;
}

static PyMethodDef eq_methods[] = {
    {"push", (PyCFunction)(void (*)(void))eq_push, METH_FASTCALL,
     "push(t, seq, kind, a, b, c): add an event; seq must be unique."},
    {"pop", (PyCFunction)eq_pop, METH_NOARGS, "Remove the first event by (t, seq); returns (t, kind, a, b, c), t as pushed."},
    {"peek_time", (PyCFunction)eq_peek_time, METH_NOARGS, "The first event's time, as pushed."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods eq_as_sequence = {.sq_length = (lenfunc)eq_len};

static PyTypeObject EventQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "netsim._native._eventq.EventQueue",
    .tp_basicsize = sizeof(EventQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A heap of events ordered by (time, sequence number).",
    .tp_new = eq_new,
    .tp_dealloc = (destructor)eq_dealloc,
    .tp_traverse = (traverseproc)eq_traverse,
    .tp_clear = (inquiry)eq_clear,
    .tp_methods = eq_methods,
    .tp_as_sequence = &eq_as_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_eventq", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__eventq(void) {
    if (PyType_Ready(&EventQueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "EventQueue", (PyObject *)&EventQueueType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

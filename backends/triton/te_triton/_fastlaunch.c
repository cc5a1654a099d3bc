/* The hot half of te_triton.launch in C: a launch's specialization key, its lookup, and the
 * kernel launch itself, for kernels Triton has already compiled and launched once.
 *
 * Python keeps everything else: binding the call (the generated launch function), the first
 * launch of a specialization (Triton compiles it, then launch.py registers a plan here), launch
 * hooks (a profiler's), and every kernel this file does not describe. See launch.py.
 *
 * Only the CPython API is used: no CUDA or torch headers. The CUDA driver's cuLaunchKernel is
 * looked up in libcuda.so.1 at the first launch, so importing this module needs no GPU.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 64

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shared, void *stream, void **params, void **extra);
typedef int (*error_string_fn)(int code, const char **text);
typedef int (*device_get_fn)(int *device, int ordinal);
typedef int (*ctx_retain_fn)(void **ctx, int device);
typedef int (*ctx_set_fn)(void *ctx);
typedef int (*ctx_get_fn)(void **ctx);

#define CUDA_ERROR_INVALID_CONTEXT 201

static launch_fn cu_launch = NULL;
static error_string_fn cu_error_string = NULL;
static device_get_fn cu_device_get = NULL;
static ctx_retain_fn cu_primary_ctx_retain = NULL;
static ctx_set_fn cu_ctx_set_current = NULL;
static ctx_get_fn cu_ctx_get_current = NULL;
static PyObject *tensor_type = NULL;  /* torch.Tensor, set by bind() */
static PyObject *float_marker = NULL; /* what a float argument enters the key as */
static PyObject *str_dtype = NULL, *str_data_ptr = NULL;

/* A registered specialization: what the launch needs besides the call's own arguments. */
typedef struct {
    void *function;
    unsigned threads, shared;
    Py_ssize_t n;                 /* the kernel's parameters, constexprs included */
    char kinds[MAX_PARAMS];       /* per parameter: how it is passed (see make_plan) */
    int trailing_nulls;           /* null pointers the compiler appends (scratch buffers) */
} plan_t;

static int load_driver(void) {
    if (cu_launch != NULL) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "te_triton fast launch: cannot open libcuda.so.1 (no NVIDIA driver)");
        return -1;
    }
    cu_launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
    cu_error_string = (error_string_fn)dlsym(lib, "cuGetErrorString");
    cu_device_get = (device_get_fn)dlsym(lib, "cuDeviceGet");
    cu_primary_ctx_retain = (ctx_retain_fn)dlsym(lib, "cuDevicePrimaryCtxRetain");
    cu_ctx_set_current = (ctx_set_fn)dlsym(lib, "cuCtxSetCurrent");
    cu_ctx_get_current = (ctx_get_fn)dlsym(lib, "cuCtxGetCurrent");
    if (cu_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "te_triton fast launch: libcuda.so.1 has no cuLaunchKernel");
        return -1;
    }
    return 0;
}

/* Makes GPU `ordinal`'s primary context (the one torch and Triton use) current on a thread that
 * has no current context; 0 on success, else the driver's error (a thread with a context of its
 * own keeps it). A thread has none until a CUDA call makes one, and autograd runs a backward on a
 * thread of its own, where the first CUDA work can be a repeated launch: Triton's launcher makes
 * the context current first, and so must this one. */
static int make_context_current(int ordinal) {
    if (cu_device_get == NULL || cu_primary_ctx_retain == NULL || cu_ctx_set_current == NULL ||
        cu_ctx_get_current == NULL)
        return CUDA_ERROR_INVALID_CONTEXT;
    int device = 0;
    void *ctx = NULL;
    int rc = cu_ctx_get_current(&ctx);
    if (rc != 0) return rc;
    if (ctx != NULL) return CUDA_ERROR_INVALID_CONTEXT;
    rc = cu_device_get(&device, ordinal);
    if (rc == 0) rc = cu_primary_ctx_retain(&ctx, device);
    if (rc == 0) rc = cu_ctx_set_current(ctx);
    return rc;
}

/* The key entry of one non-constexpr argument, as launch.py's Python key spells it: a tensor by
 * (dtype, 16-byte aligned); an int by (== 1, divisible by 16, fits int32, >= 2**63); a float by
 * the float marker; None and bools as they are. *ptr gets a tensor's data pointer. NULL with no
 * error set: a type without a rule (the caller falls back to Python). */
static PyObject *entry(PyObject *arg, unsigned long long *ptr) {
    PyTypeObject *type = Py_TYPE(arg);
    if (type == &PyLong_Type) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(arg, &overflow);
        if (overflow < 0) return NULL;  /* below int64: Triton's own path says what it thinks */
        int big = overflow > 0;         /* beyond int64: uint64 if it fits, Triton checks */
        unsigned long long u = big ? PyLong_AsUnsignedLongLong(arg) : (unsigned long long)v;
        if (big && PyErr_Occurred()) { PyErr_Clear(); return NULL; }
        int fits32 = !big && v >= INT32_MIN && v <= INT32_MAX;
        int high = big && u >= (1ULL << 63);
        *ptr = u;
        return PyTuple_Pack(4, (!big && v == 1) ? Py_True : Py_False, (u % 16 == 0) ? Py_True : Py_False,
                            fits32 ? Py_True : Py_False, high ? Py_True : Py_False);
    }
    if (arg == Py_None || type == &PyBool_Type) { Py_INCREF(arg); return arg; }
    if (type == &PyFloat_Type) { Py_INCREF(float_marker); return float_marker; }
    int is_tensor = PyObject_IsInstance(arg, tensor_type);
    if (is_tensor < 0) { PyErr_Clear(); return NULL; }
    if (!is_tensor) return NULL;
    PyObject *dtype = PyObject_GetAttr(arg, str_dtype);
    if (dtype == NULL) { PyErr_Clear(); return NULL; }
    PyObject *p = PyObject_CallMethodNoArgs(arg, str_data_ptr);
    if (p == NULL) { Py_DECREF(dtype); PyErr_Clear(); return NULL; }
    *ptr = PyLong_AsUnsignedLongLong(p);
    Py_DECREF(p);
    if (PyErr_Occurred()) { Py_DECREF(dtype); PyErr_Clear(); return NULL; }
    PyObject *out = PyTuple_Pack(2, dtype, (*ptr % 16 == 0) ? Py_True : Py_False);
    Py_DECREF(dtype);
    return out;
}

/* (device, options, entry of each argument): constexprs (mask byte 'c') by value. NULL with no
 * error: an argument without a rule. */
static PyObject *make_key(PyObject *mask, PyObject *device, PyObject *options, PyObject *args,
                          unsigned long long *ptrs) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    const char *m = PyBytes_AS_STRING(mask);
    if (n != PyBytes_GET_SIZE(mask) || n > MAX_PARAMS) return NULL;
    PyObject *key = PyTuple_New(n + 2);
    if (key == NULL) return NULL;
    Py_INCREF(device); PyTuple_SET_ITEM(key, 0, device);
    Py_INCREF(options); PyTuple_SET_ITEM(key, 1, options);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i), *e;
        ptrs[i] = 0;
        if (m[i] == 'c') { Py_INCREF(arg); e = arg; }
        else e = entry(arg, &ptrs[i]);
        if (e == NULL) { Py_DECREF(key); return NULL; }
        PyTuple_SET_ITEM(key, i + 2, e);
    }
    return key;
}

static PyObject *py_bind(PyObject *self, PyObject *args) {
    PyObject *t, *marker;
    if (!PyArg_ParseTuple(args, "OO", &t, &marker)) return NULL;
    Py_XINCREF(t); Py_XSETREF(tensor_type, t);
    Py_XINCREF(marker); Py_XSETREF(float_marker, marker);
    Py_RETURN_NONE;
}

/* key(mask, device, options, args) -> the key tuple, or None where an argument has no rule. */
static PyObject *py_key(PyObject *self, PyObject *args) {
    PyObject *mask, *device, *options, *call;
    unsigned long long ptrs[MAX_PARAMS];
    if (!PyArg_ParseTuple(args, "SOOO!", &mask, &device, &options, &PyTuple_Type, &call)) return NULL;
    if (tensor_type == NULL) { PyErr_SetString(PyExc_RuntimeError, "te_triton fast launch: bind() first"); return NULL; }
    PyObject *key = make_key(mask, device, options, call, ptrs);
    if (key == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return key;
}

static void free_plan(PyObject *capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, "te_triton.plan")); }

/* make_plan(function, num_warps, shared, kinds, trailing_nulls) -> a plan. kinds: one byte per
 * kernel parameter: 'p' a pointer (a tensor's data pointer), 'b'/'B' int8/uint8, 'h'/'H'
 * int16/uint16, 'i'/'I' int32/uint32, 'q'/'Q' int64/uint64, 'f' float32, 'd' float64, '-' not
 * passed (a constexpr or a specialized-away argument). */
static PyObject *py_make_plan(PyObject *self, PyObject *args) {
    unsigned long long function;
    unsigned warps, shared;
    int trailing;
    PyObject *kinds;
    if (!PyArg_ParseTuple(args, "KIISi", &function, &warps, &shared, &kinds, &trailing)) return NULL;
    Py_ssize_t n = PyBytes_GET_SIZE(kinds);
    if (n > MAX_PARAMS || trailing < 0 || trailing > 4 || warps == 0 || warps > 32) {
        PyErr_SetString(PyExc_ValueError, "te_triton fast launch: a plan needs at most 64 parameters, 0-4 trailing "
                                          "nulls and 1-32 warps");
        return NULL;
    }
    const char *k = PyBytes_AS_STRING(kinds);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!strchr("pbBhHiIqQfd-", k[i]) || k[i] == 0) {
            PyErr_Format(PyExc_ValueError, "te_triton fast launch: unknown parameter kind %c", k[i]);
            return NULL;
        }
    }
    plan_t *plan = PyMem_Calloc(1, sizeof(plan_t));
    if (plan == NULL) return PyErr_NoMemory();
    plan->function = (void *)(uintptr_t)function;
    plan->threads = 32 * warps;
    plan->shared = shared;
    plan->n = n;
    memcpy(plan->kinds, k, n);
    plan->trailing_nulls = trailing;
    PyObject *capsule = PyCapsule_New(plan, "te_triton.plan", free_plan);
    if (capsule == NULL) PyMem_Free(plan);
    return capsule;
}

typedef union { int8_t b; uint8_t B; int16_t h; uint16_t H; int32_t i; uint32_t I; int64_t q; uint64_t Q;
                float f; double d; unsigned long long p; } slot_t;

/* Pack the arguments by the plan into slots; -1 with an error set where one does not convert. */
static int pack(const plan_t *plan, PyObject *call, const unsigned long long *ptrs, slot_t *slots, void **params,
                int *count) {
    int c = 0;
    for (Py_ssize_t i = 0; i < plan->n; i++) {
        PyObject *a = PyTuple_GET_ITEM(call, i);
        slot_t *s = &slots[c];
        switch (plan->kinds[i]) {
            case '-': continue;
            case 'p': s->p = ptrs[i]; break;
            case 'f': s->f = (float)PyFloat_AsDouble(a); break;
            case 'd': s->d = PyFloat_AsDouble(a); break;
            case 'Q': s->Q = (uint64_t)PyLong_AsUnsignedLongLong(a); break;
            default: {
                long long v = PyLong_AsLongLong(a);
                switch (plan->kinds[i]) {
                    case 'b': s->b = (int8_t)v; break;
                    case 'B': s->B = (uint8_t)v; break;
                    case 'h': s->h = (int16_t)v; break;
                    case 'H': s->H = (uint16_t)v; break;
                    case 'i': s->i = (int32_t)v; break;
                    case 'I': s->I = (uint32_t)v; break;
                    default: s->q = (int64_t)v; break;
                }
            }
        }
        if (PyErr_Occurred()) return -1;
        params[c] = s;
        c++;
    }
    for (int t = 0; t < plan->trailing_nulls; t++) {
        slots[c].p = 0;
        params[c] = &slots[c];
        c++;
    }
    *count = c;
    return 0;
}

/* launch(table, mask, device, options, grid, stream, args) -> the registered compiled kernel
 * after launching it, or None where nothing is registered under this call's key (or an argument
 * has no rule): the caller then takes Python's path. table maps keys to (plan, compiled). */
static PyObject *py_launch(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 7) { PyErr_SetString(PyExc_TypeError, "launch() takes 7 arguments"); return NULL; }
    PyObject *table = argv[0], *mask = argv[1], *device = argv[2], *options = argv[3], *grid = argv[4],
             *stream = argv[5], *call = argv[6];
    if (!PyDict_Check(table) || !PyBytes_Check(mask) || !PyTuple_Check(grid) || !PyTuple_Check(call)) {
        PyErr_SetString(PyExc_TypeError, "launch(table: dict, mask: bytes, device, options, grid: tuple, stream, "
                                         "args: tuple)");
        return NULL;
    }
    if (tensor_type == NULL) { PyErr_SetString(PyExc_RuntimeError, "te_triton fast launch: bind() first"); return NULL; }
    unsigned long long ptrs[MAX_PARAMS];
    PyObject *key = make_key(mask, device, options, call, ptrs);
    if (key == NULL) { if (PyErr_Occurred()) return NULL; Py_RETURN_NONE; }
    PyObject *entry_ = PyDict_GetItemWithError(table, key);  /* borrowed */
    Py_DECREF(key);
    if (entry_ == NULL) {
        if (PyErr_Occurred()) {  /* an unhashable constexpr: Python's path decides */
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
            PyErr_Clear();
        }
        Py_RETURN_NONE;
    }
    const plan_t *plan = PyCapsule_GetPointer(PyTuple_GET_ITEM(entry_, 0), "te_triton.plan");
    if (plan == NULL) return NULL;
    if (plan->n != PyTuple_GET_SIZE(call)) {
        PyErr_SetString(PyExc_RuntimeError, "te_triton fast launch: a plan registered for another kernel");
        return NULL;
    }
    Py_ssize_t g = PyTuple_GET_SIZE(grid);
    unsigned long long dims[3] = {1, 1, 1};
    if (g < 1 || g > 3) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < g; i++) {
        dims[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(grid, i));
        if (PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_NONE; }  /* a negative or odd grid: Triton says */
        if (dims[i] > 0x7fffffffULL) Py_RETURN_NONE;
    }
    void *stream_ptr = PyLong_AsVoidPtr(stream);
    if (PyErr_Occurred()) return NULL;
    slot_t slots[MAX_PARAMS + 4];
    void *params[MAX_PARAMS + 4];
    int count = 0;
    if (pack(plan, call, ptrs, slots, params, &count) < 0) return NULL;
    PyObject *compiled = PyTuple_GET_ITEM(entry_, 1);
    Py_INCREF(compiled);
    if (dims[0] * dims[1] * dims[2] == 0) return compiled;  /* as Triton: an empty grid launches nothing */
    if (load_driver() < 0) { Py_DECREF(compiled); return NULL; }
    /* the plan's own copy: another thread may replace the table's entry while the GIL is released */
    void *function = plan->function;
    unsigned threads = plan->threads, shared = plan->shared;
    /* the device the launch is for (the key's first entry): whose context to make current if the
     * thread has none; the launch is tried first, so the usual call pays nothing for this */
    long ordinal = PyLong_Check(device) ? PyLong_AsLong(device) : -1;
    if (ordinal < 0 && PyErr_Occurred()) PyErr_Clear();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cu_launch(function, (unsigned)dims[0], (unsigned)dims[1], (unsigned)dims[2], threads, 1, 1, shared,
                   stream_ptr, params, NULL);
    if (rc == CUDA_ERROR_INVALID_CONTEXT && ordinal >= 0 && make_context_current((int)ordinal) == 0)
        rc = cu_launch(function, (unsigned)dims[0], (unsigned)dims[1], (unsigned)dims[2], threads, 1, 1, shared,
                       stream_ptr, params, NULL);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        const char *text = NULL;
        if (cu_error_string != NULL) cu_error_string(rc, &text);
        PyErr_Format(PyExc_RuntimeError, "te_triton fast launch: cuLaunchKernel failed with CUDA error %d (%s)", rc,
                     text ? text : "unknown");
        Py_DECREF(compiled);
        return NULL;
    }
    return compiled;
}

/* pack_for_test(plan, args, ptrs) -> (bytes of each passed parameter, in order): what a launch
 * would hand the driver, for the tests on machines without a GPU. */
static PyObject *py_pack_for_test(PyObject *self, PyObject *args) {
    PyObject *capsule, *call, *ptr_list;
    if (!PyArg_ParseTuple(args, "OO!O!", &capsule, &PyTuple_Type, &call, &PyList_Type, &ptr_list)) return NULL;
    const plan_t *plan = PyCapsule_GetPointer(capsule, "te_triton.plan");
    if (plan == NULL) return NULL;
    if (plan->n != PyTuple_GET_SIZE(call) || PyList_GET_SIZE(ptr_list) != plan->n) {
        PyErr_SetString(PyExc_ValueError, "pack_for_test: one argument and one pointer per parameter");
        return NULL;
    }
    unsigned long long ptrs[MAX_PARAMS];
    for (Py_ssize_t i = 0; i < plan->n; i++) {
        ptrs[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(ptr_list, i));
        if (PyErr_Occurred()) return NULL;
    }
    slot_t slots[MAX_PARAMS + 4];
    void *params[MAX_PARAMS + 4];
    int count = 0;
    if (pack(plan, call, ptrs, slots, params, &count) < 0) return NULL;
    PyObject *out = PyTuple_New(count);
    if (out == NULL) return NULL;
    int c = 0;
    for (Py_ssize_t i = 0; i < plan->n + plan->trailing_nulls; i++) {
        char kind = i < plan->n ? plan->kinds[i] : 'p';
        if (kind == '-') continue;
        Py_ssize_t size = strchr("bB", kind) ? 1 : strchr("hH", kind) ? 2 : strchr("iIf", kind) ? 4 : 8;
        PyObject *b = PyBytes_FromStringAndSize((const char *)params[c], size);
        if (b == NULL) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, c, b);
        c++;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"bind", py_bind, METH_VARARGS, "bind(tensor_type, float_marker): the types the key tells apart"},
    {"key", py_key, METH_VARARGS, "key(mask, device, options, args) -> the call's key, or None"},
    {"make_plan", py_make_plan, METH_VARARGS, "make_plan(function, num_warps, shared, kinds, trailing_nulls)"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL,
     "launch(table, mask, device, options, grid, stream, args) -> compiled kernel, or None"},
    {"pack_for_test", py_pack_for_test, METH_VARARGS, "pack_for_test(plan, args, ptrs) -> parameter bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastlaunch(void) {
    str_dtype = PyUnicode_InternFromString("dtype");
    str_data_ptr = PyUnicode_InternFromString("data_ptr");
    if (str_dtype == NULL || str_data_ptr == NULL) return NULL;
    return PyModule_Create(&module);
}

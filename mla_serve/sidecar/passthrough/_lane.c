/* The per-read path of a token stream, in C: no Python frame for a read of vLLM's socket
 * that carries token chunks only.
 *
 * An accelerator of the pass-through's one classifier (classify.TokenShape). A `Lane` is an
 * upstream connection's `data_received`. Unarmed, every read goes to the connection's Python
 * method (`fallback`). Armed with a stream's token shape (its head bytes, the keys of its one
 * string field, its tail bytes), a read that is 1..MAX_FRAMES whole chunks of HTTP/1.1
 * chunked coding (canonical: lowercase hex size, no extension), each a token chunk of that
 * shape, is taken here: the read is written to the client as vLLM framed it (the `write` the
 * lane was given), and what the Python path would have done with its tokens is kept on this
 * object until the exchange collects it (`drain`): how many token chunks, whether one had
 * visible text, and, when a channel is watched by the runaway guard, their texts (decoded as
 * json.loads decodes a string). Where those texts reach `budget` characters, the point where
 * the guard's detector must look, the lane writes the read up to that token and calls
 * `check`, the exchange's checkpoint (it collects what the lane kept and lets the guard
 * look, as the Python path would after that token): it answers the next budget, or 0 when
 * the Python path takes the stream from the next token on (the rest of the read is handed
 * to it). Anything else (a partial chunk, another event, an escape JSON refuses, bytes
 * that are not UTF-8, another channel) is not touched: the lane disarms and hands the read to the Python path, which collects what the
 * lane kept first. The lane reads and writes nothing but its own fields and the three
 * callables it was given.
 * The stable ABI (3.11): one build serves every CPython from 3.11 on.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_FRAMES 64
#define MAX_KEYS 4

typedef struct {
    PyObject_HEAD
    PyObject *fallback;              /* the connection's Python data_received */
    int armed;
    /* the shape it was armed with */
    PyObject *head;                  /* bytes */
    PyObject *tail;                  /* bytes */
    Py_ssize_t nkeys;
    PyObject *keys[MAX_KEYS];        /* bytes: the field's name through the opening quote */
    int visible[MAX_KEYS];           /* whether the key's text is visible content */
    int allowed[MAX_KEYS];           /* the key's channel is taken here */
    int keep_texts;                  /* a channel is watched: texts kept, budget counted */
    Py_ssize_t budget;               /* characters of text left before the detector looks */
    PyObject *write;                 /* the client transport's write */
    PyObject *clock;                 /* the event loop's time */
    PyObject *check;                 /* the exchange's checkpoint at the budget (kept texts) */
    /* what was taken since the last drain */
    Py_ssize_t tokens;
    int saw_visible;
    PyObject *texts;                 /* list of str, or NULL */
    double last_read;
} Lane;

typedef struct {
    Py_ssize_t start, size;  /* the chunk's payload in the read */
    Py_ssize_t end;          /* where its frame ends in the read */
    int shown;               /* its text is the stream's first visible text */
    Py_ssize_t key;          /* which key */
    PyObject *text;          /* the decoded string, when needed; else NULL */
    Py_ssize_t chars;
} Token;

static PyObject *s_isspace, *s_quote;
static PyObject *scanstring;      /* _json.scanstring (json.decoder's, when built) or NULL */
static unsigned long long taken;  /* reads done in C, every lane of the process */

static int at(const char *p, Py_ssize_t n, Py_ssize_t i, const char *lit, Py_ssize_t len)
{
    return i + len <= n && memcmp(p + i, lit, (size_t)len) == 0;
}

/* One chunk at `*pos`: its payload's start and size; 0 when the bytes there are not one whole
 * canonical chunk of data (a size of 0, the last chunk, is not one). */
static int frame_at(const char *p, Py_ssize_t n, Py_ssize_t *pos, Py_ssize_t *start, Py_ssize_t *size)
{
    Py_ssize_t i = *pos, value = 0, digits = 0;
    while (i < n) {
        char c = p[i];
        int d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else
            break;
        if (digits == 0 && d == 0)
            return 0;
        if (++digits > 12)
            return 0;
        value = value * 16 + d;
        i++;
    }
    if (digits == 0 || !at(p, n, i, "\r\n", 2))
        return 0;
    i += 2;
    if (value > n - i - 2 || !at(p, n, i + value, "\r\n", 2))
        return 0;
    *start = i;
    *size = value;
    *pos = i + value + 2;
    return 1;
}

/* JSON's string grammar from `i`: the index of the closing quote, or -1; whether it holds
 * an escape, and a byte outside ASCII. */
static Py_ssize_t string_end(const char *p, Py_ssize_t n, Py_ssize_t i, int *escaped, int *high)
{
    static const char HEX[] = "0123456789abcdefABCDEF";
    *escaped = *high = 0;
    for (;;) {
        if (i >= n)
            return -1;
        unsigned char c = (unsigned char)p[i];
        if (c == '"')
            return i;
        if (c < 0x20)
            return -1;
        if (c != '\\') {
            *high |= c >= 0x80;
            i++;
            continue;
        }
        *escaped = 1;
        if (i + 1 >= n)
            return -1;
        c = (unsigned char)p[i + 1];
        if (c != 0 && strchr("\"\\/bfnrt", c) != NULL) {
            i += 2;
        } else if (c == 'u') {
            if (i + 6 > n)
                return -1;
            for (int k = 2; k < 6; k++)
                if (p[i + k] == 0 || strchr(HEX, p[i + k]) == NULL)
                    return -1;
            i += 6;
        } else {
            return -1;
        }
    }
}

/* The string as json.loads decodes it; NULL with no error set when the Python path must
 * decide (not UTF-8, or no C scanner for an escape). */
static PyObject *decode(const char *p, Py_ssize_t size, int escaped)
{
    PyObject *text = PyUnicode_DecodeUTF8(p, size, "surrogatepass");
    if (text == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear();
        return NULL;
    }
    if (!escaped)
        return text;
    if (scanstring == NULL) {
        Py_DECREF(text);
        return NULL;
    }
    PyObject *quoted = PyUnicode_Concat(text, s_quote);
    Py_DECREF(text);
    if (quoted == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    PyObject *pair = zero ? PyObject_CallFunctionObjArgs(scanstring, quoted, zero, NULL) : NULL;
    Py_XDECREF(zero);
    Py_DECREF(quoted);
    if (pair == NULL) {
        if (PyErr_ExceptionMatches(PyExc_ValueError))
            PyErr_Clear();
        return NULL;
    }
    PyObject *result = PyTuple_GetItem(pair, 0);
    Py_XINCREF(result);
    Py_DECREF(pair);
    return result;
}

/* 1 when `text` is all whitespace (str.isspace, or empty), 0 if not, -1 error. */
static int blank(PyObject *text)
{
    if (PyUnicode_GetLength(text) == 0)
        return 1;
    PyObject *space = PyObject_CallMethodObjArgs(text, s_isspace, NULL);
    if (space == NULL)
        return -1;
    int r = PyObject_IsTrue(space);
    Py_DECREF(space);
    return r;
}

static void lane_disarm(Lane *self)
{
    self->armed = 0;
    Py_CLEAR(self->head);
    Py_CLEAR(self->tail);
    for (Py_ssize_t k = 0; k < self->nkeys; k++)
        Py_CLEAR(self->keys[k]);
    self->nkeys = 0;
    Py_CLEAR(self->write);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->check);
}

/* One payload: a token chunk of the shape, its key and (when needed) its text: 1, 0, -1. */
static int token_at(Lane *self, const char *q, Py_ssize_t size, Token *t, int need_visible)
{
    char *head, *tail;
    Py_ssize_t hlen, tlen;
    if (PyBytes_AsStringAndSize(self->head, &head, &hlen) < 0
        || PyBytes_AsStringAndSize(self->tail, &tail, &tlen) < 0)
        return -1;
    if (size < hlen || memcmp(q, head, (size_t)hlen) != 0)
        return 0;
    Py_ssize_t i = hlen, k;
    for (k = 0; k < self->nkeys; k++) {
        char *key;
        Py_ssize_t klen;
        if (PyBytes_AsStringAndSize(self->keys[k], &key, &klen) < 0)
            return -1;
        if (at(q, size, i, key, klen)) {
            i += klen;
            break;
        }
    }
    if (k == self->nkeys || !self->allowed[k])
        return 0;
    int escaped, high;
    Py_ssize_t end = string_end(q, size, i, &escaped, &high);
    if (end < 0 || size - end - 1 != tlen || memcmp(q + end + 1, tail, (size_t)tlen) != 0)
        return 0;
    t->key = k;
    t->text = NULL;
    t->chars = 0;
    if (self->keep_texts || (need_visible && self->visible[k])) {
        if ((t->text = decode(q + i, end - i, escaped)) == NULL)
            return PyErr_Occurred() ? -1 : 0;
        t->chars = PyUnicode_GetLength(t->text);
    } else if (high) {
        /* not kept and not looked at: still valid UTF-8, as the Python path requires (ASCII
         * with JSON's escapes always is) */
        PyObject *text = decode(q + i, end - i, escaped);
        if (text == NULL)
            return PyErr_Occurred() ? -1 : 0;
        Py_DECREF(text);
    }
    return 1;
}

/* `data[from:to]` to the client (the read itself when that is all of it): 0, -1 error. */
static int write_span(PyObject *write, PyObject *data, const char *p, Py_ssize_t from,
                      Py_ssize_t to, Py_ssize_t n)
{
    PyObject *piece;
    if (from == 0 && to == n) {
        piece = data;
        Py_INCREF(piece);
    } else if ((piece = PyBytes_FromStringAndSize(p + from, to - from)) == NULL) {
        return -1;
    }
    PyObject *written = PyObject_CallFunctionObjArgs(write, piece, NULL);
    Py_DECREF(piece);
    if (written == NULL)
        return -1;
    Py_DECREF(written);
    return 0;
}

/* An armed read: 1 taken here (the Python path takes `data[*rest:]`, nothing when *rest is
 * its length), 0 for the Python path (nothing was changed), -1 error. */
static int take(Lane *self, PyObject *data, Py_ssize_t *rest)
{
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(data, &p, &n) < 0)
        return -1;
    Token tokens[MAX_FRAMES];
    int count = 0, result = 0, need = !self->saw_visible;
    Py_ssize_t pos = 0;
    /* first the whole read: only token chunks of the shape, or it is not touched */
    while (pos < n) {
        Token *t = &tokens[count];
        if (count == MAX_FRAMES || !frame_at(p, n, &pos, &t->start, &t->size))
            goto done;
        int r = token_at(self, p + t->start, t->size, t, need);
        if (r <= 0) {
            result = r;
            goto done;
        }
        count++;
        t->end = pos;
        t->shown = 0;
        if (need && t->text != NULL && self->visible[t->key]) {
            if ((r = blank(t->text)) < 0)
                goto error;
            t->shown = !r;
            need = r;
        }
    }
    if (count == 0)
        goto done;
    /* the read is the stream's token chunks only: each token's effects kept, as the Python
     * path has them, and the read written as it came (in pieces where the guard looks). A
     * write or the checkpoint may call back into Python that ends the exchange and disarms
     * the lane: the lane holds the callables it calls, and after a call reads only its own
     * counters and texts. */
    PyObject *now = PyObject_CallFunctionObjArgs(self->clock, NULL);
    if (now == NULL)
        goto error;
    double when = PyFloat_AsDouble(now);
    Py_DECREF(now);
    if (when == -1.0 && PyErr_Occurred())
        goto error;
    self->last_read = when;
    PyObject *write = self->write, *check = self->check;
    Py_INCREF(write);
    Py_XINCREF(check);
    Py_ssize_t from = 0;
    *rest = n;
    for (int i = 0; i < count; i++) {
        Token *t = &tokens[i];
        self->tokens++;
        self->saw_visible |= t->shown;
        if (!self->keep_texts)
            continue;
        if (PyList_Append(self->texts, t->text) < 0)
            goto failed;
        self->budget -= t->chars;
        if (self->budget > 0)
            continue;
        /* the guard's detector looks after this token: the read so far written, then the
         * checkpoint, which answers the next budget (0: the Python path from here on) */
        if (write_span(write, data, p, from, t->end, n) < 0)
            goto failed;
        from = t->end;
        PyObject *next = PyObject_CallFunctionObjArgs(check, NULL);
        if (next == NULL)
            goto failed;
        Py_ssize_t budget = PyLong_AsSsize_t(next);
        Py_DECREF(next);
        if (budget == -1 && PyErr_Occurred())
            goto failed;
        if (budget <= 0 || !self->armed) {
            lane_disarm(self);
            *rest = from;
            break;
        }
        self->budget = budget;
    }
    if (*rest == n && from < n && write_span(write, data, p, from, n, n) < 0)
        goto failed;
    Py_DECREF(write);
    Py_XDECREF(check);
    result = 1;
    goto done;
failed:
    Py_DECREF(write);
    Py_XDECREF(check);
error:
    result = -1;
done:
    for (int i = 0; i < count; i++)
        Py_XDECREF(tokens[i].text);
    return result;
}

static PyObject *Lane_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
    Lane *self = (Lane *)op;
    PyObject *data;
    if (kwargs != NULL && PyDict_Size(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Lane() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Lane", 1, 1, &data))
        return NULL;
    if (self->armed && PyBytes_Check(data)) {
        /* a write or the checkpoint may call back into Python that disarms the lane: hold
         * the lane */
        Py_INCREF(op);
        Py_ssize_t rest = 0;
        int r = take(self, data, &rest);
        if (r > 0) {
            taken++;
            Py_ssize_t n = PyBytes_Size(data);
            PyObject *result = Py_None;
            Py_INCREF(result);
            if (rest < n) {  /* after a checkpoint: the rest of the read is the Python path's */
                char *p;
                PyObject *tail = NULL, *fallback = self->fallback;
                Py_DECREF(result);
                result = NULL;
                if (PyBytes_AsStringAndSize(data, &p, &n) == 0
                    && (tail = PyBytes_FromStringAndSize(p + rest, n - rest)) != NULL) {
                    Py_INCREF(fallback);
                    result = PyObject_CallFunctionObjArgs(fallback, tail, NULL);
                    Py_DECREF(fallback);
                    Py_DECREF(tail);
                }
            }
            Py_DECREF(op);
            return result;
        }
        Py_DECREF(op);
        if (r < 0) {
            lane_disarm(self);
            return NULL;
        }
    }
    lane_disarm(self);
    PyObject *fallback = self->fallback;
    Py_INCREF(fallback);
    PyObject *result = PyObject_CallFunctionObjArgs(fallback, data, NULL);
    Py_DECREF(fallback);
    return result;
}

static PyObject *Lane_arm(PyObject *op, PyObject *args)
{
    Lane *self = (Lane *)op;
    PyObject *head, *keys, *tail, *channel, *write, *clock, *check = Py_None;
    Py_ssize_t budget;
    if (!PyArg_ParseTuple(args, "SOSOnOO|O:arm", &head, &keys, &tail, &channel, &budget, &write,
                          &clock, &check))
        return NULL;
    if (self->tokens != 0) {
        PyErr_SetString(PyExc_RuntimeError, "drain the lane before arming it again");
        return NULL;
    }
    if (!PyTuple_Check(keys) || PyTuple_Size(keys) < 1 || PyTuple_Size(keys) > MAX_KEYS) {
        PyErr_SetString(PyExc_ValueError, "keys: a tuple of 1 to 4 (bytes, str, bool)");
        return NULL;
    }
    if (channel != Py_None && !PyUnicode_Check(channel)) {
        PyErr_SetString(PyExc_TypeError, "channel must be a str or None");
        return NULL;
    }
    if (!PyCallable_Check(write) || !PyCallable_Check(clock)
        || (check != Py_None && !PyCallable_Check(check))) {
        PyErr_SetString(PyExc_TypeError, "write and clock must be callable, check too or None");
        return NULL;
    }
    if ((channel == Py_None) != (check == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "a watched channel needs a check, and only it");
        return NULL;
    }
    lane_disarm(self);
    Py_ssize_t nkeys = PyTuple_Size(keys);
    for (Py_ssize_t k = 0; k < nkeys; k++) {
        PyObject *item = PyTuple_GetItem(keys, k);
        PyObject *key, *name, *visible;
        if (item == NULL || !PyArg_ParseTuple(item, "SUO:key", &key, &name, &visible))
            goto fail;
        int allowed = 1;
        if (channel != Py_None) {
            allowed = PyUnicode_Compare(name, channel) == 0;
            if (PyErr_Occurred())
                goto fail;
        }
        int shown = PyObject_IsTrue(visible);
        if (shown < 0)
            goto fail;
        Py_INCREF(key);
        self->keys[k] = key;
        self->visible[k] = shown;
        self->allowed[k] = allowed;
        self->nkeys = k + 1;
    }
    self->keep_texts = channel != Py_None;
    if (self->keep_texts && self->texts == NULL && (self->texts = PyList_New(0)) == NULL)
        goto fail;
    Py_INCREF(head);
    self->head = head;
    Py_INCREF(tail);
    self->tail = tail;
    Py_INCREF(write);
    self->write = write;
    Py_INCREF(clock);
    self->clock = clock;
    if (check != Py_None) {
        Py_INCREF(check);
        self->check = check;
    }
    self->budget = budget;
    self->armed = 1;
    Py_RETURN_NONE;
fail:
    lane_disarm(self);
    return NULL;
}

static PyObject *Lane_disarm(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    lane_disarm((Lane *)op);
    Py_RETURN_NONE;
}

static PyObject *Lane_drain(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    Lane *self = (Lane *)op;
    if (self->tokens == 0)
        Py_RETURN_NONE;
    PyObject *texts = self->texts;
    if (texts == NULL && (texts = PyList_New(0)) == NULL)
        return NULL;
    self->texts = NULL;
    if (self->keep_texts && (self->texts = PyList_New(0)) == NULL) {
        Py_DECREF(texts);
        return NULL;
    }
    PyObject *result = Py_BuildValue("nNN", self->tokens, PyBool_FromLong(self->saw_visible),
                                     texts);
    self->tokens = 0;
    self->saw_visible = 0;
    return result;
}

static PyObject *Lane_get_armed(PyObject *op, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(((Lane *)op)->armed);
}

static PyObject *Lane_get_last_read(PyObject *op, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(((Lane *)op)->last_read);
}

static PyObject *Lane_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *fallback;
    static char *names[] = {"fallback", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Lane", names, &fallback))
        return NULL;
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    Lane *self = (Lane *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(fallback);
    self->fallback = fallback;
    return (PyObject *)self;
}

static int Lane_traverse(PyObject *op, visitproc visit, void *arg)
{
    Lane *self = (Lane *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->fallback);
    Py_VISIT(self->head);
    Py_VISIT(self->tail);
    for (Py_ssize_t k = 0; k < self->nkeys; k++)
        Py_VISIT(self->keys[k]);
    Py_VISIT(self->write);
    Py_VISIT(self->clock);
    Py_VISIT(self->check);
    Py_VISIT(self->texts);
    return 0;
}

static int Lane_clear(PyObject *op)
{
    Lane *self = (Lane *)op;
    lane_disarm(self);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->texts);
    return 0;
}

static void Lane_dealloc(PyObject *op)
{
    PyTypeObject *type = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    Lane_clear(op);
    freefunc free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free(op);
    Py_DECREF(type);
}

static PyMethodDef Lane_methods[] = {
    {"arm", Lane_arm, METH_VARARGS,
     "arm(head, keys, tail, channel, budget, write, clock, check=None): take this shape's "
     "token chunks until a read that is not only token chunks (or disarm); with a channel, "
     "`check()` at the budget answers the next one (0: the Python path from there)."},
    {"disarm", Lane_disarm, METH_NOARGS, "Every read to the Python path until armed again."},
    {"drain", Lane_drain, METH_NOARGS,
     "drain(): (token chunks, whether one had visible text, the texts kept) taken since "
     "the last drain, or None."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lane_getset[] = {
    {"armed", Lane_get_armed, NULL, "Whether token chunks are taken here.", NULL},
    {"last_read", Lane_get_last_read, NULL, "The loop's time of the last read taken here.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Lane_slots[] = {
    {Py_tp_doc, "A connection's data_received: token chunks in C, the rest to `fallback`."},
    {Py_tp_new, Lane_new},
    {Py_tp_call, Lane_call},
    {Py_tp_traverse, Lane_traverse},
    {Py_tp_clear, Lane_clear},
    {Py_tp_dealloc, Lane_dealloc},
    {Py_tp_methods, Lane_methods},
    {Py_tp_getset, Lane_getset},
    {0, NULL},
};

static PyType_Spec Lane_spec = {
    "mla_serve.sidecar.passthrough._lane.Lane", sizeof(Lane), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, Lane_slots,
};

static PyObject *lane_frames(PyObject *Py_UNUSED(module), PyObject *data)
{
    char *p;
    Py_ssize_t n, pos = 0, start, size;
    if (PyBytes_AsStringAndSize(data, &p, &n) < 0)
        return NULL;
    if (n == 0)
        Py_RETURN_NONE;
    PyObject *sizes = PyList_New(0);
    if (sizes == NULL)
        return NULL;
    while (pos < n) {
        if (!frame_at(p, n, &pos, &start, &size)) {
            Py_DECREF(sizes);
            Py_RETURN_NONE;
        }
        PyObject *value = PyLong_FromSsize_t(size);
        int r = value ? PyList_Append(sizes, value) : -1;
        Py_XDECREF(value);
        if (r < 0) {
            Py_DECREF(sizes);
            return NULL;
        }
    }
    return sizes;
}

static PyObject *lane_taken(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(taken);
}

static PyMethodDef module_methods[] = {
    {"taken", lane_taken, METH_NOARGS,
     "taken(): reads of vLLM's sockets done in C so far, every lane of this process."},
    {"frames", lane_frames, METH_O,
     "frames(data): the payloads' sizes when `data` is whole chunks of data only, in "
     "canonical chunked coding (lowercase hex, no extension), else None."},
    {NULL, NULL, 0, NULL},
};

static int lane_exec(PyObject *module)
{
    if ((s_isspace = PyUnicode_InternFromString("isspace")) == NULL
        || (s_quote = PyUnicode_InternFromString("\"")) == NULL)
        return -1;
    PyObject *json = PyImport_ImportModule("_json");
    if (json != NULL) {
        scanstring = PyObject_GetAttrString(json, "scanstring");
        Py_DECREF(json);
    }
    if (scanstring == NULL)
        PyErr_Clear();  /* escapes then go the Python path */
    PyObject *type = PyType_FromSpec(&Lane_spec);
    if (type == NULL)
        return -1;
    if (PyModule_AddObject(module, "Lane", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return PyModule_AddIntConstant(module, "MAX_FRAMES", MAX_FRAMES);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, lane_exec},
    {0, NULL},
};

static struct PyModuleDef lane_module = {
    PyModuleDef_HEAD_INIT, "mla_serve.sidecar.passthrough._lane",
    "The per-read path of a token stream in C (see _lane.c).", 0, module_methods, module_slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lane(void)
{
    return PyModuleDef_Init(&lane_module);
}

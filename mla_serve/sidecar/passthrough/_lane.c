/* The per-read path of a token stream, in C: no Python frame for a read of vLLM's socket
 * that carries token chunks only (issue 19).
 *
 * upstream.Connection sets a `Lane` as its `data_received`. Unarmed, the lane hands every read
 * to the connection's Python method (`fallback`), which feeds httptools and calls the
 * exchange: proxy.Exchange.body / fast.FastExchange.fed. After a Python read that left vLLM's
 * parser between two chunks, FastExchange.may_arm arms it for that stream. Armed, a read that is
 * one or more whole chunks of HTTP/1.1 chunked coding (canonical: lowercase hex size, no
 * extension), each one token chunk of the stream, is done here with exactly the effects of
 * the Python path, and written to the client as vLLM framed it:
 *   - proxy.token_chunk's match: the stream's head bytes, then `content` or `reasoning` with
 *     one JSON string and the fixed tail (`_TOKEN`), decoded as json.loads decodes it;
 *   - choice 0 becomes visible on content that is not all whitespace (Choice.visible);
 *   - the loop guard's add_token: the token counted, its text appended to the detector's
 *     pieces; a token that would make the detector check (or change its channel) is given
 *     to ResponseGuard.add_token itself, and when that stops the stream, the read's token
 *     chunks up to it go to the exchange's batch and Exchange._finish ends it, as there;
 *   - the connection's `got_bytes` and `last_read`.
 * Anything else (a partial chunk, another event, an escape the grammar refuses, bytes that
 * are not UTF-8, the client's transport paused, bytes waiting, the response ending) is not
 * touched: the lane disarms and the read goes to the Python path, which re-arms it when it
 * may. The stable ABI (3.11) only: one build serves every CPython from 3.11 on.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_FRAMES 64

/* What an armed lane works with: one stream's objects. */
typedef struct {
    PyObject *conn;       /* upstream.Connection */
    PyObject *exchange;   /* fast.FastExchange */
    PyObject *head;       /* bytes every token chunk of the stream starts with */
    PyObject *choice;     /* runaways.Choice of choice 0 */
    PyObject *guard;      /* loops.ResponseGuard or None */
    PyObject *watch;      /* loops._Watch of choice 0, or None */
    PyObject *write;      /* the client's transport.write */
    PyObject *flow;       /* the client's flow control (write_paused) */
    PyObject *clock;      /* the loop's time() */
    Py_ssize_t check_every;
} Armed;

#define ARMED_OBJECTS(a) {(a)->conn, (a)->exchange, (a)->head, (a)->choice, (a)->guard, \
                          (a)->watch, (a)->write, (a)->flow, (a)->clock}

typedef struct {
    PyObject_HEAD
    PyObject *fallback;   /* the connection's Python data_received */
    int armed;
    Armed a;
} Lane;

typedef struct {
    Py_ssize_t start, size;  /* the chunk's payload in the read */
    int content;             /* channel: content (1) or reasoning (0) */
    PyObject *text;          /* the decoded string */
} Token;

static PyObject *s_ended, *s_finished, *s_head_out, *s_pending, *s_write_paused, *s_batch,
    *s_finish, *s_got_bytes, *s_last_read, *s_visible, *s_loop, *s_channel, *s_tokens,
    *s_detector, *s_fresh, *s_pieces, *s_add_token, *s_looping, *s_action, *s_stop,
    *s_content, *s_reasoning, *s_isspace, *s_transport, *s_flow, *s_write, *s_clock, *s_quote;
static PyObject *scanstring;      /* _json.scanstring (json.decoder's, when built) or NULL */
static unsigned long long taken;  /* reads done in C, every lane of the process */

static const char TAIL1[] = "},\"logprobs\":null,\"finish_reason\":null";
static const char TOKEN_IDS[] = ",\"token_ids\":null";
static const char TAIL2[] = "}]";
static const char KV[] = ",\"kv_transfer_params\":null";
static const char TAIL3[] = "}\n\n";

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

/* proxy._TOKEN from `i` to the end of the payload: 1 and the string's span, or 0. */
static int token_at(const char *p, Py_ssize_t n, Py_ssize_t i, int *content, Py_ssize_t *s,
                    Py_ssize_t *e, int *escaped)
{
    static const char HEX[] = "0123456789abcdefABCDEF";
    if (at(p, n, i, "content\":\"", 10)) {
        *content = 1;
        i += 10;
    } else if (at(p, n, i, "reasoning\":\"", 12)) {
        *content = 0;
        i += 12;
    } else {
        return 0;
    }
    *s = i;
    *escaped = 0;
    for (;;) {
        if (i >= n)
            return 0;
        unsigned char c = (unsigned char)p[i];
        if (c == '"')
            break;
        if (c < 0x20)
            return 0;
        if (c != '\\') {
            i++;
            continue;
        }
        *escaped = 1;
        if (i + 1 >= n)
            return 0;
        c = (unsigned char)p[i + 1];
        if (strchr("\"\\/bfnrt", c) != NULL && c != 0) {
            i += 2;
        } else if (c == 'u') {
            if (i + 6 > n)
                return 0;
            for (int k = 2; k < 6; k++)
                if (p[i + k] == 0 || strchr(HEX, p[i + k]) == NULL)
                    return 0;
            i += 6;
        } else {
            return 0;
        }
    }
    *e = i;
    i++;
    if (!at(p, n, i, TAIL1, sizeof TAIL1 - 1))
        return 0;
    i += sizeof TAIL1 - 1;
    if (at(p, n, i, TOKEN_IDS, sizeof TOKEN_IDS - 1))
        i += sizeof TOKEN_IDS - 1;
    if (!at(p, n, i, TAIL2, sizeof TAIL2 - 1))
        return 0;
    i += sizeof TAIL2 - 1;
    if (at(p, n, i, KV, sizeof KV - 1))
        i += sizeof KV - 1;
    return at(p, n, i, TAIL3, sizeof TAIL3 - 1) && i + (Py_ssize_t)(sizeof TAIL3 - 1) == n;
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

static int truthy_attr(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int result = PyObject_IsTrue(value);
    Py_DECREF(value);
    return result;
}

static void lane_disarm(Lane *self)
{
    self->armed = 0;
    Py_CLEAR(self->a.conn);
    Py_CLEAR(self->a.exchange);
    Py_CLEAR(self->a.head);
    Py_CLEAR(self->a.choice);
    Py_CLEAR(self->a.guard);
    Py_CLEAR(self->a.watch);
    Py_CLEAR(self->a.write);
    Py_CLEAR(self->a.flow);
    Py_CLEAR(self->a.clock);
}

/* Whether the client's side takes a direct write now, as FastExchange.fed asks: 1, 0, -1. */
static int writable(Armed *a)
{
    PyObject *ex = a->exchange;
    int r;
    if ((r = truthy_attr(ex, s_ended)) != 0 || (r = truthy_attr(ex, s_finished)) != 0)
        return r < 0 ? -1 : 0;
    PyObject *head_out = PyObject_GetAttr(ex, s_head_out);
    if (head_out == NULL)
        return -1;
    r = head_out == Py_None;
    Py_DECREF(head_out);
    if (!r)
        return 0;
    if ((r = truthy_attr(ex, s_pending)) != 0 || (r = truthy_attr(a->flow, s_write_paused)) != 0)
        return r < 0 ? -1 : 0;
    return 1;
}

/* ResponseGuard.add_token's effect for a token the detector takes without a check: 1 done,
 * 0 the guard itself must take it, -1 error. */
static int guard_token(Armed *a, Token *t)
{
    PyObject *watch = a->watch, *loop, *value;
    if ((loop = PyObject_GetAttr(watch, s_loop)) == NULL)
        return -1;
    int watched = loop == Py_None;
    Py_DECREF(loop);
    Py_ssize_t length = PyUnicode_GetLength(t->text);
    PyObject *detector = NULL, *fresh = NULL, *pieces = NULL;
    Py_ssize_t now = 0;
    if (watched && length > 0) {
        PyObject *channel = PyObject_GetAttr(watch, s_channel);
        if (channel == NULL)
            return -1;
        int same = PyObject_RichCompareBool(channel, t->content ? s_content : s_reasoning, Py_EQ);
        Py_DECREF(channel);
        if (same <= 0)
            return same;
        if ((detector = PyObject_GetAttr(watch, s_detector)) == NULL)
            return -1;
        if ((fresh = PyObject_GetAttr(detector, s_fresh)) == NULL)
            goto fail;
        now = PyLong_AsSsize_t(fresh);
        Py_CLEAR(fresh);
        if (now == -1 && PyErr_Occurred())
            goto fail;
        if (now + length >= a->check_every) {  /* the detector checks now: the guard's own */
            Py_DECREF(detector);
            return 0;
        }
    }
    PyObject *tokens = PyObject_GetAttr(watch, s_tokens);
    if (tokens == NULL)
        goto fail;
    Py_ssize_t count = PyLong_AsSsize_t(tokens);
    Py_DECREF(tokens);
    if (count == -1 && PyErr_Occurred())
        goto fail;
    if ((value = PyLong_FromSsize_t(count + 1)) == NULL)
        goto fail;
    int r = PyObject_SetAttr(watch, s_tokens, value);
    Py_DECREF(value);
    if (r < 0)
        goto fail;
    if (detector == NULL)
        return 1;
    if ((pieces = PyObject_GetAttr(detector, s_pieces)) == NULL)
        goto fail;
    r = PyList_Append(pieces, t->text);
    Py_CLEAR(pieces);
    if (r < 0)
        goto fail;
    if ((value = PyLong_FromSsize_t(now + length)) == NULL)
        goto fail;
    r = PyObject_SetAttr(detector, s_fresh, value);
    Py_DECREF(value);
    Py_DECREF(detector);
    return r < 0 ? -1 : 1;
fail:
    Py_XDECREF(detector);
    return -1;
}

/* Whether each token must go to the guard itself (a confirmed loop under action stop: the
 * stop decision is taken on every token there). */
static int guard_each(Armed *a)
{
    int r = truthy_attr(a->guard, s_looping);
    if (r <= 0)
        return r;
    PyObject *action = PyObject_GetAttr(a->guard, s_action);
    if (action == NULL)
        return -1;
    r = PyObject_RichCompareBool(action, s_stop, Py_EQ);
    Py_DECREF(action);
    return r;
}

/* An armed read: 1 done here, 0 for the Python path (nothing was changed), -1 error. */
static int take_armed(Lane *self, Armed *a, PyObject *data);

static int take(Lane *self, PyObject *data)
{
    /* The Python code this calls (the guard, the transport's write) may disarm the lane,
     * which drops its references: the read works on its own copy, held for the read. */
    Armed a = self->a;
    PyObject *held[] = ARMED_OBJECTS(&a);
    const int n = (int)(sizeof held / sizeof held[0]);
    for (int i = 0; i < n; i++)
        Py_INCREF(held[i]);
    int result = take_armed(self, &a, data);
    for (int i = 0; i < n; i++)
        Py_DECREF(held[i]);
    return result;
}

static int take_armed(Lane *self, Armed *a, PyObject *data)
{
    char *p;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(data, &p, &n) < 0)
        return -1;
    int r = writable(a);
    if (r <= 0)
        return r;
    char *head;
    Py_ssize_t hlen;
    if (PyBytes_AsStringAndSize(a->head, &head, &hlen) < 0)
        return -1;
    Token tokens[MAX_FRAMES];
    int count = 0, result = 0;
    Py_ssize_t pos = 0;
    while (pos < n) {
        Token *t = &tokens[count];
        Py_ssize_t s, e;
        int escaped;
        if (count == MAX_FRAMES || !frame_at(p, n, &pos, &t->start, &t->size))
            goto done;
        const char *q = p + t->start;
        if (t->size < hlen || memcmp(q, head, (size_t)hlen) != 0
            || !token_at(q, t->size, hlen, &t->content, &s, &e, &escaped))
            goto done;
        if ((t->text = decode(q + s, e - s, escaped)) == NULL) {
            result = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
        count++;
    }
    if (count == 0)
        goto done;
    /* Connection.data_received's own bookkeeping, then each token as the Python path does it */
    PyObject *now = PyObject_CallFunctionObjArgs(a->clock, NULL);
    if (now == NULL)
        goto error;
    r = PyObject_SetAttr(a->conn, s_last_read, now);
    Py_DECREF(now);
    if (r < 0 || PyObject_SetAttr(a->conn, s_got_bytes, Py_True) < 0)
        goto error;
    int each = a->guard != Py_None ? guard_each(a) : 0;
    if (each < 0)
        goto error;
    for (int i = 0; i < count; i++) {
        Token *t = &tokens[i];
        if (t->content) {
            r = truthy_attr(a->choice, s_visible);
            if (r < 0)
                goto error;
            if (!r && PyUnicode_GetLength(t->text) > 0) {
                PyObject *space = PyObject_CallMethodObjArgs(t->text, s_isspace, NULL);
                if (space == NULL)
                    goto error;
                r = PyObject_IsTrue(space);
                Py_DECREF(space);
                if (r < 0 || (!r && PyObject_SetAttr(a->choice, s_visible, Py_True) < 0))
                    goto error;
            }
        }
        if (a->guard == Py_None)
            continue;
        r = each ? 0 : guard_token(a, t);
        if (r < 0)
            goto error;
        if (r)
            continue;
        PyObject *index = PyLong_FromLong(0);
        PyObject *stopped = index ? PyObject_CallMethodObjArgs(
            a->guard, s_add_token, index, t->content ? s_content : s_reasoning, t->text, NULL) : NULL;
        Py_XDECREF(index);
        if (stopped == NULL)
            goto error;
        r = PyObject_IsTrue(stopped);
        Py_DECREF(stopped);
        if (r < 0)
            goto error;
        if (r) {  /* the guard stops the stream at this token: Exchange.body's _emit, _finish */
            PyObject *ex = a->exchange, *batch = PyObject_GetAttr(ex, s_batch);
            if (batch == NULL)
                goto error;
            for (int k = 0; k <= i; k++) {
                PyObject *piece = PyBytes_FromStringAndSize(p + tokens[k].start, tokens[k].size);
                r = piece ? PyList_Append(batch, piece) : -1;
                Py_XDECREF(piece);
                if (r < 0)
                    break;
            }
            Py_DECREF(batch);
            if (r < 0)
                goto error;
            Py_INCREF(ex);
            lane_disarm(self);
            PyObject *done = PyObject_CallMethodObjArgs(ex, s_finish, Py_None, NULL);
            Py_DECREF(ex);
            Py_XDECREF(done);
            result = done == NULL ? -1 : 1;
            goto done;
        }
        if (!each && (each = guard_each(a)) < 0)
            goto error;
    }
    PyObject *written = PyObject_CallFunctionObjArgs(a->write, data, NULL);
    Py_XDECREF(written);
    result = written == NULL ? -1 : 1;
    if (each && result == 1)
        lane_disarm(self);  /* the Python path decides each token from here */
    goto done;
error:
    result = -1;
done:
    for (int i = 0; i < count; i++)
        Py_DECREF(tokens[i].text);
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
        int r = take(self, data);
        if (r > 0) {
            taken++;
            Py_RETURN_NONE;
        }
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
    PyObject *conn, *exchange, *head, *choice, *guard, *watch, *transport;
    Py_ssize_t check_every;
    if (!PyArg_ParseTuple(args, "OOSOOOn:arm", &conn, &exchange, &head, &choice, &guard,
                          &watch, &check_every))
        return NULL;
    if (guard != Py_None && watch == Py_None) {
        PyErr_SetString(PyExc_ValueError, "a guard needs choice 0's watch");
        return NULL;
    }
    lane_disarm(self);
    if ((transport = PyObject_GetAttr(exchange, s_transport)) == NULL)
        return NULL;
    self->a.write = PyObject_GetAttr(transport, s_write);
    Py_DECREF(transport);
    if (self->a.write == NULL
        || (self->a.flow = PyObject_GetAttr(exchange, s_flow)) == NULL
        || (self->a.clock = PyObject_GetAttr(conn, s_clock)) == NULL) {
        lane_disarm(self);
        return NULL;
    }
    Py_INCREF(conn);
    self->a.conn = conn;
    Py_INCREF(exchange);
    self->a.exchange = exchange;
    Py_INCREF(head);
    self->a.head = head;
    Py_INCREF(choice);
    self->a.choice = choice;
    Py_INCREF(guard);
    self->a.guard = guard;
    Py_INCREF(watch);
    self->a.watch = watch;
    self->a.check_every = check_every;
    self->armed = 1;
    Py_RETURN_NONE;
}

static PyObject *Lane_disarm(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    lane_disarm((Lane *)op);
    Py_RETURN_NONE;
}

static PyObject *Lane_get_armed(PyObject *op, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(((Lane *)op)->armed);
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
    Py_VISIT(self->a.conn);
    Py_VISIT(self->a.exchange);
    Py_VISIT(self->a.head);
    Py_VISIT(self->a.choice);
    Py_VISIT(self->a.guard);
    Py_VISIT(self->a.watch);
    Py_VISIT(self->a.write);
    Py_VISIT(self->a.flow);
    Py_VISIT(self->a.clock);
    return 0;
}

static int Lane_clear(PyObject *op)
{
    Lane *self = (Lane *)op;
    lane_disarm(self);
    Py_CLEAR(self->fallback);
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
     "arm(conn, exchange, head, choice, guard, watch, check_every): take this stream's "
     "token chunks until a read that is not only token chunks (or the exchange disarms it)."},
    {"disarm", Lane_disarm, METH_NOARGS, "Every read to the Python path until armed again."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lane_getset[] = {
    {"armed", Lane_get_armed, NULL, "Whether token chunks are taken here.", NULL},
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

static int intern(PyObject **slot, const char *text)
{
    *slot = PyUnicode_InternFromString(text);
    return *slot == NULL ? -1 : 0;
}

static int lane_exec(PyObject *module)
{
    if (intern(&s_ended, "ended") || intern(&s_finished, "finished")
        || intern(&s_head_out, "head_out") || intern(&s_pending, "pending")
        || intern(&s_write_paused, "write_paused") || intern(&s_batch, "batch")
        || intern(&s_finish, "_finish") || intern(&s_got_bytes, "got_bytes")
        || intern(&s_last_read, "last_read") || intern(&s_visible, "visible")
        || intern(&s_loop, "loop") || intern(&s_channel, "channel")
        || intern(&s_tokens, "tokens") || intern(&s_detector, "detector")
        || intern(&s_fresh, "fresh") || intern(&s_pieces, "pieces")
        || intern(&s_add_token, "add_token") || intern(&s_looping, "looping")
        || intern(&s_action, "action") || intern(&s_stop, "stop")
        || intern(&s_content, "content") || intern(&s_reasoning, "reasoning")
        || intern(&s_isspace, "isspace") || intern(&s_transport, "transport")
        || intern(&s_flow, "flow") || intern(&s_write, "write") || intern(&s_clock, "clock")
        || intern(&s_quote, "\""))
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

/* The HTTP side of entmaxkv serve (docs/cli.md, "serve"), on libmicrohttpd: a thread per
 * connection (at most --max-connections), so a handler may wait for its request's result and a
 * stream's reader may wait for its next token. While it waits it watches its socket: a client
 * that went away cancels its request, which stops at its next token and frees its sequence. */
#define _GNU_SOURCE /* POLLRDHUP: the peer closed its end */
#include "serve.h"
#include <arpa/inet.h>
#include <microhttpd.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct serve_http {
    struct MHD_Daemon *d;
    serve_engine *e;
    const serve_opts *o;
    pthread_mutex_t mu;
    int64_t active; /* requests whose response is not sent yet */
};

typedef struct { /* one HTTP request, MHD's con_cls */
    sbuf body;
    int too_big;
} conn_req;

static int client_gone(int fd) {
    struct pollfd p = {fd, POLLRDHUP, 0};
    return fd >= 0 && poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static int conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *i =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return i ? i->connect_fd : -1;
}

static enum MHD_Result send_body(serve_http *h, struct MHD_Connection *c, int status,
                                 const char *type, sbuf *b) {
    static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                              "\"param\":null,\"code\":null}}";
    const int oom_ = b->oom;
    if (oom_) status = 500;
    struct MHD_Response *resp =
            oom_ ? MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom,
                                                   MHD_RESPMEM_PERSISTENT)
                 : MHD_create_response_from_buffer(b->len, b->p, MHD_RESPMEM_MUST_COPY);
    sb_free(b);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, oom_ ? "application/json" : type);
    if (status == 405) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, POST");
    const enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    serve_metrics_status(serve_engine_metrics(h->e), status);
    return ok;
}

static enum MHD_Result send_error(serve_http *h, struct MHD_Connection *c, int status,
                                  const char *msg) {
    sbuf b = {0};
    serve_error_body(&b, status, NULL, "%s", msg);
    return send_body(h, c, status, "application/json", &b);
}

/* A stream's state, the content reader's cls. */
typedef struct {
    serve_http *h;
    serve_req *r;
    int fd;
    sbuf ev; /* events formatted, not yet handed to MHD from ev_off on */
    size_t ev_off;
    sbuf raw;     /* visible bytes not yet sent: an incomplete UTF-8 sequence at most */
    int64_t have; /* visible bytes received */
    int stage;    /* 0: the role chunk is due, 1: tokens, 2: everything formatted */
} stream_ctx;

/* The events after the text: an error, or the finish chunk (and usage); then [DONE]. */
static void stream_end(stream_ctx *s) {
    const serve_req *r = s->r;
    const serve_opts *o = s->h->o;
    if (r->err_status || !r->finish) {
        sb_puts(&s->ev, "data: ");
        serve_error_body(&s->ev, r->err_status ? r->err_status : 503, NULL, "%s",
                         r->err_status ? r->err_msg : "the server stopped before the answer ended");
        sb_puts(&s->ev, "\n\n");
    } else {
        serve_chunk_event(&s->ev, o, r, CHUNK_FINISH, "", 0);
        if (r->p.include_usage) serve_chunk_event(&s->ev, o, r, CHUNK_USAGE, NULL, 0);
    }
    sb_puts(&s->ev, "data: [DONE]\n\n");
    s->stage = 2;
}

/* Waits (a while) for tokens and formats the events they make. */
static void stream_next(stream_ctx *s) {
    if (s->stage == 0) {
        if (s->r->p.chat) serve_chunk_event(&s->ev, s->h->o, s->r, CHUNK_ROLE, NULL, 0);
        s->stage = 1;
        return;
    }
    const int done = serve_wait(s->h->e, s->r, &s->have, 200, &s->raw);
    if (!done && client_gone(s->fd)) serve_cancel(s->h->e, s->r);
    const size_t k = serve_utf8_decided(s->raw.p, s->raw.len, done);
    if (k) {
        sbuf t = {0};
        serve_utf8_repair(&t, s->raw.p, k);
        serve_chunk_event(&s->ev, s->h->o, s->r, CHUNK_TEXT, t.p, t.len);
        sb_free(&t);
        memmove(s->raw.p, s->raw.p + k, s->raw.len - k);
        s->raw.len -= k;
    }
    if (done) stream_end(s);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    stream_ctx *s = cls;
    (void)pos;
    while (s->ev_off == s->ev.len) {
        s->ev.len = s->ev_off = 0;
        if (s->stage == 2) return MHD_CONTENT_READER_END_OF_STREAM;
        stream_next(s);
        if (s->ev.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    const size_t n = s->ev.len - s->ev_off < max ? s->ev.len - s->ev_off : max;
    memcpy(buf, s->ev.p + s->ev_off, n);
    s->ev_off += n;
    return (ssize_t)n;
}

/* The response is gone (sent, or its connection closed): a request still running is
 * cancelled. */
static void stream_free(void *cls) {
    stream_ctx *s = cls;
    if (s->stage != 2) serve_cancel(s->h->e, s->r);
    serve_release(s->h->e, s->r);
    sb_free(&s->ev);
    sb_free(&s->raw);
    free(s);
}

static enum MHD_Result start_stream(serve_http *h, struct MHD_Connection *c, serve_req *r) {
    stream_ctx *s = calloc(1, sizeof *s);
    struct MHD_Response *resp = s ? MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096,
                                                                      stream_read, s, stream_free)
                                  : NULL;
    if (!resp) {
        free(s);
        serve_cancel(h->e, r);
        serve_release(h->e, r);
        return send_error(h, c, 500, "out of memory");
    }
    s->h = h;
    s->r = r;
    s->fd = conn_fd(c);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    const enum MHD_Result ok = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    serve_metrics_status(serve_engine_metrics(h->e), 200);
    return ok;
}

/* A whole (not streamed) answer: waits for the request, watching the client. */
static enum MHD_Result answer(serve_http *h, struct MHD_Connection *c, serve_req *r) {
    sbuf got = {0}, b = {0};
    int64_t have = 0;
    const int fd = conn_fd(c);
    while (!serve_wait(h->e, r, &have, 200, &got))
        if (client_gone(fd)) serve_cancel(h->e, r);
    int status = 200;
    if (r->err_status || !r->finish) {
        status = r->err_status ? r->err_status : 503;
        serve_error_body(&b, status, NULL, "%s",
                         r->err_status ? r->err_msg : "the server stopped before the answer ended");
    } else {
        sbuf t = {0};
        serve_utf8_repair(&t, got.p, got.len);
        serve_result_body(&b, h->o, r, t.p ? t.p : "", t.len);
        b.oom |= t.oom;
        sb_free(&t);
    }
    sb_free(&got);
    serve_release(h->e, r);
    return send_body(h, c, status, "application/json", &b);
}

static enum MHD_Result generate(serve_http *h, struct MHD_Connection *c, conn_req *cr,
                                serve_api api) {
    if (cr->too_big) return send_error(h, c, 413, "the request body is larger than --max-body");
    sbuf err = {0};
    serve_params p;
    int st = serve_parse_request(h->o, api, cr->body.p ? cr->body.p : "", cr->body.len, &p, &err);
    if (st) return send_body(h, c, st, "application/json", &err);
    serve_req *r = serve_req_new();
    if (!r) {
        serve_params_free(&p);
        return send_error(h, c, 500, "out of memory");
    }
    r->p = p;
    st = serve_submit(h->e, r);
    if (st) {
        enum MHD_Result ok = send_error(h, c, st, r->err_msg);
        serve_release(h->e, r);
        return ok;
    }
    return r->p.stream ? start_stream(h, c, r) : answer(h, c, r);
}

static enum MHD_Result route(serve_http *h, struct MHD_Connection *c, const char *url,
                             const char *method, conn_req *cr) {
    static const struct {
        const char *path, *method;
    } routes[] = {{"/health", "GET"},
                  {"/metrics", "GET"},
                  {"/v1/models", "GET"},
                  {"/v1/completions", "POST"},
                  {"/v1/chat/completions", "POST"}};
    int k = -1;
    for (int i = 0; i < (int)(sizeof routes / sizeof routes[0]); i++)
        if (!strcmp(url, routes[i].path)) k = i;
    if (k < 0) return send_error(h, c, 404, "no such endpoint");
    if (strcmp(method, routes[k].method)) {
        char msg[96];
        snprintf(msg, sizeof msg, "%s takes %s", routes[k].path, routes[k].method);
        return send_error(h, c, 405, msg);
    }
    sbuf b = {0};
    switch (k) {
    case 0: sb_puts(&b, "{\"status\":\"ok\"}"); break;
    case 1:
        serve_metrics_render(serve_engine_metrics(h->e), &b);
        return send_body(h, c, 200, "text/plain; version=0.0.4", &b);
    case 2: serve_models_body(&b, h->o); break;
    default: return generate(h, c, cr, k == 3 ? API_COMPLETIONS : API_CHAT);
    }
    return send_body(h, c, 200, "application/json", &b);
}

/* MHD calls this first with the headers, then with each piece of the body, then once more
 * with none: the body is gathered (up to --max-body) and the request answered then. */
static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls) {
    serve_http *h = cls;
    conn_req *cr = *con_cls;
    (void)version;
    if (!cr) {
        cr = calloc(1, sizeof *cr);
        if (!cr) return MHD_NO;
        *con_cls = cr;
        pthread_mutex_lock(&h->mu);
        h->active++;
        pthread_mutex_unlock(&h->mu);
        const char *cl =
                MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        int64_t n;
        if (cl && (cli_parse_i64(cl, &n) || n > h->o->max_body)) /* refused before it is sent */
            return send_error(h, c, 413, "the request body is larger than --max-body");
        return MHD_YES;
    }
    if (*upload_size) {
        if ((int64_t)(cr->body.len + *upload_size) > h->o->max_body) {
            cr->too_big = 1;
            sb_free(&cr->body);
        } else if (!cr->too_big)
            sb_put(&cr->body, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    if (cr->body.oom) return send_error(h, c, 500, "out of memory");
    return route(h, c, url, method, cr);
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    serve_http *h = cls;
    conn_req *cr = *con_cls;
    (void)c;
    (void)toe;
    if (!cr) return;
    sb_free(&cr->body);
    free(cr);
    *con_cls = NULL;
    pthread_mutex_lock(&h->mu);
    h->active--;
    pthread_mutex_unlock(&h->mu);
}

serve_http *serve_http_start(serve_engine *e, const serve_opts *o) {
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)o->port);
    if (inet_pton(AF_INET, o->host, &sa.sin_addr) != 1) {
        fprintf(stderr, "entmaxkv serve: --host %s: expected an IPv4 address\n", o->host);
        return NULL;
    }
    serve_http *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->e = e;
    h->o = o;
    pthread_mutex_init(&h->mu, NULL);
    h->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                                    MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG,
                            (uint16_t)o->port, NULL, NULL, handle, h, MHD_OPTION_SOCK_ADDR, &sa,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)o->connections,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120,
                            MHD_OPTION_NOTIFY_COMPLETED, completed, h, MHD_OPTION_END);
    if (!h->d) {
        fprintf(stderr,
                "entmaxkv serve: cannot listen on %s:%lld (in use, or not an address of "
                "this machine)\n",
                o->host, (long long)o->port);
        free(h);
        return NULL;
    }
    const union MHD_DaemonInfo *i = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    printf("entmaxkv serve: listening on http://%s:%u\n", o->host, i ? (unsigned)i->port : 0u);
    fflush(stdout);
    return h;
}

void serve_http_quiesce(serve_http *h) {
    const MHD_socket fd = MHD_quiesce_daemon(h->d);
    if (fd != MHD_INVALID_SOCKET) close(fd);
}

int64_t serve_http_active(serve_http *h) {
    pthread_mutex_lock(&h->mu);
    const int64_t n = h->active;
    pthread_mutex_unlock(&h->mu);
    return n;
}

void serve_http_stop(serve_http *h) {
    MHD_stop_daemon(h->d);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

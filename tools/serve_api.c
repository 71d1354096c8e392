/* The OpenAI API of entmaxkv serve (docs/cli.md, "serve"): request bodies checked field by field
 * into serve_params (each wrong field a 400 that names it), and the response bodies, whole or
 * as server-sent events in the OpenAI chunk format. */
#include "serve.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void error_vbody(sbuf *b, int status, const char *param, const char *fmt, va_list ap) {
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    const char *type = status >= 500 ? "server_error" : "invalid_request_error";
    const char *code = status == 404 && param && !strcmp(param, "model") ? "model_not_found"
                       : status == 404                                   ? "not_found"
                       : status == 413                                   ? "body_too_large"
                       : status == 503                                   ? "overloaded"
                                                                         : NULL;
    sb_puts(b, "{\"error\":{\"message\":");
    sb_json_str(b, msg, strlen(msg));
    sb_printf(b, ",\"type\":\"%s\",\"param\":", type);
    if (param)
        sb_json_str(b, param, strlen(param));
    else
        sb_puts(b, "null");
    sb_puts(b, ",\"code\":");
    if (code)
        sb_json_str(b, code, strlen(code));
    else
        sb_puts(b, "null");
    sb_puts(b, "}}");
}

void serve_error_body(sbuf *b, int status, const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    error_vbody(b, status, param, fmt, ap);
    va_end(ap);
}

static int bad(sbuf *err, const char *param, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
static int bad(sbuf *err, const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    error_vbody(err, 400, param, fmt, ap);
    va_end(ap);
    return 400;
}

/* An integer field in [lo, hi] (absent or null: def). */
static int get_int(const json_value *body, const char *key, int64_t lo, int64_t hi, int64_t def,
                   int64_t *out, sbuf *err) {
    const json_value *v = json_get(body, key);
    *out = def;
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_NUMBER)
        return bad(err, key, "'%s' must be an integer in [%lld, %lld], got %s", key, (long long)lo,
                   (long long)hi, json_type_name(v->type));
    if (!v->is_int || v->integer < lo || v->integer > hi)
        return bad(err, key, "'%s' must be an integer in [%lld, %lld], got %.17g", key,
                   (long long)lo, (long long)hi, v->number);
    *out = v->integer;
    return 0;
}

static int get_number(const json_value *body, const char *key, double lo, double hi, double def,
                      double *out, sbuf *err) {
    const json_value *v = json_get(body, key);
    *out = def;
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_NUMBER || !(v->number >= lo && v->number <= hi))
        return bad(err, key, "'%s' must be a number in [%g, %g], got %s", key, lo, hi,
                   v->type == JSON_NUMBER ? "one out of range" : json_type_name(v->type));
    *out = v->number;
    return 0;
}

static int get_bool(const json_value *body, const char *key, int *out, sbuf *err) {
    const json_value *v = json_get(body, key);
    *out = 0;
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_BOOL)
        return bad(err, key, "'%s' must be a boolean, got %s", key, json_type_name(v->type));
    *out = v->boolean;
    return 0;
}

/* Fields of the OpenAI API this server does not implement: accepted only at their defaults
 * (null, the default number, false, or empty), so no request silently gets less than it asked. */
static int unsupported(const json_value *body, sbuf *err) {
    static const struct {
        const char *name;
        double dflt;
    } t[] = {{"n", 1},
             {"best_of", 1},
             {"top_p", 1},
             {"echo", 0},
             {"logprobs", 0},
             {"top_logprobs", 0},
             {"suffix", 0},
             {"presence_penalty", 0},
             {"frequency_penalty", 0},
             {"logit_bias", 0},
             {"tools", 0},
             {"functions", 0}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        const json_value *v = json_get(body, t[i].name);
        if (!v || v->type == JSON_NULL || (v->type == JSON_NUMBER && v->number == t[i].dflt) ||
            (t[i].dflt == 0 && ((v->type == JSON_BOOL && !v->boolean) ||
                                ((v->type == JSON_ARRAY || v->type == JSON_OBJECT) && !v->n))))
            continue;
        return bad(err, t[i].name, "'%s' is not supported by this server (only its default)",
                   t[i].name);
    }
    return 0;
}

/* "stop": a string or a list of at most 4 non-empty strings. */
static int get_stop(const json_value *body, serve_params *p, sbuf *err) {
    const json_value *v = json_get(body, "stop");
    if (!v || v->type == JSON_NULL) return 0;
    const json_value *items = v->type == JSON_ARRAY ? v->kids : v;
    const size_t n = v->type == JSON_ARRAY ? v->n : 1;
    if ((v->type != JSON_ARRAY && v->type != JSON_STRING) || n > 4)
        return bad(err, "stop", "'stop' must be a string or a list of at most 4 strings");
    for (size_t i = 0; i < n; i++) {
        if (items[i].type != JSON_STRING || items[i].len == 0 ||
            items[i].len > SERVE_MAX_STOP_BYTES)
            return bad(err, "stop", "each 'stop' entry must be a string of 1 to %d bytes",
                       SERVE_MAX_STOP_BYTES);
        p->stop[p->nstop] = malloc(items[i].len + 1);
        if (!p->stop[p->nstop]) return bad(err, "stop", "out of memory");
        memcpy(p->stop[p->nstop], items[i].str, items[i].len + 1);
        p->stop_len[p->nstop++] = items[i].len;
    }
    return 0;
}

/* A method field of the "entmaxkv" object, named as run's --method (absent: *out unchanged). */
static int get_method(const json_value *x, const char *key, ekv_select_method *out, sbuf *err) {
    const json_value *m = json_get(x, key);
    if (!m ||
        (m->type == JSON_STRING && !ekv_method_from_name(m->str, out) && *out != EKV_SELECT_ORACLE))
        return 0;
    char param[32];
    snprintf(param, sizeof param, "entmaxkv.%s", key);
    return bad(err, param, "'%s' must be one of dense, topk, gaussian, certified, screened", param);
}

/* "entmaxkv": {"method": NAME, "budget": F or "a/b", "prefill_method": NAME}: the server's
 * --method, --budget and --prefill-method for this request, named and parsed as run's
 * options are (the budget is both methods', as run's --budget). */
static int get_extension(const serve_opts *o, const json_value *body, serve_params *p, sbuf *err) {
    p->method = o->mo.method;
    p->prefill_method = o->prefill;
    p->budget = o->mo.budget;
    const json_value *x = json_get(body, "entmaxkv");
    if (!x || x->type == JSON_NULL) return 0;
    if (x->type != JSON_OBJECT) return bad(err, "entmaxkv", "'entmaxkv' must be an object");
    for (size_t i = 0; i < x->n; i++)
        if (strcmp(x->kids[i].key, "method") && strcmp(x->kids[i].key, "budget") &&
            strcmp(x->kids[i].key, "prefill_method"))
            return bad(err, "entmaxkv",
                       "'entmaxkv' takes 'method', 'budget' and 'prefill_method', not '%s'",
                       x->kids[i].key);
    if (get_method(x, "method", &p->method, err) ||
        get_method(x, "prefill_method", &p->prefill_method, err))
        return 400;
    const json_value *b = json_get(x, "budget");
    int ok = !b;
    if (b && b->type == JSON_NUMBER) ok = 1, p->budget = b->number;
    if (b && b->type == JSON_STRING) ok = !cli_parse_fraction(b->str, &p->budget);
    if (!ok || !(p->budget > 0 && p->budget <= 1))
        return bad(err, "entmaxkv.budget",
                   "'entmaxkv.budget' must be a fraction in (0, 1], a number or \"1/16\"");
    return 0;
}

/* A message's content: a string, or a list of {"type": "text", "text": ...} parts. */
static int put_content(const json_value *c, size_t i, sbuf *out, sbuf *err) {
    if (c && c->type == JSON_STRING) {
        sb_put(out, c->str, c->len);
        return 0;
    }
    for (size_t k = 0; c && c->type == JSON_ARRAY && k < c->n; k++) {
        const json_value *type = json_get(&c->kids[k], "type"),
                         *text = json_get(&c->kids[k], "text");
        if (!type || type->type != JSON_STRING || strcmp(type->str, "text") || !text ||
            text->type != JSON_STRING)
            return bad(err, "messages", "messages[%zu].content: only text parts are supported", i);
        sb_put(out, text->str, text->len);
    }
    if (c && c->type != JSON_ARRAY && c->type != JSON_NULL)
        return bad(err, "messages", "messages[%zu].content must be a string", i);
    return 0;
}

/* The plain chat template of this base model (docs/cli.md, "serve"): one line per message,
 * "System: ", "User: " or "Assistant: " and its content, then "Assistant: " to answer. */
static int chat_prompt(const json_value *body, sbuf *out, sbuf *err) {
    const json_value *ms = json_get(body, "messages");
    if (!ms || ms->type != JSON_ARRAY || !ms->n)
        return bad(err, "messages", "'messages' must be a non-empty list of messages");
    for (size_t i = 0; i < ms->n; i++) {
        const json_value *role = json_get(&ms->kids[i], "role");
        const char *r = role && role->type == JSON_STRING ? role->str : "";
        const char *label = !strcmp(r, "system") || !strcmp(r, "developer") ? "System"
                            : !strcmp(r, "user")                            ? "User"
                            : !strcmp(r, "assistant")                       ? "Assistant"
                                                                            : NULL;
        if (!label)
            return bad(err, "messages",
                       "messages[%zu].role must be system, developer, user or assistant", i);
        sb_printf(out, "%s: ", label);
        if (put_content(json_get(&ms->kids[i], "content"), i, out, err)) return 400;
        sb_puts(out, "\n");
    }
    sb_puts(out, "Assistant: ");
    return 0;
}

/* The prompt: "prompt" (completions) or the chat template over "messages". */
static int get_prompt(const serve_opts *o, const json_value *body, serve_params *p, sbuf *err) {
    sbuf text = {0};
    const json_value *v = json_get(body, "prompt");
    int st = 0;
    if (p->chat)
        st = chat_prompt(body, &text, err);
    else if (!v || v->type != JSON_STRING)
        st = bad(err, "prompt", "'prompt' must be a string, got %s",
                 v ? json_type_name(v->type) : "none");
    else
        sb_put(&text, v->str, v->len);
    if (!st && text.oom) st = bad(err, NULL, "out of memory");
    if (!st && text.len == 0) st = bad(err, "prompt", "the prompt is empty");
    if (!st && (int64_t)text.len > o->max_prompt)
        st = bad(err, "prompt",
                 "the prompt has %zu bytes, more than the %lld this server takes "
                 "(--max-prompt-bytes)",
                 text.len, (long long)o->max_prompt);
    if (st) {
        sb_free(&text);
        return st;
    }
    p->prompt = text.p;
    p->prompt_len = (int64_t)text.len;
    return 0;
}

static int check_model(const serve_opts *o, const json_value *body, sbuf *err) {
    const json_value *v = json_get(body, "model");
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_STRING) return bad(err, "model", "'model' must be a string");
    if (strcmp(v->str, o->name) && strlen(v->str) == v->len) {
        serve_error_body(err, 404, "model",
                         "the model '%.100s' does not exist; this server has '%s'", v->str,
                         o->name);
        return 404;
    }
    return strlen(v->str) == v->len ? 0 : bad(err, "model", "'model' holds a NUL byte");
}

/* The sampling and length fields, and the context limit. */
static int get_sampling(const serve_opts *o, const json_value *body, serve_params *p, sbuf *err) {
    int64_t seed;
    const json_value *opts = json_get(body, "stream_options");
    const char *max_key =
            json_get(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    int st = get_int(body, max_key, 1, o->max_gen, 16, &p->max_tokens, err);
    if (!st) st = get_number(body, "temperature", 0, 100, 1.0, &p->temp, err);
    if (!st) st = get_int(body, "seed", 0, INT64_MAX, -1, &seed, err);
    if (!st) st = get_bool(body, "stream", &p->stream, err);
    if (!st && opts && opts->type != JSON_NULL && opts->type != JSON_OBJECT)
        st = bad(err, "stream_options", "'stream_options' must be an object");
    if (!st) st = get_bool(opts, "include_usage", &p->include_usage, err);
    if (st) return st;
    /* no seed: one from the clock, so two such requests sample differently */
    p->seed = seed >= 0 ? (uint64_t)seed : (uint64_t)(cli_now_seconds() * 1e9);
    if (p->prompt_len + p->max_tokens > o->ctx)
        return bad(err, max_key,
                   "the prompt (%lld tokens) and %s (%lld) exceed the context of %lld tokens "
                   "(--ctx)",
                   (long long)p->prompt_len, max_key, (long long)p->max_tokens, (long long)o->ctx);
    return 0;
}

int serve_parse_request(const serve_opts *o, serve_api api, const char *body, size_t len,
                        serve_params *p, sbuf *err) {
    json_value v;
    char msg[160];
    memset(p, 0, sizeof *p);
    p->chat = api == API_CHAT;
    if (json_parse(body, len, &v, msg, sizeof msg)) {
        json_free(&v);
        return bad(err, NULL, "the body is not valid JSON: %s", msg);
    }
    int st = v.type == JSON_OBJECT ? 0 : bad(err, NULL, "the body must be a JSON object");
    if (!st) st = check_model(o, &v, err);
    if (!st) st = unsupported(&v, err);
    if (!st) st = get_prompt(o, &v, p, err);
    if (!st) st = get_sampling(o, &v, p, err);
    if (!st) st = get_stop(&v, p, err);
    if (!st) st = get_extension(o, &v, p, err);
    if (!st && p->chat) { /* a base model: the next "User:" line ends the answer */
        p->stop[p->nstop] = strdup("\nUser:");
        p->stop_len[p->nstop] = 6;
        if (p->stop[p->nstop]) p->nstop++;
    }
    json_free(&v);
    if (st) serve_params_free(p);
    return st;
}

void serve_params_free(serve_params *p) {
    free(p->prompt);
    for (int k = 0; k < p->nstop; k++) free(p->stop[k]);
    memset(p, 0, sizeof *p);
}

static void head(sbuf *b, const serve_opts *o, const serve_req *r, const char *object) {
    sb_printf(b, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", r->id, object,
              (long long)r->created);
    sb_json_str(b, o->name, strlen(o->name));
}

static void usage(sbuf *b, const serve_req *r) {
    sb_printf(b,
              "\"usage\":{\"prompt_tokens\":%lld,\"completion_tokens\":%lld,\"total_tokens\":%lld}",
              (long long)r->p.prompt_len, (long long)r->tokens,
              (long long)(r->p.prompt_len + r->tokens));
}

void serve_result_body(sbuf *b, const serve_opts *o, const serve_req *r, const char *text,
                       size_t n) {
    head(b, o, r, r->p.chat ? "chat.completion" : "text_completion");
    sb_puts(b, ",\"choices\":[{\"index\":0,");
    sb_puts(b, r->p.chat ? "\"message\":{\"role\":\"assistant\",\"content\":" : "\"text\":");
    sb_json_str(b, text, n);
    sb_printf(b, "%s,\"logprobs\":null,\"finish_reason\":\"%s\"}],", r->p.chat ? "}" : "",
              r->finish);
    usage(b, r);
    sb_puts(b, "}");
}

void serve_chunk_event(sbuf *b, const serve_opts *o, const serve_req *r, serve_chunk kind,
                       const char *text, size_t n) {
    sb_puts(b, "data: ");
    head(b, o, r, r->p.chat ? "chat.completion.chunk" : "text_completion");
    if (kind == CHUNK_USAGE) {
        sb_puts(b, ",\"choices\":[],");
        usage(b, r);
        sb_puts(b, "}\n\n");
        return;
    }
    sb_puts(b, ",\"choices\":[{\"index\":0,");
    if (r->p.chat)
        sb_puts(b, kind == CHUNK_ROLE     ? "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}"
                   : kind == CHUNK_FINISH ? "\"delta\":{}"
                                          : "\"delta\":{\"content\":");
    else
        sb_puts(b, "\"text\":");
    if (kind == CHUNK_TEXT || (!r->p.chat && kind != CHUNK_TEXT)) sb_json_str(b, text, n);
    if (r->p.chat && kind == CHUNK_TEXT) sb_puts(b, "}");
    sb_puts(b, ",\"logprobs\":null,\"finish_reason\":");
    if (kind == CHUNK_FINISH)
        sb_printf(b, "\"%s\"", r->finish);
    else
        sb_puts(b, "null");
    sb_puts(b, "}]}\n\n");
}

void serve_models_body(sbuf *b, const serve_opts *o) {
    sb_puts(b, "{\"object\":\"list\",\"data\":[{\"id\":");
    sb_json_str(b, o->name, strlen(o->name));
    sb_puts(b, ",\"object\":\"model\",\"created\":0,\"owned_by\":\"entmaxkv\"}]}");
}

/*
 * http_page — the chat page served at `/`: one static HTML file with inline CSS and JS, no
 * external resources (not even a favicon: an empty data: icon). It reads the model name from
 * /v1/models, sends the conversation (after the optional system prompt) to
 * /v1/chat/completions with stream: true, shows the reply as the chunks arrive and the decode
 * speed (tokens/s, from the streamed logprob entries) when it is done. Enter sends, Shift+Enter
 * is a new line; Stop aborts the request (the server releases the session when the client goes
 * away) and keeps what came; New chat forgets the conversation.
 *
 * The page is kept as lines joined once at first use: one literal of its length is past what
 * ISO C requires compilers to take (-Woverlength-strings).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "http_impl.h"

static const char *const page_lines[] = {
    "<!doctype html>\n",
    "<html lang=\"en\"><head><meta charset=\"utf-8\"><title>kvshard chat</title>\n",
    "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n",
    "<link rel=\"icon\" href=\"data:,\">\n",
    "<style>\n",
    "body{font-family:system-ui,sans-serif;max-width:46rem;margin:1rem auto;padding:0 1rem;color:#222}\n",
    "header{display:flex;justify-content:space-between;align-items:baseline;border-bottom:1px solid #ccc;gap:1rem}\n",
    "header h1{margin:.3rem 0}\n",
    "#log{min-height:12rem;margin:1rem 0}\n",
    ".msg{white-space:pre-wrap;padding:.5rem .75rem;margin:.4rem 0;border-radius:.4rem}\n",
    ".user{background:#e8f0fe}.assistant{background:#f1f3f4}\n",
    "form{display:flex;gap:.5rem;align-items:flex-end}textarea{flex:1;font:inherit}\n",
    "#input{height:3.5rem}#system{width:100%;height:2.5rem;box-sizing:border-box}\n",
    "#status{color:#666;font-size:.9rem}\n",
    "details{margin:.5rem 0}\n",
    "</style></head><body>\n",
    "<header><h1>kvshard</h1><span>model: <b id=\"model\">?</b></span><button id=\"new\" type=\"button\">New chat</button></header>\n",
    "<details id=\"settings\"><summary>System prompt and sampling</summary>\n",
    "<textarea id=\"system\" placeholder=\"System prompt (optional), used from the next message\"></textarea>\n",
    "<p>max tokens <input id=\"max\" type=\"number\" value=\"256\" min=\"1\" style=\"width:5rem\">\n",
    "temperature <input id=\"temp\" type=\"number\" value=\"0.7\" step=\"0.1\" min=\"0\" max=\"2\" style=\"width:4rem\"></p>\n",
    "</details>\n",
    "<div id=\"log\"></div>\n",
    "<form id=\"form\"><textarea id=\"input\" placeholder=\"Say something (Enter sends, Shift+Enter for a new line)\"></textarea>\n",
    "<button id=\"send\" type=\"submit\">Send</button><button id=\"stop\" type=\"button\" disabled>Stop</button></form>\n",
    "<p id=\"status\"></p>\n",
    "<script>\n",
    "'use strict';\n",
    "let history = [];\n",
    "let running = null; // the AbortController of the reply being streamed\n",
    "const $ = (id) => document.getElementById(id);\n",
    "let key = localStorage.getItem('kvshard-api-key') || ''; // kvshard api --api-key: asked for on a 401\n",
    "const hdrs = () => Object.assign({'Content-Type': 'application/json'}, key ? {Authorization: 'Bearer ' + key} : {});\n",
    "fetch('/v1/models', {headers: hdrs()}).then(r => r.json()).then(j => { $('model').textContent = j.data[0].id; })\n",
    "  .catch(() => { $('model').textContent = '(unavailable)'; });\n",
    "function bubble(role, text) {\n",
    "  const d = document.createElement('div');\n",
    "  d.className = 'msg ' + role; d.textContent = text; $('log').appendChild(d); return d;\n",
    "}\n",
    "function busy(on) { $('send').disabled = on; $('stop').disabled = !on; }\n",
    "$('input').addEventListener('keydown', (ev) => {\n",
    "  if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $('form').requestSubmit(); }\n",
    "});\n",
    "$('stop').addEventListener('click', () => { if (running) running.abort(); });\n",
    "$('new').addEventListener('click', () => {\n",
    "  if (running) running.abort();\n",
    "  history = []; $('log').textContent = ''; $('status').textContent = ''; $('input').focus();\n",
    "});\n",
    "$('form').addEventListener('submit', async (ev) => {\n",
    "  ev.preventDefault();\n",
    "  const text = $('input').value.trim();\n",
    "  if (!text || running) return;\n",
    "  $('input').value = '';\n",
    "  history.push({role: 'user', content: text}); bubble('user', text);\n",
    "  const out = bubble('assistant', '');\n",
    "  const ctl = new AbortController(); running = ctl; busy(true);\n",
    "  const sys = $('system').value.trim();\n",
    "  const messages = sys ? [{role: 'system', content: sys}].concat(history) : history;\n",
    "  const t0 = performance.now(); let first = 0, tokens = 0, reply = '';\n",
    "  try {\n",
    "    const ask = () => fetch('/v1/chat/completions', {method: 'POST', headers: hdrs(),\n",
    "      signal: ctl.signal,\n",
    "      body: JSON.stringify({messages, stream: true, logprobs: true, max_tokens: +$('max').value,\n",
    "                            temperature: +$('temp').value})});\n",
    "    let res = await ask();\n",
    "    if (res.status === 401 && (key = prompt('API key') || '')) { localStorage.setItem('kvshard-api-key', key); res = await ask(); }\n",
    "    if (!res.ok) { const j = await res.json(); throw new Error(j.error ? j.error.message : res.statusText); }\n",
    "    const reader = res.body.getReader(); const dec = new TextDecoder(); let buf = '';\n",
    "    for (;;) {\n",
    "      const {value, done} = await reader.read(); if (done) break;\n",
    "      buf += dec.decode(value, {stream: true});\n",
    "      let i;\n",
    "      while ((i = buf.indexOf('\\n\\n')) >= 0) {\n",
    "        const ev = buf.slice(0, i); buf = buf.slice(i + 2);\n",
    "        if (!ev.startsWith('data: ')) continue;\n",
    "        const data = ev.slice(6); if (data === '[DONE]') continue;\n",
    "        const j = JSON.parse(data);\n",
    "        if (j.error) throw new Error(j.error.message);\n",
    "        const c = j.choices && j.choices[0]; if (!c) continue;\n",
    "        if (c.logprobs && c.logprobs.content) tokens += c.logprobs.content.length;\n",
    "        if (c.delta && c.delta.content) { if (!first) first = performance.now(); reply += c.delta.content; out.textContent = reply; }\n",
    "      }\n",
    "    }\n",
    "    const secs = (performance.now() - (first || t0)) / 1000;\n",
    "    $('status').textContent = tokens + ' tokens, ' + (secs > 0 ? (tokens / secs).toFixed(1) : '-') + ' tokens/s, first token after ' +\n",
    "      ((first || performance.now()) - t0).toFixed(0) + ' ms';\n",
    "    out.dataset.done = '1';\n",
    "  } catch (e) {\n",
    "    if (e.name === 'AbortError') { out.textContent = reply + ' [stopped]'; out.dataset.done = 'stopped'; $('status').textContent = 'stopped'; }\n",
    "    else { out.textContent = reply + ' [error: ' + e.message + ']'; out.dataset.done = 'error'; }\n",
    "  }\n",
    "  // What was said stays in the conversation, a stopped reply's part included.\n",
    "  if (history.length && history[history.length - 1].role === 'user' && reply) history.push({role: 'assistant', content: reply});\n",
    "  if (running === ctl) { running = null; busy(false); }\n",
    "});\n",
    "</script></body></html>\n",
};

static char *page;
static size_t page_len;
static pthread_once_t page_once = PTHREAD_ONCE_INIT;

static void page_build(void) {
    size_t n = 0;
    for (size_t i = 0; i < sizeof page_lines / sizeof page_lines[0]; i++) n += strlen(page_lines[i]);
    if (!(page = malloc(n + 1))) return;
    for (size_t i = 0; i < sizeof page_lines / sizeof page_lines[0]; i++) {
        size_t l = strlen(page_lines[i]);
        memcpy(page + page_len, page_lines[i], l);
        page_len += l;
    }
    page[page_len] = 0;
}

const char *http_page(size_t *len) {
    pthread_once(&page_once, page_build);
    *len = page ? page_len : 0;
    return page ? page : "";
}

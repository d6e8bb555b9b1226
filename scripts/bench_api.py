#!/usr/bin/env python3
"""Measures `kvshard api` from the client side (standard library only).

  bench_api.py stream URL PROMPT N        one streamed /v1/completions (greedy): prints JSON with
                                          ttft_ms (request sent -> first text chunk) and decode_tok_s
                                          (tokens after the first / time after the first)
  bench_api.py turns URL N_TURNS N        a chat of N_TURNS user turns (long system prompt), each
                                          reply N tokens, the whole history re-sent each turn: prints
                                          per-turn ttft_ms, cached prompt tokens and the total time
"""
import http.client, json, sys, time, urllib.parse

def post_stream(url, path, body):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:300]}")
    first, last, n, text, usage = None, None, 0, "", None
    buf = b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                continue
            j = json.loads(ev[6:])
            if j.get("usage"):
                usage = j["usage"]
            for ch in j.get("choices", []):
                lp = (ch.get("logprobs") or {})
                k = len(lp.get("content") or lp.get("tokens") or [])
                piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                if k:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    last = now
                    n += k
                if piece:
                    text += piece
    c.close()
    return t0, first, last, n, text, usage

def stream(url, prompt, n):
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "logprobs": 0}
    t0, first, last, k, text, _ = post_stream(url, "/v1/completions", body)
    out = {"ttft_ms": round((first - t0) * 1e3, 3), "tokens": k,
           "decode_tok_s": round((k - 1) / (last - first), 2) if k > 1 and last > first else None}
    print(json.dumps(out))

def turns(url, n_turns, n):
    system = " ".join(f"Rule {i}: answer politely and keep the story about animal number {i}." for i in range(40))
    msgs = [{"role": "system", "content": system}]
    rows, t_all = [], time.perf_counter()
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"Turn {t + 1}: tell me more about the animals."})
        body = {"messages": msgs, "max_tokens": n, "temperature": 0, "stream": True, "logprobs": True,
                "stream_options": {"include_usage": True}}
        t0, first, last, k, text, usage = post_stream(url, "/v1/chat/completions", body)
        rows.append({"turn": t + 1, "prompt_tokens": usage["prompt_tokens"],
                     "cached": usage["prompt_tokens_details"]["cached_tokens"],
                     "ttft_ms": round((first - t0) * 1e3, 2), "total_ms": round((time.perf_counter() - t0) * 1e3, 2)})
        msgs.append({"role": "assistant", "content": text})
    print(json.dumps({"turns": rows, "all_ms": round((time.perf_counter() - t_all) * 1e3, 1)}))

if __name__ == "__main__":
    if sys.argv[1] == "stream":
        stream(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        turns(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

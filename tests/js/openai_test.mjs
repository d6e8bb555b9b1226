// Drives `kvshard api` with the official `openai` Node.js client: chat completions (plain and
// streamed) and a completion must give exactly the text `kvshard run` gives for the same prompt,
// seed and sampling; models list; an unsupported field is a 400 naming it.
// Env: KVS_BIN (kvshard), KVS_MODEL (the GGUF the servers run), KVS_API_URLS (JSON [{name,url}]).
import OpenAI from 'openai';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const bin = process.env.KVS_BIN, model = process.env.KVS_MODEL;
const targets = JSON.parse(process.env.KVS_API_URLS);
let failures = 0;
function check(cond, what, detail) {
  if (!cond) { failures++; console.error(`FAIL ${what}${detail !== undefined ? ': ' + JSON.stringify(detail) : ''}`); }
}

function runText(prompt, n, temp, seed) {
  const out = execFileSync(bin, ['run', '-m', model, '-p', prompt, '-n', String(n), '--temp', String(temp), '--seed',
    String(seed), '--top-k', '0', '--top-p', '1', '-t', '1', '--json']);
  return JSON.parse(out.toString()).text;
}

const messages = [
  { role: 'system', content: 'You tell short stories.' },
  { role: 'user', content: 'Tell me about a brave little cat' },
];
// References: `kvshard chat --messages` greedy (its sampler's draw sequence differs from the
// per-position draw that `kvshard run` and the API use, so only greedy is comparable), and
// `kvshard run` on the formatted conversation (`kvshard chat --format-only`) with temperature.
const dir = mkdtempSync(join(tmpdir(), 'kvs-chat-'));
function chatCli(args) {
  writeFileSync(join(dir, 'm.json'), JSON.stringify(messages));
  return execFileSync(bin, ['chat', '-m', model, '--messages', join(dir, 'm.json'), ...args],
    { stdio: ['ignore', 'pipe', 'ignore'] }).toString();
}
const chatOut = chatCli(['-n', '24', '--temp', '0', '-t', '1']);
const wantChatGreedy = chatOut.endsWith('\n') ? chatOut.slice(0, -1) : chatOut;
const wantChat = runText(chatCli(['--format-only']), 24, 0.8, 11);
rmSync(dir, { recursive: true, force: true });
const wantCompletion = runText('Once upon a time', 16, 0, 1);

for (const { name, url } of targets) {
  const client = new OpenAI({ baseURL: url + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 60000 });
  const models = await client.models.list();
  check(models.data.length === 1 && typeof models.data[0].id === 'string', `${name}: models`, models.data);

  const r = await client.chat.completions.create({ model: models.data[0].id, messages, max_tokens: 24, temperature: 0.8,
    top_p: 1, seed: 11 });
  check(r.object === 'chat.completion', `${name}: object`, r.object);
  const g = await client.chat.completions.create({ model: models.data[0].id, messages, max_tokens: 24, temperature: 0 });
  check(g.choices[0].message.content === wantChatGreedy, `${name}: greedy chat text equals kvshard chat`,
    { api: g.choices[0].message.content, chat: wantChatGreedy });
  check(r.choices[0].message.content === wantChat, `${name}: chat text equals kvshard run on the formatted chat`,
    { api: r.choices[0].message.content, run: wantChat });
  check(['stop', 'length'].includes(r.choices[0].finish_reason), `${name}: finish_reason`, r.choices[0].finish_reason);
  check(r.usage.completion_tokens > 0 && r.usage.total_tokens === r.usage.prompt_tokens + r.usage.completion_tokens,
    `${name}: usage`, r.usage);

  const stream = await client.chat.completions.create({ model: models.data[0].id, messages, max_tokens: 24,
    temperature: 0.8, top_p: 1, seed: 11, stream: true, stream_options: { include_usage: true } });
  let text = '', chunks = 0, finish = null, usage = null;
  for await (const c of stream) {
    chunks++;
    if (c.usage) usage = c.usage;
    const ch = c.choices[0];
    if (!ch) continue;
    text += ch.delta?.content ?? '';
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  check(text === wantChat, `${name}: streamed chat text equals kvshard run on the formatted chat`, { api: text, run: wantChat });
  check(chunks > 2 && finish !== null && usage && usage.completion_tokens === r.usage.completion_tokens,
    `${name}: stream shape`, { chunks, finish, usage });

  const c = await client.completions.create({ model: models.data[0].id, prompt: 'Once upon a time', max_tokens: 16,
    temperature: 0 });
  check(c.choices[0].text === wantCompletion, `${name}: completion equals kvshard run`,
    { api: c.choices[0].text, run: wantCompletion });

  try {
    await client.chat.completions.create({ model: 'x', messages, n: 2 });
    check(false, `${name}: n=2 must fail`);
  } catch (e) {
    check(e.status === 400 && e.param === 'n' && e.code === 'unsupported_parameter', `${name}: n=2 error`,
      { status: e.status, param: e.param, code: e.code });
  }
  console.log(`${name}: checked (chat ${JSON.stringify(text.slice(0, 40))}...)`);
}
console.log(failures ? `openai_test: ${failures} failures` : 'openai_test: ok');
process.exit(failures ? 1 : 0);

// Loads the chat page of a running `kvshard api` in headless Chromium and uses it as a person
// would: Enter sends and Shift+Enter is a new line, a reply streams in with the model name and
// the tokens/s line, the system prompt goes first in the next request with the conversation
// kept, Stop ends a reply mid-stream (the server sees the client go away), New chat forgets the
// conversation; no request fails (the favicon included) and none leaves the server. Saves a
// screenshot. Env: KVS_API_URL, KVS_CHROMIUM (executable), KVS_SCREENSHOT (png path),
// KVS_PROFILE (a fresh, empty user-data dir).
//
// The page is loaded through a small proxy in this process so that Stop is tested without
// timing luck: in hold mode the proxy passes a reply's stream up to its first text and holds the
// rest until the browser closes the request.
import http from 'node:http';
import { chromium } from 'playwright-core';

const api = new URL(process.env.KVS_API_URL);
let hold = false, aborted = false;
const proxy = http.createServer((req, res) => {
  const up = http.request({ host: api.hostname, port: api.port, path: req.url, method: req.method, headers: req.headers },
    (ur) => {
      res.writeHead(ur.statusCode, ur.headers);
      if (!(hold && req.url === '/v1/chat/completions')) { ur.pipe(res); return; }
      let passed = false;
      ur.on('data', (chunk) => {
        if (passed) return;
        res.write(chunk);
        if (/"content":"[^"]/.test(chunk.toString())) { passed = true; ur.pause(); }
      });
      res.on('close', () => { aborted = true; up.destroy(); });
    });
  up.on('error', () => res.destroy());
  req.pipe(up);
});
await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve));
const base = `http://127.0.0.1:${proxy.address().port}`;

const ctx = await chromium.launchPersistentContext(process.env.KVS_PROFILE, {
  executablePath: process.env.KVS_CHROMIUM,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
    '--disable-sync', '--no-first-run'],
});
let failures = 0;
function check(cond, what, detail) {
  if (!cond) { failures++; console.error(`FAIL ${what}: ${JSON.stringify(detail)}`); }
}
try {
  const page = ctx.pages()[0] || await ctx.newPage();
  const external = [], failed = [], bodies = [];
  page.on('request', (r) => {
    if (!r.url().startsWith(base)) external.push(r.url());
    if (r.url().endsWith('/v1/chat/completions')) bodies.push(JSON.parse(r.postData()));
  });
  page.on('response', (r) => { if (r.status() >= 400) failed.push(`${r.status()} ${r.url()}`); });
  await page.goto(base + '/');
  await page.waitForFunction(() => document.getElementById('model').textContent !== '?', null, { timeout: 30000 });
  const modelName = await page.textContent('#model');
  check(modelName === 'stories260K', 'model name shown', modelName);

  // Enter sends.
  await page.fill('#input', 'Tell me a story about a dog');
  await page.press('#input', 'Enter');
  await page.waitForSelector('.assistant[data-done]', { timeout: 60000 });
  const done = await page.getAttribute('.assistant', 'data-done');
  const reply = await page.textContent('.assistant');
  const status = await page.textContent('#status');
  check(done === '1', 'reply finished without error', { done, reply });
  check(reply.trim().length > 0, 'a reply appeared', reply);
  check(/tokens\/s/.test(status), 'tokens/s shown', status);

  // Shift+Enter is a new line, not a send.
  await page.fill('#input', 'line one');
  await page.press('#input', 'Shift+Enter');
  await page.type('#input', 'line two');
  check((await page.inputValue('#input')) === 'line one\nline two', 'Shift+Enter adds a line', await page.inputValue('#input'));
  check(bodies.length === 1 && (await page.$$('.user')).length === 1, 'Shift+Enter sent nothing', bodies.length);

  // The system prompt goes first, with the conversation so far.
  await page.click('#settings summary');
  await page.fill('#system', 'You are a pirate.');
  await page.press('#input', 'Enter');
  await page.waitForSelector('.assistant:nth-of-type(4)[data-done]', { timeout: 60000 });
  const b2 = bodies[1] || { messages: [] };
  check(b2.messages.length === 4 && b2.messages[0].role === 'system' && b2.messages[0].content === 'You are a pirate.' &&
        b2.messages[3].content === 'line one\nline two', 'system prompt first, conversation kept', b2.messages);

  // Stop, mid-reply: the proxy holds the stream after its first text.
  hold = true;
  await page.fill('#input', 'And then?');
  await page.press('#input', 'Enter');
  await page.waitForFunction(() => {
    const a = document.querySelectorAll('.assistant'); return a.length === 3 && a[2].textContent.length > 0;
  }, null, { timeout: 60000 });
  check(await page.isEnabled('#stop'), 'Stop enabled during a reply', null);
  await page.click('#stop');
  await page.waitForSelector('.assistant:nth-of-type(6)[data-done]', { timeout: 30000 });
  const stopped = await page.getAttribute('.assistant:nth-of-type(6)', 'data-done');
  check(stopped === 'stopped', 'Stop ends the reply', stopped);
  for (let i = 0; i < 100 && !aborted; i++) await new Promise((r) => setTimeout(r, 50));
  check(aborted, 'the request was closed (the server releases the session)', aborted);
  check(await page.isEnabled('#send') && !(await page.isEnabled('#stop')), 'Send back after Stop', null);
  hold = false;

  // New chat: the next request carries only the system prompt and the new message.
  await page.click('#new');
  check((await page.$$('.msg')).length === 0, 'New chat clears the page', null);
  await page.fill('#input', 'Hello');
  await page.press('#input', 'Enter');
  await page.waitForSelector('.assistant[data-done]', { timeout: 60000 });
  const b4 = bodies[3] || { messages: [] };
  check(b4.messages.length === 2 && b4.messages[1].content === 'Hello', 'New chat forgets the conversation', b4.messages);

  check(failed.length === 0, 'no request failed (favicon included)', failed);
  check(external.length === 0, 'no request leaves the server (no CDN)', external);
  await page.screenshot({ path: process.env.KVS_SCREENSHOT, fullPage: true });
  console.log(`page_test: reply ${JSON.stringify(reply.slice(0, 60))}, status ${JSON.stringify(status)}`);
} finally {
  await ctx.close();
  proxy.close();
}
console.log(failures ? `page_test: ${failures} failures` : 'page_test: ok');
process.exit(failures ? 1 : 0);

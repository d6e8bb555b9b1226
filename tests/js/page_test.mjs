// Loads the chat page of a running `kvshard api` in headless Chromium, sends one message and
// checks that a streamed reply appears with the model name and the tokens/s line; saves a
// screenshot. Env: KVS_API_URL, KVS_CHROMIUM (executable), KVS_SCREENSHOT (png path),
// KVS_PROFILE (a fresh, empty user-data dir).
import { chromium } from 'playwright-core';

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
  const external = [];
  page.on('request', r => { if (!r.url().startsWith(process.env.KVS_API_URL)) external.push(r.url()); });
  await page.goto(process.env.KVS_API_URL + '/');
  await page.waitForFunction(() => document.getElementById('model').textContent !== '?', null, { timeout: 30000 });
  const modelName = await page.textContent('#model');
  check(modelName === 'stories260K', 'model name shown', modelName);
  await page.fill('#input', 'Tell me a story about a dog');
  await page.click('#send');
  await page.waitForSelector('.assistant[data-done]', { timeout: 60000 });
  const done = await page.getAttribute('.assistant', 'data-done');
  const reply = await page.textContent('.assistant');
  const status = await page.textContent('#status');
  check(done === '1', 'reply finished without error', { done, reply });
  check(reply.trim().length > 0, 'a reply appeared', reply);
  check(/tokens\/s/.test(status), 'tokens/s shown', status);
  check(external.length === 0, 'no request leaves the server (no CDN)', external);
  await page.screenshot({ path: process.env.KVS_SCREENSHOT, fullPage: true });
  console.log(`page_test: reply ${JSON.stringify(reply.slice(0, 60))}, status ${JSON.stringify(status)}`);
} finally {
  await ctx.close();
}
console.log(failures ? `page_test: ${failures} failures` : 'page_test: ok');
process.exit(failures ? 1 : 0);

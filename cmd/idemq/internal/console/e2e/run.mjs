// The browser test of `idemq console`: Playwright (playwright-core) driving
// Debian's chromium through the pages an operator uses. Run by
// console_test.go as: node run.mjs <console url> <token> <screenshot dir>.
import { chromium } from "playwright-core";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const [base, token, out] = process.argv.slice(2);
if (!base || !token || !out) {
  console.error("usage: node run.mjs <console url> <token> <screenshot dir>");
  process.exit(2);
}
const kafkaTopic = process.env.E2E_KAFKA_TOPIC || "";

const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), "idemq-chromium-"));
const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath: "/usr/bin/chromium",
  headless: true,
  args: [
    "--headless", "--no-sandbox", "--disable-gpu",
    // Without these Chromium phones home, and those connections are refused here.
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
  ],
  viewport: { width: 1440, height: 900 },
});

const problems = [];
let step = "start";
const page = context.pages()[0] || (await context.newPage());
page.setDefaultTimeout(30000);
page.on("console", (m) => {
  if (m.type() === "error") problems.push(`${step}: console error: ${m.text()}`);
});
page.on("pageerror", (e) => problems.push(`${step}: page error: ${e.message}`));
page.on("dialog", async (d) => {
  // The only dialog the console opens is the replay's confirm(); anything
  // else (an alert) would be an injected script running.
  if (d.type() === "confirm" && d.message().startsWith("Run the ")) {
    await d.accept();
  } else {
    problems.push(`${step}: unexpected ${d.type()} dialog: ${d.message()}`);
    await d.dismiss();
  }
});
// Nothing may load from anywhere but the console.
page.on("request", (r) => {
  if (!r.url().startsWith(base) && !r.url().startsWith("data:")) problems.push(`${step}: request to ${r.url()}`);
});

function check(cond, msg) {
  if (!cond) throw new Error(`${step}: ${msg}`);
}

async function shot(name) {
  await page.screenshot({ path: path.join(out, `${name}.png`), fullPage: true });
  console.log(`ok ${step} -> ${name}.png`);
}

async function text(sel) {
  return (await page.locator(sel).first().textContent()) ?? "";
}

try {
  step = "anonymous";
  // With tokens, no page is served before the sign-in: a GET lands on it,
  // and the dead letters are nowhere on it.
  await page.goto(base + "/dead-letters");
  check(/\/login\?next=%2Fdead-letters$/.test(page.url()), `an anonymous GET landed on ${page.url()}`);
  const login = await text("main");
  check(!login.includes("declined") && login.includes("name:secret"), `the sign-in page: ${login}`);
  await shot("sign-in");

  step = "sign in";
  // The token as it was configured: name:secret.
  await page.fill('input[name="token"]', token);
  await page.click('main button[type="submit"]');
  await page.waitForURL(/\/dead-letters$/);
  check((await text("body > header .who")).includes("signed in as e2e"), "not signed in");

  step = "overview";
  const resp = await page.goto(base + "/");
  check(resp.ok(), `status ${resp.status()}`);
  const csp = resp.headers()["content-security-policy"] || "";
  check(csp.includes("default-src 'self'") && !csp.includes("unsafe-inline"), `CSP ${csp}`);
  const consumers = await text("#consumers");
  check(consumers.includes("ledger") && consumers.includes("pay-1") && consumers.includes("shipping"), `consumers: ${consumers}`);
  check((await page.locator("main p.error").count()) === 0, `an error on the overview: ${await text("main")}`);
  check((await text("#http-keys")) === "1", "the HTTP key table's size");
  const dlqs = await text("#dlqs");
  check(dlqs.includes(process.env.E2E_RABBIT_QUEUE || ".dlq") && dlqs.includes(kafkaTopic), `queues: ${dlqs}`);
  await shot("overview");

  step = "charts";
  // Inline SVG drawn by the server: visible, with the buckets of their
  // window and bars above zero, coloured by the stylesheet's classes.
  const charts = {
    "applied-hour": 60, "applied-day": 24, "duplicates-hour": 60, "duplicates-day": 24,
    "dead-letters-day": 24, "outbox-hour": 60, "outbox-day": 24,
  };
  for (const [id, buckets] of Object.entries(charts)) {
    const fig = page.locator(`figure#${id}`);
    check(await fig.isVisible(), `${id} is not visible`);
    const svg = fig.locator("svg");
    check(await svg.isVisible(), `${id}: no visible SVG`);
    check(Number(await fig.getAttribute("data-buckets")) === buckets, `${id}: ${await fig.getAttribute("data-buckets")} buckets, want ${buckets}`);
    check((await svg.locator("g.bar").count()) === buckets, `${id}: not ${buckets} bars`);
    check(Number(await fig.getAttribute("data-total")) > 0, `${id}: no data`);
    const tall = await svg.locator("g.bar rect").evaluateAll((rs) => rs.filter((r) => r.getBoundingClientRect().height > 0).length);
    check(tall > 0, `${id}: no bar drawn above zero`);
    check((await svg.locator("title").first().textContent()).length > 0, `${id}: no title`);
    check((await svg.getAttribute("role")) === "img" && (await svg.getAttribute("aria-labelledby")).includes(`${id}-title`), `${id}: not labelled`);
  }
  const fill = await page.locator("figure#applied-hour rect.s0").first().evaluate((e) => getComputedStyle(e).fill);
  check(fill === "rgb(36, 87, 197)", `the first series' fill: ${fill}`);
  check((await page.locator("figure#applied-hour ul.legend li").count()) === 2, "the applied chart does not stack ledger and shipping");
  // The dead letters of the seed failed an hour and more ago: none in the
  // last hour, said so, with its bars at zero.
  const dlHour = page.locator("figure#dead-letters-hour");
  check((await dlHour.getAttribute("data-empty")) === "true" && (await dlHour.textContent()).includes("no data in the last hour"), "the empty dead-letter chart");
  check((await text("figure#outbox-hour")).includes("Not yet due"), "the outbox chart's note");
  // The overview down to its charts, for the docs.
  const box = await page.locator("#activity").boundingBox();
  await page.screenshot({ path: path.join(out, "overview-charts.png"), fullPage: true, clip: { x: 0, y: 0, width: 1440, height: Math.ceil(box.y + box.height + 8) } });
  console.log(`ok ${step} -> overview-charts.png`);

  step = "consumer";
  await page.locator('#consumers a[href="/consumer?name=ledger"]').click();
  await page.waitForURL(/\/consumer\?name=ledger/);
  check((await text("#consumer")).includes("ledger"), "the consumer page");
  check(Number(await page.locator("figure#applied-day").getAttribute("data-total")) > 10000, "ledger's day of rows");
  check((await page.locator("figure#applied-day ul.legend").count()) === 0, "one consumer's chart is not stacked");
  check(Number(await page.locator("figure#dead-letters-day").getAttribute("data-total")) === 6, "ledger's six dead letters");
  await shot("consumer");

  step = "dead letters";
  await page.click("nav >> text=Dead letters");
  await page.waitForURL(/\/dead-letters/);
  const summary = await text("#summary");
  check(summary.startsWith("8 dead letters in 5 groups"), `summary: ${summary}`);
  check((await page.locator("#groups tbody tr").count()) === 5, "not 5 group rows");
  await shot("dead-letters");

  step = "filter";
  await page.selectOption('select[name="class"]', "timeout");
  await page.click('form.filters button[type="submit"]');
  await page.waitForURL(/class=timeout/);
  check((await text("#summary")).startsWith("2 dead letters in 1 groups"), "the timeout filter");
  check((await text("#groups")).includes("shipping"), "the Kafka group");
  await page.goto(base + "/dead-letters");

  step = "injection group";
  await page.locator("#groups tr", { hasText: "panic" }).locator("td.num a").click();
  await page.waitForURL(/\/group\?/);
  const body = await text("pre.body");
  check(body.includes('<script>alert("body")</script>'), `the HTML body is not shown as text: ${body}`);
  check((await text("table.headers")).includes('<script>alert("header")</script>'), "the HTML header is not shown as text");
  check((await page.locator("script").count()) === 1, "a script element was injected");
  check((await page.locator("main img").count()) === 0, "an img element was injected");
  await shot("group-injection");

  step = "binary group";
  await page.goto(base + "/dead-letters");
  await page.locator("#groups tr", { hasText: "too-large" }).locator("td.num a").click();
  await page.waitForURL(/\/group\?/);
  check((await text("article.envelope summary >> nth=2")).includes("binary"), "the binary body is not hex");
  check((await text("pre.body-binary")).includes("89 50 4e 47"), "no hex dump");

  step = "forged group";
  await page.goto(base + "/dead-letters");
  await page.locator("#groups tr", { hasText: "refund" }).locator("td.num a").click();
  await page.waitForURL(/\/group\?/);
  check((await text("article.envelope header")).includes("signature bad signature"), "the forged envelope is not flagged");
  await page.click("#dry-run-group");
  await page.waitForURL(/\/dry-run\?/);
  const unverified = page.locator("#counts li", { has: page.locator('[data-count="unverified"]') });
  check((await unverified.textContent()).trim().startsWith("1"), `the forged dry run: ${await unverified.textContent()}`);
  check((await unverified.getAttribute("class")) === "tile-bad", `the unverified tile: ${await unverified.getAttribute("class")}`);
  check((await unverified.locator("strong").evaluate((e) => getComputedStyle(e).color)) === "rgb(179, 38, 30)", "an unverified count is not red");
  await shot("dry-run-forged");

  step = "group";
  await page.goto(base + "/dead-letters");
  await page.locator("#groups tr", { hasText: "declined" }).locator("td.num a").click();
  await page.waitForURL(/\/group\?/);
  check((await text("#group-total")) === "3", "not 3 declined cards");
  check((await page.locator("article.envelope .sig-ok").count()) === 3, "signatures not verified");
  check((await text("ol.timeline")).includes("i/o timeout"), "no failure history");
  await shot("group");

  step = "dry run";
  await page.click("#dry-run-group");
  await page.waitForURL(/\/dry-run\?/);
  const count = async (k) => Number(await text(`[data-count="${k}"]`));
  check((await count("already-applied")) === 1, "already-applied");
  check((await count("will-apply")) === 2, "will-apply");
  check((await count("fingerprint-mismatch")) === 0, "mismatch");
  check((await count("unverified")) === 0, "unverified");
  // A zero is calm: only a bad outcome that happened takes a warning colour.
  const tile = (k) => page.locator("#counts li", { has: page.locator(`[data-count="${k}"]`) });
  for (const k of ["fingerprint-mismatch", "beyond-horizon", "unverified", "missing-id", "truncated"]) {
    check((await tile(k).getAttribute("class")) === "tile-zero", `the zero ${k} tile: ${await tile(k).getAttribute("class")}`);
  }
  check((await tile("already-applied").getAttribute("class")) === "tile-ok", "the already-applied tile");
  const zeroColour = await tile("unverified").locator("strong").evaluate((e) => getComputedStyle(e).color);
  check(zeroColour !== "rgb(179, 38, 30)", `a zero unverified count is red: ${zeroColour}`);
  check(await page.locator("#confirm").isVisible(), "no confirmation");
  await shot("dry-run");

  step = "replay";
  await page.check('input[name="action"][value="replay"]');
  await page.click("#run-action");
  await page.waitForURL(/\/jobs\//);
  await page.waitForFunction(() => document.getElementById("job-outcome")?.textContent === "done", null, { timeout: 60000 });
  check((await text('dd[data-k="republished"]')) === "2", "republished");
  check((await text('dd[data-k="skipped_already_applied"]')) === "1", "skipped");
  await shot("replay");

  step = "audit";
  await page.click("nav >> text=Audit");
  await page.waitForURL(/\/audit/);
  const row = page.locator("#audit tbody tr").first();
  const audit = (await row.textContent()) ?? "";
  check(audit.includes("e2e") && audit.includes("replay") && audit.includes("done"), `audit row: ${audit}`);
  // In words; the JSON is behind a click.
  check(audit.includes("republished 2, skipped 1 as already applied") && audit.includes("3 selected, 2 would apply, 1 already applied"),
    `the audit row's words: ${audit}`);
  const raw = row.locator("details.raw pre.json").last();
  check(!(await raw.isVisible()), "the result's JSON is shown before a click");
  await shot("audit");
  await row.locator("details.raw summary").last().click();
  check(await raw.isVisible(), "a click does not show the result's JSON");
  check(((await raw.textContent()) ?? "").includes('"republished": 2'), `the result's JSON: ${await raw.textContent()}`);
  await shot("audit-json");

  step = "lookup";
  await page.click("nav >> text=Lookup");
  await page.fill('#lookup-message input[name="consumer"]', "ledger");
  await page.fill('#lookup-message input[name="id"]', "pay-1");
  await page.click('#lookup-message button[type="submit"]');
  await page.waitForURL(/id=pay-1/);
  const found = await text("#lookup-result");
  check(found.includes("Applied") && found.includes("1 in rabbitmq") === false, `pay-1: ${found}`);
  await page.fill('#lookup-key input[name="key"]', "order-7f3a");
  await page.click('#lookup-key button[type="submit"]');
  await page.waitForURL(/key=order-7f3a/);
  check((await text("#key-result")).includes("201"), "the HTTP key's stored response");
  await page.goto(base + "/lookup?consumer=ledger&id=pay-1&key=order-7f3a");
  await shot("lookup");

  step = "forged left alone";
  await page.goto(base + "/dead-letters");
  check((await text("#summary")).startsWith("5 dead letters in 4 groups"), `after the replay: ${await text("#summary")}`);
} catch (e) {
  problems.push(String(e && e.stack ? e.stack : e));
  try { await page.screenshot({ path: path.join(out, "failure.png"), fullPage: true }); } catch {}
}

await context.close();
fs.rmSync(userDataDir, { recursive: true, force: true });
if (problems.length > 0) {
  console.error("FAIL\n" + problems.join("\n"));
  process.exit(1);
}
console.log("PASS");

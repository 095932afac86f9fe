import { execFileSync } from "node:child_process";
import {
  createReadStream,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  readlinkSync,
  rmSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { Readable } from "node:stream";
import { afterAll, describe, expect, it } from "vitest";
import { extractTar, linkInside, packTar, scanTree } from "./tar.ts";

const work = mkdtempSync(path.join(tmpdir(), "dc-tar-"));
afterAll(() => rmSync(work, { recursive: true, force: true }));
let n = 0;
const fresh = () => {
  const d = path.join(work, String(n++));
  mkdirSync(d);
  return d;
};

const LONG_DIR = `${"d".repeat(120)}/${"e".repeat(120)}`;
const LONGER = `${"x".repeat(200)}/${"y".repeat(200)}`;

function sample(): string {
  const src = fresh();
  mkdirSync(path.join(src, "sub/deeper"), { recursive: true });
  mkdirSync(path.join(src, "empty"));
  mkdirSync(path.join(src, LONG_DIR), { recursive: true });
  mkdirSync(path.join(src, path.dirname(LONGER)), { recursive: true });
  writeFileSync(path.join(src, "greeting"), "hello\n");
  writeFileSync(path.join(src, "sub/deeper/zero"), "");
  writeFileSync(path.join(src, "sub/big"), Buffer.alloc(700_001, 7));
  writeFileSync(path.join(src, `${LONG_DIR}/f`), "long");
  writeFileSync(path.join(src, LONGER), "longer");
  writeFileSync(path.join(src, "run.sh"), "#!/bin/sh\n", { mode: 0o755 });
  return src;
}

function tree(dir: string): Record<string, string> {
  const out: Record<string, string> = {};
  const files = execFileSync("find", [".", "-mindepth", "1"], { cwd: dir, encoding: "utf8" })
    .split("\n")
    .filter(Boolean)
    .sort();
  for (const f of files) {
    const st = statSync(path.join(dir, f));
    out[f] = st.isDirectory()
      ? "dir"
      : `${st.size}:${st.mode & 0o111 ? "x" : "-"}:${readFileSync(path.join(dir, f)).subarray(0, 8).toString("hex")}`;
  }
  return out;
}

function python(script: string, out: string): void {
  execFileSync("python3", ["-c", script, out]);
}

describe("tar", () => {
  it("round-trips files, directories, long names and the exec bit", async () => {
    const src = sample();
    const dst = fresh();
    const summary = await extractTar(packTar(src), dst);
    expect(tree(dst)).toEqual(tree(src));
    expect(summary).toEqual({ files: 6, bytes: 6 + 700_001 + 4 + 6 + 10 });
  });

  it("writes archives GNU tar reads, and reads archives GNU tar writes", async () => {
    const src = sample();
    const file = path.join(fresh(), "a.tar");
    const chunks: Buffer[] = [];
    for await (const c of packTar(src)) chunks.push(c as Buffer);
    writeFileSync(file, Buffer.concat(chunks));
    const byGnu = fresh();
    execFileSync("tar", ["-xf", file, "-C", byGnu]);
    expect(tree(byGnu)).toEqual(tree(src));

    const gnuFile = path.join(fresh(), "g.tar");
    execFileSync("tar", ["-cf", gnuFile, "-C", src, "."]);
    const ours = fresh();
    await extractTar(createReadStream(gnuFile), ours);
    expect(tree(ours)).toEqual(tree(src));
  });

  it.each([
    [
      "a symbolic link",
      "t=tarfile.TarInfo('link'); t.type=tarfile.SYMTYPE; t.linkname='/etc/passwd'; f.addfile(t)",
    ],
    ["a hard link", "t=tarfile.TarInfo('hl'); t.type=tarfile.LNKTYPE; t.linkname='x'; f.addfile(t)"],
    ["an absolute path", "t=tarfile.TarInfo('/tmp/evil'); t.size=1; f.addfile(t, io.BytesIO(b'x'))"],
    ["a path with ..", "t=tarfile.TarInfo('a/../../evil'); t.size=1; f.addfile(t, io.BytesIO(b'x'))"],
    ["a device", "t=tarfile.TarInfo('dev'); t.type=tarfile.CHRTYPE; f.addfile(t)"],
  ])("refuses %s with runner.bad_archive and writes nothing outside", async (_what, add) => {
    const file = path.join(fresh(), "bad.tar");
    python(`import sys, tarfile, io\nwith tarfile.open(sys.argv[1], 'w') as f:\n  ${add}`, file);
    const dst = fresh();
    await expect(extractTar(createReadStream(file), dst)).rejects.toMatchObject({
      code: "runner.bad_archive",
    });
    expect(() => statSync(path.join(work, "evil"))).toThrow();
  });

  it("refuses truncated archives, bad checksums and duplicate entries", async () => {
    const src = sample();
    const chunks: Buffer[] = [];
    for await (const c of packTar(src)) chunks.push(c as Buffer);
    const whole = Buffer.concat(chunks);
    await expect(extractTar(Readable.from([whole.subarray(0, 5000)]), fresh())).rejects.toMatchObject({
      code: "runner.bad_archive",
    });
    const corrupt = Buffer.from(whole);
    corrupt[10] = (corrupt[10]! + 1) % 256;
    await expect(extractTar(Readable.from([corrupt]), fresh())).rejects.toMatchObject({
      code: "runner.bad_archive",
    });
    const file = path.join(fresh(), "dup.tar");
    python(
      "import sys, tarfile, io\nwith tarfile.open(sys.argv[1], 'w') as f:\n  for _ in range(2):\n    t=tarfile.TarInfo('same'); t.size=1; f.addfile(t, io.BytesIO(b'x'))",
      file,
    );
    await expect(extractTar(createReadStream(file), fresh())).rejects.toMatchObject({
      code: "runner.bad_archive",
    });
  });

  it("stops at maxBytes with runner.output_too_large", async () => {
    await expect(extractTar(packTar(sample()), fresh(), { maxBytes: 1000 })).rejects.toMatchObject({
      code: "runner.output_too_large",
    });
  });

  it("keeps links that stay inside as links, and never follows one", async () => {
    const src = fresh();
    mkdirSync(path.join(src, "sub"));
    writeFileSync(path.join(src, "sub/data"), "inside");
    symlinkSync("sub/data", path.join(src, "rel"));
    symlinkSync("/out/sub/data", path.join(src, "sub/abs")); // absolute, as the container saw it
    symlinkSync(".", path.join(src, "loop"));
    symlinkSync("../sub", path.join(src, "sub/self"));
    const dst = fresh();
    const summary = await extractTar(packTar(src, { shownAs: "/out" }), dst);
    expect(summary.files).toBe(1);
    expect(readlinkSync(path.join(dst, "rel"))).toBe("sub/data");
    expect(readlinkSync(path.join(dst, "sub/abs"))).toBe("data");
    expect(readlinkSync(path.join(dst, "loop"))).toBe(".");
    expect(readlinkSync(path.join(dst, "sub/self"))).toBe(".");
    expect(readFileSync(path.join(dst, "rel"), "utf8")).toBe("inside");
    // GNU tar agrees on what the archive holds.
    const file = path.join(fresh(), "links.tar");
    const chunks: Buffer[] = [];
    for await (const c of packTar(src, { shownAs: "/out" })) chunks.push(c as Buffer);
    writeFileSync(file, Buffer.concat(chunks));
    const listing = execFileSync("tar", ["-tvf", file], { encoding: "utf8" });
    expect(listing).toMatch(/^l.* rel -> sub\/data$/m);
  });

  it.each([
    [
      "an absolute link to a host file",
      (d: string) => symlinkSync("/etc/hostname", path.join(d, "h")),
      "/out/h",
    ],
    ["a link climbing out", (d: string) => symlinkSync("../../etc", path.join(d, "up")), "/out/up"],
    [
      "a link deep inside climbing out",
      (d: string) => {
        mkdirSync(path.join(d, "a"));
        symlinkSync("../..", path.join(d, "a/x"));
      },
      "/out/a/x",
    ],
    ["a FIFO", (d: string) => execFileSync("mkfifo", [path.join(d, "pipe")]), "/out/pipe"],
  ])("refuses %s, naming it as the container saw it", async (_what, make, shown) => {
    const src = fresh();
    writeFileSync(path.join(src, "ok"), "fine");
    make(src);
    const err = await scanTree(src, { shownAs: "/out" }).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: "output.bad_entry" });
    expect((err as Error).message).toContain(shown);
    expect((err as Error).message).not.toContain(src);
  });

  it("refuses an output directory that is itself a link, and more entries than allowed", async () => {
    const real = fresh();
    const parent = fresh();
    symlinkSync(real, path.join(parent, "out"));
    await expect(scanTree(path.join(parent, "out"), { shownAs: "/out" })).rejects.toMatchObject({
      code: "output.bad_entry",
      message: "/out is a symbolic link; it must be a directory",
    });
    for (let i = 0; i < 5; i++) writeFileSync(path.join(real, `f${i}`), "");
    await expect(scanTree(real, { maxEntries: 4 })).rejects.toMatchObject({
      code: "runner.output_too_many_files",
    });
    await expect(extractTar(packTar(real), fresh(), { maxEntries: 4 })).rejects.toMatchObject({
      code: "runner.output_too_many_files",
    });
  });

  it("skips outside links when asked (a subdirectory of a stored output)", async () => {
    const src = fresh();
    mkdirSync(path.join(src, "sub"));
    writeFileSync(path.join(src, "top"), "t");
    symlinkSync("../top", path.join(src, "sub/up"));
    writeFileSync(path.join(src, "sub/own"), "o");
    const dst = fresh();
    await extractTar(packTar(path.join(src, "sub"), { outsideLinks: "skip" }), dst);
    expect(tree(dst)).toEqual({ "./own": "1:-:6f" });
  });

  it.each([
    [
      "a link that leaves the archive",
      "t=tarfile.TarInfo('a'); t.type=tarfile.SYMTYPE; t.linkname='../x'; f.addfile(t)",
    ],
    [
      "an entry below a link",
      "t=tarfile.TarInfo('d'); t.type=tarfile.SYMTYPE; t.linkname='.'; f.addfile(t)\n  t=tarfile.TarInfo('d/evil'); t.size=1; f.addfile(t, io.BytesIO(b'x'))",
    ],
    [
      "a directory entry over a link",
      "t=tarfile.TarInfo('d'); t.type=tarfile.SYMTYPE; t.linkname='.'; f.addfile(t)\n  t=tarfile.TarInfo('d'); t.type=tarfile.DIRTYPE; f.addfile(t)",
    ],
  ])("refuses %s when extracting", async (_what, add) => {
    const file = path.join(fresh(), "bad.tar");
    python(`import sys, tarfile, io\nwith tarfile.open(sys.argv[1], 'w') as f:\n  ${add}`, file);
    await expect(extractTar(createReadStream(file), fresh())).rejects.toMatchObject({
      code: "runner.bad_archive",
    });
  });

  it("normalises link targets to climb only out of the link's own directory", () => {
    expect(linkInside("a/b/l", "../c")).toBe("../c");
    expect(linkInside("a/b/l", "../../c/d")).toBe("../../c/d");
    expect(linkInside("a/b/l", "x/../../b/y")).toBe("y");
    expect(linkInside("a/l", "../..")).toBeNull();
    expect(linkInside("l", "/out/a", "/out")).toBe("a");
    expect(linkInside("l", "/outside", "/out")).toBeNull();
    expect(linkInside("l", "/out", "/out")).toBe(".");
    expect(linkInside("l", "/etc/passwd")).toBeNull();
  });
});

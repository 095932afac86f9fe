/**
 * What the GAHP asks of the REST server (users' API and the content-addressed store), with at most
 * `concurrency` requests or transfers in flight over all GAHP requests together.
 */
import { createWriteStream } from "node:fs";
import { rm } from "node:fs/promises";
import { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { type CasClient, createCasClient } from "../../lib/cas/client.ts";
import { ApiClient } from "../client.ts";

/** The bundle fields the GAHP reads. */
export interface GahpBundle {
  uuid: string;
  name: string;
  state: string;
  stateReason: string | null;
  exitCode: number | null;
  env: Record<string, string>;
  resourceUsage: Record<string, number> | null;
  timings: { runningAt: string | null; finishedAt: string | null };
  updatedAt: string;
}

/** A counting semaphore: run() waits for a free slot. */
export class Limiter {
  private active = 0;
  private readonly waiting: (() => void)[] = [];

  constructor(private readonly max: number) {}

  async run<T>(fn: () => Promise<T>): Promise<T> {
    if (this.active >= this.max) await new Promise<void>((ok) => this.waiting.push(ok));
    else this.active++;
    try {
      return await fn();
    } finally {
      const next = this.waiting.shift();
      if (next === undefined) this.active--;
      else next();
    }
  }
}

export class GahpApi {
  private readonly client: ApiClient;
  readonly cas: CasClient;

  constructor(
    readonly apiUrl: string,
    token: string,
    private readonly limiter: Limiter,
    signal: AbortSignal,
  ) {
    this.client = new ApiClient({ apiUrl, token }, signal);
    this.cas = createCasClient({ url: apiUrl, token, signal });
  }

  private call<T>(method: string, path: string, body?: unknown): Promise<T> {
    return this.limiter.run(() => this.client.request<T>(method, path, body));
  }

  limited<T>(fn: () => Promise<T>): Promise<T> {
    return this.limiter.run(fn);
  }

  async whoami(): Promise<{ uuid: string; name: string }> {
    return this.call("GET", "api/v1/users/current");
  }

  /** Every bundle of the caller, page by page. */
  async allBundles(): Promise<GahpBundle[]> {
    const out: GahpBundle[] = [];
    let cursor: string | null = null;
    do {
      const q: string = cursor === null ? "" : `&cursor=${encodeURIComponent(cursor)}`;
      const page: { items: GahpBundle[]; nextCursor: string | null } = await this.call(
        "GET",
        `api/v1/bundles?limit=500${q}`,
      );
      out.push(...page.items);
      cursor = page.nextCursor;
    } while (cursor !== null);
    return out;
  }

  /**
   * Every bundle of the caller that is not final yet, page by page, and the server's clock at the first answer
   * (seconds, from the Date header).
   */
  async liveBundles(): Promise<{ bundles: GahpBundle[]; serverSeconds: number }> {
    const out: GahpBundle[] = [];
    let serverSeconds = Number.POSITIVE_INFINITY;
    let cursor: string | null = null;
    do {
      const q: string = cursor === null ? "" : `&cursor=${encodeURIComponent(cursor)}`;
      const page = await this.limiter.run(async () => {
        const res = await this.client.raw(
          "GET",
          `api/v1/bundles?state=created,staged,starting,running&limit=500${q}`,
        );
        const date = Date.parse(res.headers.get("date") ?? "");
        if (!Number.isNaN(date)) serverSeconds = Math.min(serverSeconds, date / 1000);
        return (await res.json()) as { items: GahpBundle[]; nextCursor: string | null };
      });
      out.push(...page.items);
      cursor = page.nextCursor;
    } while (cursor !== null);
    return { bundles: out, serverSeconds };
  }

  /** A bundle and the server's clock when it answered (seconds, from the Date header). */
  async bundle(uuid: string): Promise<{ bundle: GahpBundle; serverSeconds: number }> {
    return this.limiter.run(async () => {
      const res = await this.client.raw("GET", `api/v1/bundles/${encodeURIComponent(uuid)}`);
      const date = Date.parse(res.headers.get("date") ?? "");
      const bundle = (await res.json()) as GahpBundle;
      return { bundle, serverSeconds: Number.isNaN(date) ? Date.now() / 1000 : date / 1000 };
    });
  }

  async createBundles(items: unknown[]): Promise<GahpBundle[]> {
    const res = await this.call<{ items: GahpBundle[] }>("POST", "api/v1/bundles/batch", { items });
    return res.items;
  }

  async createUpload(manifest: string, name: string): Promise<GahpBundle> {
    return this.call("POST", "api/v1/bundles/uploads", { manifest, name });
  }

  async kill(uuid: string, reason: string): Promise<void> {
    await this.call("POST", `api/v1/bundles/${encodeURIComponent(uuid)}/kill`, { reason });
  }

  /** The paths and sizes of every output file of a bundle. */
  async outputFiles(uuid: string): Promise<{ path: string; size: number }[]> {
    const out: { path: string; size: number }[] = [];
    let cursor: string | null = null;
    do {
      const q: string = cursor === null ? "" : `?cursor=${encodeURIComponent(cursor)}`;
      const page: { files: { path: string; size: number }[]; nextCursor: string | null } = await this.call(
        "GET",
        `api/v1/bundles/${encodeURIComponent(uuid)}/outputs${q}`,
      );
      out.push(...page.files);
      cursor = page.nextCursor;
    } while (cursor !== null);
    return out;
  }

  /** Writes one output file of a bundle to `file` (removed again if the copy fails). */
  async downloadOutput(uuid: string, path: string, file: string): Promise<void> {
    const url = `api/v1/bundles/${encodeURIComponent(uuid)}/outputs/${path.split("/").map(encodeURIComponent).join("/")}`;
    await this.download(url, file);
  }

  /** Writes a bundle's stderr log (its current attempt) to `file`. */
  async downloadStderr(uuid: string, file: string): Promise<void> {
    await this.download(`api/v1/bundles/${encodeURIComponent(uuid)}/logs?stream=stderr`, file);
  }

  private async download(url: string, file: string): Promise<void> {
    await this.limiter.run(async () => {
      const res = await this.client.raw("GET", url);
      try {
        const body = res.body === null ? Readable.from([]) : Readable.fromWeb(res.body as never);
        await pipeline(body, createWriteStream(file));
      } catch (err) {
        if (!file.startsWith("/dev/")) await rm(file, { force: true });
        throw err;
      }
    });
  }

  close(): void {
    this.cas.close();
  }
}

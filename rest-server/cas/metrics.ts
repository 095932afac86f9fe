/**
 * The content-addressed store's metrics (docs/storage.md), on the prom-client registry the caller gives:
 * what is stored (read from the database at each scrape), and the bytes that went through the API.
 */
import { Counter, Gauge, type Registry } from "prom-client";
import { casTotals } from "../../store/cas-queries.ts";
import type { Db } from "../../store/db.ts";

export interface CasMetrics {
  /** Blob bytes received by uploads (uncompressed; a blob already stored and uploaded again counts too). */
  bytesUploaded: Counter;
  /** Bytes of blobs find-missing answered present (so nobody uploaded them). */
  bytesSkipped: Counter;
  /** Blob bytes sent by reads. */
  bytesDownloaded: Counter;
}

export function createCasMetrics(registry: Registry, db: Db): CasMetrics {
  let last: Promise<Awaited<ReturnType<typeof casTotals>>> | null = null;
  /** One database read per scrape, shared by the three gauges (a scrape collects them together). */
  const totals = () => {
    if (last === null) {
      last = casTotals(db).finally(() => {
        setImmediate(() => {
          last = null;
        });
      });
    }
    return last;
  };
  new Gauge({
    name: "dispatchcloud_cas_stored_bytes",
    help: "Bytes of the blobs the content-addressed store holds.",
    registers: [registry],
    async collect() {
      this.set((await totals()).bytes);
    },
  });
  new Gauge({
    name: "dispatchcloud_cas_stored_blobs",
    help: "Blobs the content-addressed store holds.",
    registers: [registry],
    async collect() {
      this.set((await totals()).blobs);
    },
  });
  new Gauge({
    name: "dispatchcloud_cas_dedup_ratio",
    help: "Bytes the stored manifests name (each blob counted once per manifest) over the bytes stored; 1 = no sharing.",
    registers: [registry],
    async collect() {
      const t = await totals();
      this.set(t.bytes === 0 ? 1 : t.referencedBytes / t.bytes);
    },
  });
  return {
    bytesUploaded: new Counter({
      name: "dispatchcloud_cas_uploaded_bytes_total",
      help: "Blob bytes received by uploads to the content-addressed store (uncompressed).",
      registers: [registry],
    }),
    bytesSkipped: new Counter({
      name: "dispatchcloud_cas_skipped_bytes_total",
      help: "Bytes of blobs find-missing answered present, which clients did not have to upload.",
      registers: [registry],
    }),
    bytesDownloaded: new Counter({
      name: "dispatchcloud_cas_downloaded_bytes_total",
      help: "Blob bytes sent by reads from the content-addressed store.",
      registers: [registry],
    }),
  };
}

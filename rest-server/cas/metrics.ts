/**
 * The content-addressed store's metrics (docs/storage.md), on the prom-client registry the caller gives:
 * what is stored (read from the database at each scrape), and the bytes that went through the API.
 */
import { Counter, Gauge, Histogram, type Registry } from "prom-client";
import { casTotals } from "../../store/cas-queries.ts";
import type { Db } from "../../store/db.ts";

export interface CasMetrics {
  /** Blob bytes received by uploads (uncompressed; a blob already stored and uploaded again counts too). */
  bytesUploaded: Counter;
  /** Bytes of blobs find-missing answered present (so nobody uploaded them). */
  bytesSkipped: Counter;
  /** Blob bytes sent by reads. */
  bytesDownloaded: Counter;
  /** Blobs the VMs' caches already held when a bundle's inputs were staged (reported by the runner's finish). */
  vmCacheHits: Counter;
  /** Blobs the VMs' caches had to fetch from the store to stage a bundle's inputs. */
  vmCacheMisses: Counter;
  /** Bytes the VMs' caches fetched from the store. */
  vmBytesFetched: Counter;
  /** Time a bundle's runner spent staging its inputs by manifest (fetch and hard links), per bundle. */
  stagingSeconds: Histogram;
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
    vmCacheHits: new Counter({
      name: "dispatchcloud_cas_vm_cache_hits_total",
      help: "Blobs of bundles' inputs that the instance's cache already held (reported by runners at finish).",
      registers: [registry],
    }),
    vmCacheMisses: new Counter({
      name: "dispatchcloud_cas_vm_cache_misses_total",
      help: "Blobs of bundles' inputs that the instance's cache fetched from the store (reported at finish).",
      registers: [registry],
    }),
    vmBytesFetched: new Counter({
      name: "dispatchcloud_cas_vm_fetched_bytes_total",
      help: "Bytes the instances' caches fetched from the store to stage bundles' inputs.",
      registers: [registry],
    }),
    stagingSeconds: new Histogram({
      name: "dispatchcloud_cas_staging_seconds",
      help: "Time a bundle's runner spent staging its inputs from the store and the instance's cache.",
      buckets: [0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300],
      registers: [registry],
    }),
  };
}

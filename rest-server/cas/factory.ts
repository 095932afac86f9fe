/**
 * The blob backend the config names (config `cas.backend`): the filesystem under `<dataDir>/cas` or S3. The S3
 * backend is given by the composition root (`s3`), so this module does not load the AWS SDK itself.
 */
import { join } from "node:path";
import type { Config } from "../../config/schema.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { BlobBackend } from "./backend.ts";
import { createFsBackend } from "./backend-fs.ts";

export type CasConfig = Config["cas"];

export interface BackendFactories {
  /** Builds the S3 backend from cas.s3 (the S3 backend's module). */
  s3?: (s3: CasConfig["s3"]) => BlobBackend | Promise<BlobBackend>;
}

export async function createCasBackend(
  cas: CasConfig,
  dataDir: string,
  factories: BackendFactories = {},
): Promise<BlobBackend> {
  if (cas.backend === "filesystem") return createFsBackend(join(dataDir, "cas"));
  if (factories.s3 === undefined) {
    throw new DispatchCloudError("config.invalid_value", "cas.backend: s3 is not available in this program", {
      path: "cas.backend",
    });
  }
  if (cas.s3.bucket === "") {
    throw new DispatchCloudError("config.invalid_value", "cas.s3.bucket: required when cas.backend is s3", {
      path: "cas.s3.bucket",
    });
  }
  return factories.s3(cas.s3);
}

/**
 * Spot evictions on Azure, from the instance metadata service's Scheduled Events, and the client the supervisor
 * uses on any cloud (EC2's IMDSv2 first, then Azure's service at the same address).
 *
 * - `GET /metadata/instance/compute?api-version=2021-02-01` with `Metadata: true` tells whether Azure's service
 *   answers, and gives the VM's name.
 * - `GET /metadata/scheduledevents?api-version=2020-07-01` (same header) answers `{DocumentIncarnation, Events}`;
 *   an event with `EventType: "Preempt"` whose `Resources` name this VM (or name nothing) is the eviction notice:
 *   Azure gives at least 30 seconds, from `NotBefore`. Other events (Reboot, Redeploy, Freeze, Terminate) are
 *   not preemptions and are left alone.
 * - Azure turns Scheduled Events on with a VM's first request for them, which may then take up to two minutes:
 *   that one request gets FIRST_EVENTS_TIMEOUT_MS, later ones the usual 1.5 s.
 *
 * Only node modules and ./imds.ts: the supervisor loads this next to its other small modules.
 */
import {
  createImdsClient,
  DEFAULT_IMDS_TIMEOUT_MS,
  ImdsError,
  metadataRequest,
  type SpotNotice,
} from "./imds.ts";

export const COMPUTE_PATH = "/metadata/instance/compute?api-version=2021-02-01";
export const EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01";
/** Azure may take this long to answer a VM's first Scheduled Events request (it enables the service). */
export const FIRST_EVENTS_TIMEOUT_MS = 120_000;
/** The action of an Azure eviction notice, as the bundle's reason shows it. */
export const PREEMPT_ACTION = "preempt";

/** What the spot poller needs of a metadata client (see startSpotPoller). */
export interface NoticeClient {
  readonly endpoint: string;
  /** Makes sure the service answers (and, for EC2, that a valid token is held). */
  token(): Promise<void>;
  /** The current spot interruption notice, or null when there is none. */
  spotNotice(): Promise<SpotNotice | null>;
}

export interface AzureEventsClientOptions {
  endpoint: string;
  timeoutMs?: number;
  firstEventsTimeoutMs?: number;
}

export function createAzureEventsClient(opts: AzureEventsClientOptions): NoticeClient {
  const base = new URL(opts.endpoint.replace(/\/+$/, ""));
  const basePath = base.pathname.replace(/\/+$/, "");
  const timeoutMs = opts.timeoutMs ?? DEFAULT_IMDS_TIMEOUT_MS;
  const firstTimeoutMs = opts.firstEventsTimeoutMs ?? FIRST_EVENTS_TIMEOUT_MS;
  let vmName: string | null = null;
  let eventsAnswered = false;

  const get = async (path: string, timeout: number): Promise<unknown> => {
    const res = await metadataRequest(base, "GET", `${basePath}${path}`, { Metadata: "true" }, timeout);
    if (res.status !== 200) throw new ImdsError(`GET ${path}: answered ${res.status}`, res.status);
    try {
      return JSON.parse(res.body) as unknown;
    } catch {
      throw new ImdsError(`GET ${path}: the answer is not JSON`, 200);
    }
  };

  async function token(): Promise<void> {
    if (vmName !== null) return;
    const compute = await get(COMPUTE_PATH, timeoutMs);
    const name = (compute as { name?: unknown } | null)?.name;
    if (typeof name !== "string" || name === "") {
      throw new ImdsError(`GET ${COMPUTE_PATH}: the answer has no VM name`, 200);
    }
    vmName = name;
  }

  async function spotNotice(): Promise<SpotNotice | null> {
    await token();
    const events = await get(EVENTS_PATH, eventsAnswered ? timeoutMs : firstTimeoutMs);
    eventsAnswered = true;
    return parseScheduledEvents(events, vmName ?? "");
  }

  return { endpoint: opts.endpoint, token, spotNotice };
}

/** The Preempt event for VM `vmName` among Scheduled Events, as a notice; null when there is none. */
export function parseScheduledEvents(doc: unknown, vmName: string): SpotNotice | null {
  const events = (doc as { Events?: unknown } | null)?.Events;
  if (!Array.isArray(events)) throw new ImdsError(`${EVENTS_PATH}: the answer has no Events list`, 200);
  for (const e of events) {
    const event = (typeof e === "object" && e !== null ? e : {}) as Record<string, unknown>;
    if (event.EventType !== "Preempt") continue;
    const resources = Array.isArray(event.Resources) ? event.Resources : [];
    if (resources.length > 0 && !resources.includes(vmName)) continue;
    const notBefore = event.NotBefore;
    // Printable ASCII only: it ends up in a log line and the bundle's state reason.
    const time =
      typeof notBefore === "string" && notBefore.length <= 100 && /^[ -~]+$/.test(notBefore)
        ? notBefore
        : "an unknown time";
    return { action: PREEMPT_ACTION, time };
  }
  return null;
}

/**
 * The supervisor's client: EC2's IMDSv2 when its token request succeeds, else Azure's Scheduled Events when
 * Azure's service answers; the first to answer is kept. When neither does, token() fails naming both.
 */
export function createSpotNoticeClient(endpoint: string): NoticeClient {
  const ec2 = createImdsClient({ endpoint });
  const azure = createAzureEventsClient({ endpoint });
  let chosen: NoticeClient | null = null;
  async function token(): Promise<void> {
    if (chosen !== null) return chosen.token();
    try {
      await ec2.token();
      chosen = ec2;
      return;
    } catch (ec2Err) {
      try {
        await azure.token();
        chosen = azure;
      } catch (azureErr) {
        throw new ImdsError(
          `neither EC2's IMDSv2 (${(ec2Err as Error).message}) nor Azure's (${(azureErr as Error).message}) answers`,
          null,
        );
      }
    }
  }
  return {
    endpoint,
    token,
    async spotNotice() {
      if (chosen === null) await token();
      return (chosen as NoticeClient | null)?.spotNotice() ?? null;
    },
  };
}
